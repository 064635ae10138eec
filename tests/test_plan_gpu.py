"""Planning a GPU cluster: machines, NCCL's collectives on the topology, placement, compute, presets, search."""

import json
import math
import re

import pytest

from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.plan import Layout, Link, predict, trace
from distlab.plan.gpu import (Cluster, DIMS, Group, bus_bandwidth, bus_factor, collective_seconds, load_machine,
                              machine_names, placement)
from distlab.plan.search import candidates, label, search
from tests.conftest import invoke

H100 = load_machine("h100-sxm")


def test_every_preset_machine_loads_and_cites_each_number():
    """Each machine file's numbers carry their source beside them (a datasheet or NCCL's model)."""
    names = machine_names()
    assert {"h100-sxm", "h200", "a100-80g", "b200"} <= set(names)
    for name in names:
        m = load_machine(name)
        assert m.bf16_tflops > 0 and m.memory_gib > 0 and m.gpus_per_node == 8 and m.nic_gbit > 0
        text = open(m.source).read()
        assert "[latency]               # NCCL's tuning model (src/graph/tuning.cc" in text
        for line in text.splitlines():
            if re.match(r"\s*(bf16_tflops|fp32_tflops|memory_gib|memory_tbps|gpus|nvlink_gbps|nic_gbit)\s*=", line):
                assert "#" in line, f"{name}: {line!r} has no source"


def test_a_machine_file_of_the_user(tmp_path):
    text = open(H100.source).read().replace('name = "h100-sxm"', 'name = "mine"').replace("nic_gbit = 400",
                                                                                           "nic_gbit = 100")
    (tmp_path / "mine.toml").write_text(text)
    m = load_machine(str(tmp_path / "mine.toml"))
    assert m.name == "mine" and m.nic_Bps == 100e9 / 8
    (tmp_path / "bad.toml").write_text("[gpu]\nbf16_tflops = 1\n")
    with pytest.raises(ConfigError, match=r"\[gpu\] memory_gib is missing"):
        load_machine(str(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="choose one of"):
        load_machine("h900")


@pytest.mark.parametrize("kind,factor", [("all_reduce", lambda n: 2 * (n - 1) / n),
                                         ("reduce_scatter", lambda n: (n - 1) / n),
                                         ("all_gather", lambda n: (n - 1) / n),
                                         ("all_to_all", lambda n: (n - 1) / n),
                                         ("send", lambda n: 1.0)])
@pytest.mark.parametrize("n", [2, 8])
def test_bus_bandwidth_as_nccl_tests_defines_it(kind, factor, n):
    """nccl-tests: algbw = size / time, busbw = algbw x factor; on one node the bus runs at NVLink's speed,
    so size / (time - latency) x factor is NVLink's bandwidth."""
    assert bus_factor(kind, n) == pytest.approx(factor(n))
    size = 1 << 30
    g = Group(n, n)
    latency = collective_seconds(H100, kind, 0.0, g)
    busbw = size / (collective_seconds(H100, kind, size, g) - latency) * bus_factor(kind, n)
    assert busbw == pytest.approx(H100.nvlink_Bps, rel=1e-9)


def test_a_group_across_nodes_runs_at_its_nics():
    """One rank per node: one NIC's 50 GB/s; eight per node: eight NICs (400 GB/s), still under NVLink."""
    assert bus_bandwidth(H100, Group(8, 1)) == pytest.approx(400e9 / 8)
    assert bus_bandwidth(H100, Group(16, 8)) == pytest.approx(min(H100.nvlink_Bps, 8 * 400e9 / 8))
    a100 = load_machine("a100-80g")
    assert bus_bandwidth(a100, Group(64, 8)) == pytest.approx(min(300e9, 8 * 200e9 / 8))


def test_latency_is_nccls_ring_and_tree_model():
    """NCCL's tuning model: base + steps x step latency (ring); small all-reduces across nodes take the tree."""
    us = 1e-6
    assert collective_seconds(H100, "send", 0, Group(2, 2)) == pytest.approx(us * (8.4 + 3.4))
    assert collective_seconds(H100, "all_gather", 0, Group(8, 8)) == pytest.approx(us * (8.4 + 7 * 3.4))
    # 16 ranks on 2 nodes: ring 30 steps, 2 of them across nodes; tree 2 (7 x 4.0 + 1 x 14)
    ring = us * (8.4 + 28 * 3.4 + 2 * 14.0)
    tree = us * (8.4 + 2 * (7 * 4.0 + 1 * 14.0))
    assert collective_seconds(H100, "all_reduce", 0, Group(16, 8)) == pytest.approx(min(ring, tree))
    big = 1 << 32  # a large one: the ring (the tree runs at 0.92 of the bus and moves 2 S, not 2 (n-1)/n S)
    bw = bus_bandwidth(H100, Group(16, 8))
    assert collective_seconds(H100, "all_reduce", big, Group(16, 8)) == pytest.approx(ring + big * 2 * 15 / 16 / bw)


def test_groups_are_placed_tensor_parallel_first():
    """Ranks fill a node tensor-parallel first: tp 8 inside a node, dp across nodes one per node; tp 2 x cp 2
    x dp 16: the replicas (cp x dp) hold 4 of a node's 8 GPUs; the pipeline outermost; and the layout that puts
    TP across nodes is said."""
    lay = Layout(dp=8, strategy=Strategy(tp=8), global_batch=8)
    assert placement(lay, 8, ("tp",)) == Group(8, 8)
    assert placement(lay, 8, ("cp", "ep", "dp")) == Group(8, 1)
    lay = Layout(dp=16, strategy=Strategy(tp=2, cp=2), global_batch=16)
    assert placement(lay, 8, ("cp",)) == Group(2, 2)
    assert placement(lay, 8, ("cp", "ep", "dp")) == Group(32, 4)
    assert DIMS[0] == "tp" and DIMS[-1] == "pp"  # as distlab's mesh numbers ranks
    lay = Layout(dp=4, strategy=Strategy(tp=4, pp=4, microbatches=4), global_batch=16)
    assert placement(lay, 8, ("pp",)) == Group(4, 1)  # stages 16 ranks apart: one per node
    assert placement(lay, 8, ("cp", "ep", "dp")) == Group(4, 2)
    wide = Layout(dp=1, strategy=Strategy(tp=16), global_batch=1)
    assert placement(wide, 8, ("tp",)) == Group(16, 8)
    assert any("spans 2 nodes" in w for w in Cluster(H100, 2).warnings(wide))


@pytest.fixture(scope="module")
def small_lm():
    return trace("gpt", (64,), 256, attention="flash")


def test_compute_on_a_gpu_is_model_flops_at_the_efficiency_and_the_optimizer_through_hbm(small_lm):
    """One GPU, no communication: the step is the model's FLOPs (its own count) over peak x efficiency, plus
    AdamW's 28 bytes per parameter through HBM -- nothing else."""
    t = small_lm
    lay = Layout(dp=1, strategy=Strategy(precision="bf16"), optimizer="adamw", global_batch=8)
    cluster = Cluster(H100, 1)
    p = predict(t, lay, Link(), None, cluster)
    want = t.model_flops_per_sample * 8 / (H100.peak("bf16") * cluster.efficiency) \
        + 28 * t.num_parameters / (H100.memory_tbps * 1e12)
    assert p["step_s"] == pytest.approx(want, rel=1e-9)
    assert p["mfu"] == pytest.approx(t.model_flops_per_sample * 8 / p["step_s"] / H100.peak("bf16"))
    assert p["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / p["step_s"])
    assert p["cluster"]["machine"] == "h100-sxm" and p["device_memory_bytes"] == H100.memory_bytes


def test_flash_attention_keeps_no_scores(small_lm):
    """A GPU's fused attention saves queries, keys, values, output and a log-sum-exp per row: less than the
    math path's scores over a 64-token window, the rest of the model's saved tensors the same."""
    import torch
    from distlab.plan.trace import FlashAttention
    q = torch.empty(2, 4, 64, 16, device="meta", requires_grad=True)
    kv = torch.empty(2, 2, 64, 16, device="meta", requires_grad=True)  # grouped: 2 key/value heads for 4 queries
    saved = []
    with FlashAttention(), torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    assert out.shape == q.shape
    shapes = sorted(tuple(x.shape) for x in saved if x.dim() >= 3)
    assert shapes == sorted([(2, 4, 64, 16)] * 4 + [(2, 4, 64)])  # q, k and v repeated to 4 heads, out; lse
    math_t = trace("gpt", (64,), 256)
    assert small_lm.activation_bytes_per_sample < math_t.activation_bytes_per_sample
    assert small_lm.num_parameters == math_t.num_parameters


def test_search_enumerates_valid_layouts_and_ranks_those_that_fit(small_lm):
    t = small_lm
    base = Layout(dp=16, strategy=Strategy(precision="bf16"), optimizer="adamw", global_batch=64)
    cluster = Cluster(H100, 2)
    lays = list(candidates(t, base, 16, 8))
    texts = [label(lay) for lay in lays]
    assert len(texts) == len(set(texts))
    assert all(lay.world == 16 and lay.tp <= 8 for lay in lays)
    assert {lay.tp for lay in lays} == {1, 2, 4, 8} and any(lay.pp > 1 for lay in lays) \
        and any(lay.cp > 1 for lay in lays) and {lay.zero for lay in lays} >= {1, 2, 3}
    for lay in lays:  # what the search proposes a run accepts
        lay.strategy.check(lay.world)
    r = search(t, base, cluster, top=5)
    ranked = r["ranked"]
    assert 0 < len(ranked) <= 5 and r["tried"] == len(lays)
    assert [p["tokens_per_s_per_gpu"] for p in ranked] == sorted((p["tokens_per_s_per_gpu"] for p in ranked),
                                                                 reverse=True)
    assert all(p["memory_bytes_per_rank"] <= H100.memory_bytes for p in ranked)
    assert ranked[0]["strategy_text"] in r["why"]
    from distlab.plan.text import format_search
    assert format_search(r).startswith("search        16 x h100-sxm (2 nodes): ")
    one = search(t, Layout(dp=8, strategy=Strategy(precision="bf16"), optimizer="adamw", global_batch=64),
                 Cluster(H100, 1), top=1)
    assert format_search(one).startswith("search        8 x h100-sxm (1 node): ")


def test_a_search_keeps_the_dimensions_it_is_given(small_lm, tmp_path):
    """`--search --tp 2 --zero 1` searches the rest: every layout it tries has tensor parallel 2 and ZeRO-1, and
    the header says so; `--top` without `--search` is refused, as every setting that would do nothing."""
    base = Layout(dp=8, strategy=Strategy(precision="bf16", tp=2, zero=1), optimizer="adamw", global_batch=64)
    lays = list(candidates(small_lm, base, 16, 8, fixed={"tp": 2, "zero": 1}))
    everything = list(candidates(small_lm, base, 16, 8))
    assert lays and len(lays) < len(everything) and all(lay.tp == 2 and lay.zero == 1 for lay in lays)
    assert {str(lay.strategy) for lay in lays} == {str(lay.strategy) for lay in everything
                                                   if lay.tp == 2 and lay.zero == 1}
    sizes = ["--model", "gpt", "--block-size", "64", "--machine", "h100-sxm", "--gpus", "16", "--precision", "bf16",
             "--global-batch-size", "64"]
    code, out, err = invoke(["plan", *sizes, "--search", "--tp", "2", "--zero", "1", "--top", "4"], tmp_path)
    assert code == 0, err
    head, *rows = [line for line in out.splitlines() if re.match(r"^ ?\d+ ", line)]
    assert out.startswith("search        16 x h100-sxm (2 nodes), tp=2 zero=1 kept: ")
    assert len(rows) + 1 == 4 and all("tp=2+" in r and "zero=1" in r for r in [head, *rows])
    code, out, err = invoke(["plan", *sizes, "--top", "4"], tmp_path)
    assert code == 2 and "--top is for --search" in err
    code, out, err = invoke(["plan", *sizes, "--search", "--dp-sync", "ddp"], tmp_path)
    assert code == 2 and "--dp-sync with --search" in err


def test_a_search_offers_the_memory_levers_and_offload_costs_its_bytes_over_the_host_link(small_lm, tmp_path):
    """Each layout is tried with bf16 moments, the optimizer's state offloaded and (ZeRO-3) the shards too; an
    offloaded layout's step is its step plus the bytes it moves over PCIe; on a GPU too small for any layout's state
    on the device, the search ranks offloaded ones only -- and through the command it keeps a lever given."""
    import dataclasses
    base = Layout(dp=8, strategy=Strategy(precision="bf16"), optimizer="adamw", global_batch=64)
    fixed = {"tp": 1, "pp": 1, "cp": 1, "zero": 3}
    lays = list(candidates(small_lm, base, 8, 8, fixed=fixed))
    assert {(lay.optimizer_state, lay.offload) for lay in lays} == {("fp32", "none"), ("bf16", "none"),
                                                                  ("fp32", "optimizer"), ("fp32", "params")}
    assert all(lay.zero == 3 for lay in candidates(small_lm, base, 8, 8) if lay.offload == "params")
    one = Layout(dp=8, strategy=Strategy(precision="bf16", zero=3), optimizer="adamw", global_batch=64)
    plain = predict(small_lm, one, Link(), None, Cluster(H100, 1))
    off = predict(small_lm, dataclasses.replace(one, offload="params"), Link(), None, Cluster(H100, 1))
    o = off["offload"]
    assert o["seconds_per_step"] == pytest.approx(o["moved_bytes_per_step"] / H100.host_Bps) and H100.host_gbps == 64
    assert off["step_s"] == pytest.approx(plain["step_s"] + o["seconds_per_step"])
    assert off["model_state_bytes_per_rank"] < plain["model_state_bytes_per_rank"]
    rows = [predict(small_lm, lay, Link(), None, Cluster(H100, 1)) for lay in lays]
    kept = min(p["memory_bytes_per_rank"] for p, lay in zip(rows, lays) if lay.offload == "none")
    least = min(p["memory_bytes_per_rank"] for p in rows)
    assert least < kept
    tight = dataclasses.replace(H100, memory_gib=(least + kept) / 2 / 2**30)
    r = search(small_lm, base, Cluster(tight, 1), top=20, fixed=fixed)
    assert r["ranked"] and all("+offload=" in p["strategy_text"] for p in r["ranked"]), r["why"]
    code, out, err = invoke(["plan", "--model", "gpt", "--block-size", "64", "--machine", "h100-sxm", "--gpus", "8",
                             "--precision", "bf16", "--global-batch-size", "64", "--search", "--zero", "3",
                             "--tp", "1", "--pp", "1", "--cp", "1", "--offload", "optimizer"], tmp_path)
    assert code == 0, err
    assert "offload=optimizer kept" in out and re.search(r"^ 1 zero=3.*\+offload=optimizer", out, re.M), out


@pytest.mark.parametrize("flags,text", [
    (["--activation-checkpointing", "--ac-policy", "ops"], "zero=3+ckpt+ac_policy=ops+bf16"),
    (["--activation-checkpointing", "--ac-every", "2"], "zero=3+ckpt+ac_every=2+bf16"),
])
def test_the_checkpointing_modes_a_search_ranks_are_flags_of_a_plan(tmp_path, flags, text):
    """What `--search` proposes, `plan` takes as flags: selective checkpointing per op and one block in K plan
    as the library plans that layout (docs/15's first command gives --ac-policy ops)."""
    sizes = ["--model", "llama", "--n-layer", "4", "--n-embd", "64", "--n-head", "4", "--block-size", "64"]
    code, out, err = invoke(["plan", *sizes, "--machine", "h100-sxm", "--gpus", "8", "--zero", "3", *flags,
                             "--precision", "bf16", "--global-batch-size", "16", "--json", "p.json"], tmp_path)
    assert code == 0, err
    got = json.loads((tmp_path / "p.json").read_text())
    from distlab.models import options_from
    t = trace("llama", (64,), 256, options=options_from("llama", dict(n_layer=4, n_embd=64, n_head=4)),
              attention="flash")
    lay = Layout(dp=8, strategy=Strategy.parse(text), global_batch=16)
    want = predict(t, lay, Link(), None, Cluster(H100, 1))
    plain = predict(t, Layout(dp=8, strategy=Strategy.parse("zero=3+ckpt+bf16"), global_batch=16), Link(), None,
                    Cluster(H100, 1))
    assert (got["memory_bytes_per_rank"], got["step_s"]) == (want["memory_bytes_per_rank"], want["step_s"])
    assert (want["memory_bytes_per_rank"], want["step_s"]) != (plain["memory_bytes_per_rank"], plain["step_s"])


def test_plan_a_preset_on_a_cluster_through_the_cli(tmp_path):
    code, out, err = invoke(["plan", "--preset", "llama3-8b", "--block-size", "1024", "--machine", "h100-sxm",
                             "--gpus", "16", "--tp", "2", "--zero", "3", "--precision", "bf16",
                             "--global-batch-size", "16", "--optimizer", "adamw", "--json", "p.json"], tmp_path)
    assert code == 0, err
    assert "machine       2 x h100-sxm (16 GPUs, 8 per node)" in out
    assert "tokens/s per GPU" in out and "MFU" in out and "fits" in out
    assert "parameters    8,030,261,248" in out  # Meta-Llama-3-8B's published size, from its config.json
    assert "was not calibrated" in err
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["layout"]["dp"] == 8 and p["layout"]["world_size"] == 16  # --dp filled from --gpus
    assert p["cluster"]["gpus"] == 16


@pytest.mark.parametrize("args,needle", [
    (["--machine", "h100-sxm", "--gpus", "12"], "multiple of it"),
    (["--machine", "h100-sxm", "--gpus", "16", "--dp", "4"], "make them equal"),
    (["--machine", "h100-sxm", "--gpus", "8", "--dp", "3"], "make them equal"),  # before the batch's 64 / 3
    (["--machine", "h100-sxm", "--link", "10gbit"], "--link with --machine"),  # were ignored: the machine's own
    (["--machine", "h100-sxm", "--threads", "4"], "--threads with --machine"),
    (["--nodes", "2"], "give --machine too"),
    (["--machine", "h900"], "choose one of"),
    (["--search", "--machine", "h100-sxm"], "give --machine and --gpus"),
])
def test_bad_cluster_flags_are_refused(tmp_path, args, needle):
    code, out, err = invoke(["plan", "--model", "gpt", *args], tmp_path)
    assert code != 0 and needle in err, err


def test_a_gpu_calibration_from_another_device_is_refused_or_named(tmp_path):
    """`plan calibrate --device` times the model's shapes where it runs; a CPU's rates have no peak to be a
    fraction of, so a GPU plan refuses them."""
    code, out, err = invoke(["plan", "calibrate", "--device", "cpu", "--model", "gpt", "--block-size", "32",
                             "-o", "cal.json"], tmp_path)
    assert code == 0, err
    cal = json.loads((tmp_path / "cal.json").read_text())
    assert cal["kind"] == "distlab-plan-gpu-calibration" and cal["matmul_flops_per_s"] > 0
    assert {s["op"] for s in cal["shapes"]} == {"linear", "attention"}
    code, out, err = invoke(["plan", "--model", "gpt", "--machine", "h100-sxm", "--calibration", "cal.json"], tmp_path)
    assert code != 0 and "no datasheet peak" in err
    cal.update(device="NVIDIA H200", peak_flops=989.4e12)
    (tmp_path / "h200.json").write_text(json.dumps(cal))
    code, out, err = invoke(["plan", "--model", "gpt", "--machine", "h100-sxm", "--calibration", "h200.json"],
                            tmp_path)
    assert code == 0 and "measured on NVIDIA H200, not on h100-sxm" in err
    assert math.isfinite(float(re.search(r"MFU ([0-9.]+)%", out).group(1)))


def test_published_runs_print_and_render_as_markdown_with_their_errors(tmp_path):
    """`plan published` predicts a row on the machine it ran on; its JSON renders through `bench markdown`."""
    code, out, err = invoke(["plan", "published", "tt-a100-l2-13b-none", "--json", "p.json"], tmp_path)
    assert code == 0, err
    row = json.loads((tmp_path / "p.json").read_text())["rows"][0]
    assert row["machine"] == "a100-80g" and row["source"]
    err_pct = f"{row['throughput_err']:+.0%}"
    assert row["throughput_err"] == pytest.approx(
        row["predicted_tokens_per_s_per_gpu"] / row["published_tokens_per_s_per_gpu"] - 1)
    assert err_pct in out and "median |error|: throughput" in out
    code, out, err = invoke(["bench", "markdown", "p.json"], tmp_path)
    assert code == 0, err
    assert out.startswith("| run | model | GPUs |") and f"| tt-a100-l2-13b-none | llama2-13b | 64 |" in out
    assert f"| {err_pct} |" in out


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.replace("bf16_tflops = 312.0", "bf16_tflops = nan"), "[gpu] bf16_tflops is nan; it must be a finite"),
    (lambda t: t.replace("bf16_tflops = 312.0", "bf16_tflops = inf"), "[gpu] bf16_tflops is inf"),
    (lambda t: t.replace("memory_gib = 80.0", "memory_gib = -80.0"), "[gpu] memory_gib is -80.0"),
    (lambda t: t.replace("gpus = 8 ", "gpus = -8 "), "[node] gpus is -8; it must be a whole number above 0"),
    (lambda t: t.replace("gpus = 8 ", "gpus = 0 "), "[node] gpus is 0"),
    (lambda t: t.replace("gpus = 8 ", "gpus = 8.5 "), "[node] gpus is 8.5"),
    (lambda t: t.replace("nic_gbit = 200", 'nic_gbit = "fast"'), "[network] nic_gbit is 'fast'"),
    (lambda t: t.replace("net_step_us = 14.0", ""), "[latency] net_step_us is missing"),
    (lambda t: "a = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
    (lambda t: "\x00\x01", "not a machine file")],
    ids=["nan", "inf", "negative-memory", "negative-gpus", "zero-gpus", "fractional-gpus", "text", "missing", "deep",
         "binary"])
def test_a_machine_file_whose_numbers_are_not_a_machines_is_refused_in_one_line(tmp_path, edit, needle):
    """`plan --machine FILE.toml`: every number finite and in its range, `gpus` a whole number -- a NaN planned
    "nan h per step", negative GPUs per node negative communication, and inf, 0 or a deep file were tracebacks."""
    from distlab.plan.gpu import MACHINES_DIR
    (tmp_path / "m.toml").write_text(edit((MACHINES_DIR / "a100-80g.toml").read_text()))
    code, out, err = invoke(["plan", "--preset", "llama3-8b", "--machine", "m.toml", "--gpus", "8"], tmp_path)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def test_a_preset_is_a_listed_name_and_a_config_alone_claims_only_sizes_a_model_has(tmp_path):
    """`--preset ../../x` is no path to another .json; `plan --model hf:DIR` of a config alone (no weights to hold
    its layers to, as train holds them) with 10^9 layers, a width of 2^30 or a vocabulary of 2^40 is refused in
    one line -- it hung, ran out of memory or overflowed -- while a real-sized one plans."""
    (tmp_path / "x.json").write_text(json.dumps({"config": {}, "source": "x"}))
    code, out, err = invoke(["plan", "--preset", f"../../../../../../..{tmp_path}/x", "--machine", "h100-sxm",
                             "--gpus", "8"], tmp_path)
    assert code == 2 and "no such preset" in err, err
    from distlab.plan.presets import preset
    config = preset("llama3.2-1b")[0]
    for n, (change, needle) in enumerate([({"num_hidden_layers": 10**9}, "num_hidden_layers 1,000,000,000"),
                                          ({"num_hidden_layers": 10**6}, "num_hidden_layers 1,000,000"),
                                          ({"hidden_size": 2**30}, "n_embd 1,073,741,824"),
                                          ({"vocab_size": 2**40}, "vocab_size 1,099,511,627,776"), ({}, None)]):
        (tmp_path / f"m{n}").mkdir()
        (tmp_path / f"m{n}" / "config.json").write_text(json.dumps({**config, **change}))
        code, out, err = invoke(["plan", "--model", f"hf:{tmp_path / f'm{n}'}", "--machine", "h100-sxm", "--gpus",
                                 "8", "--dp", "8", "--block-size", "256"], tmp_path)
        if needle is None:
            assert code == 0, err
        else:
            assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_grpo_rollout_on_a_gpu_is_decoding_through_hbm_and_says_what_dominates(small_lm, tmp_path):
    """A GRPO step's rollout on a GPU: the ZeRO-3 shards all-gathered once, each prompt's ``G`` rows prefilled,
    then one decoding step per new token reading the float32 copy's weights and the cache so far through HBM (or
    its FLOPs, where slower); a KL to a full model's start holds a second copy and scores the rows again, as do the
    old log-probabilities of a second pass; which of rollout and update is longer is said."""
    from distlab.plan import rollout
    t, cluster = small_lm, Cluster(H100, 1)
    lay = Layout(dp=2, strategy=Strategy(zero=3), optimizer="adamw", global_batch=4, group=4, max_new_tokens=16)
    p = predict(t, lay, Link(), None, cluster)
    r = p["rollout"]
    weights, kv = 4 * t.num_parameters, t.attention_kv_bytes_per_sample / 64  # (the trace is float32)
    read = 2 * (15 * weights + 4 * kv * (15 * 48 + 15 * 16 / 2))  # 2 prompts, 15 steps after the prefill's token
    assert (r["prompts_per_rank"], r["decode_steps_per_rank"], r["generated_tokens_per_rank"]) == (2, 30, 128)
    assert r["decode_bytes_per_rank"] == int(read) and r["memory_bytes_per_rank"] == int(weights + 4 * 64 * kv)
    rate = H100.peak("fp32") * cluster.efficiency / cluster.flop_factor(t)
    assert r["decode_s"] == pytest.approx(max(read / (H100.memory_tbps * 1e12), r["decode_flops_per_rank"] / rate))
    assert r["gather_s"] == pytest.approx(collective_seconds(H100, "all_gather", 4 * t.num_parameters, Group(2, 2)))
    assert r["seconds"] == pytest.approx(r["gather_s"] + r["prefill_s"] + r["decode_s"] + r["scoring_s"])
    assert r["update_s"] == p["step_s"] and r["dominates"] == ("rollout" if r["seconds"] >= p["step_s"] else "update")
    assert p["memory_bytes_per_rank"] >= p["model_state_bytes_per_rank"] + r["memory_bytes_per_rank"]
    kl = predict(t, Layout(dp=2, optimizer="adamw", global_batch=4, group=4, max_new_tokens=16, kl_beta=0.1,
                           ppo_epochs=2), Link(), None, cluster)["rollout"]
    assert kl["memory_bytes_per_rank"] == r["memory_bytes_per_rank"] + weights and kl["scoring_passes"] == 2
    assert kl["gather_s"] == 0 and kl["scoring_s"] == pytest.approx(2 * 2 * 4 * t.forward_flops_per_sample / rate)
    assert rollout.split_dims(Layout(dp=2, strategy=Strategy(tp=2, pp=2, zero=3))) == ("tp", "pp", "dp")
    code, out, err = invoke(["plan", "--preset", "llama3.2-1b", "--dataset", "synthetic-rl", "--block-size", "512",
                             "--group-size", "8", "--max-new-tokens", "256", "--machine", "h100-sxm", "--gpus", "8",
                             "--global-batch-size", "64", "--zero", "3", "--optimizer", "adamw", "--precision", "bf16",
                             "--kl-beta", "0.1", "--ppo-epochs", "2"], tmp_path)
    assert code == 0, err
    assert re.search(r"rollout time .*: the rollout dominates: [\d.]+ s against the update's", out), out
    assert "2 float32 copies of the whole model" in out and not re.search(r"scoring 0 ms", out)


def test_hybrid_sharding_keeps_the_gathers_on_a_node_and_wins_where_the_network_is_slow(small_lm):
    """ZeRO-3 over 16 GPUs on 2 nodes against shard groups of 8 (a node's): the hybrid layout sends the reduced
    shard alone across the groups -- one all-reduce of 1/8 of the gradients over 2 ranks -- holds 8-way shards, and
    on a node with one 200 Gb/s port (examples/h100-ethernet.toml) its step is shorter; a search proposes it only
    where the replicas span nodes."""
    from pathlib import Path
    ethernet = load_machine(str(Path(__file__).parent.parent / "examples" / "h100-ethernet.toml"))
    flat = Layout(dp=16, strategy=Strategy(zero=3, precision="bf16"), optimizer="adamw", global_batch=64)
    hybrid = Layout(dp=16, strategy=Strategy(zero=3, dp_shard=8, precision="bf16"), optimizer="adamw",
                    global_batch=64)
    eight = Layout(dp=8, strategy=Strategy(zero=3, precision="bf16"), optimizer="adamw", global_batch=64)
    p_flat, p_hybrid = (predict(small_lm, lay, Link(), None, Cluster(ethernet, 2)) for lay in (flat, hybrid))
    p_eight = predict(small_lm, eight, Link(), None, Cluster(ethernet, 1))
    assert p_hybrid["model_state_bytes_per_rank"] == p_eight["model_state_bytes_per_rank"]  # ZeRO over 8 ranks
    assert p_hybrid["layout"]["dp_shard"] == 8 and "dp_shard" not in p_flat["layout"]
    shards = sum(math.ceil(n / 8) for n in small_lm.numels) * 4  # a rank's shard of every gradient, float32
    assert p_hybrid["comm_bytes_by"]["across_shard_groups"] == shards  # all-reduce over 2: 2 (2-1)/2 x the shard
    assert "across_shard_groups" not in p_flat["comm_bytes_by"]
    assert p_hybrid["step_s"] < p_flat["step_s"]
    lays = list(candidates(small_lm, flat, 16, 8, fixed={"zero": 3}))
    assert {lay.strategy.dp_shard for lay in lays if lay.tp == 1 and lay.cp == 1} == {0, 8}
    assert {lay.strategy.dp_shard for lay in lays if lay.tp == 2} == {0, 4}  # a node's 4 replicas of each TP rank
    one_node = list(candidates(small_lm, eight, 8, 8, fixed={"zero": 3}))
    assert {lay.strategy.dp_shard for lay in one_node} == {0}  # every replica on the node already


def test_an_overlapped_offload_hides_its_host_link_behind_the_next_steps_first_forward(small_lm, tmp_path):
    """``--offload-overlap``: of the bytes over PCIe, the next step's first forward (its first micro-batch: every
    parameter is read there) hides up to its own time -- half as much over 2 accumulated micro-batches; a search tries
    it under ZeRO-3 (not ZeRO-1/2, which gather the updated shards right after the step); the command takes it and
    refuses it where it cannot run."""
    import dataclasses
    base = Layout(dp=8, strategy=Strategy(precision="bf16"), optimizer="adamw", global_batch=64, offload="optimizer")
    waited = predict(small_lm, base, Link(), None, Cluster(H100, 1))
    over = predict(small_lm, dataclasses.replace(base, offload_overlap=True), Link(), None, Cluster(H100, 1))
    o = over["offload"]
    assert o["hidden_s"] == min(o["seconds_per_step"], over["first_forward_s"]) > 0
    assert waited["offload"]["hidden_s"] == 0
    assert over["step_s"] == pytest.approx(waited["step_s"] - o["hidden_s"])
    levers = {(lay.zero, lay.offload, lay.offload_overlap) for lay in candidates(small_lm, base, 8, 8)}
    assert {(3, "params", True), (3, "optimizer", True)} <= levers
    assert not any(zero in (1, 2) and overlap for zero, _, overlap in levers)
    accum = dataclasses.replace(base, strategy=Strategy(precision="bf16", grad_accum=2), offload_overlap=True)
    assert predict(small_lm, accum, Link(), None, Cluster(H100, 1))["first_forward_s"] == \
        pytest.approx(over["first_forward_s"] / 2)
    sizes = ["plan", "--model", "gpt", "--block-size", "64", "--machine", "h100-sxm", "--gpus", "8", "--precision",
             "bf16", "--optimizer", "adamw", "--global-batch-size", "64", "--offload", "optimizer", "--offload-overlap"]
    code, out, err = invoke([*sizes, "--json", str(tmp_path / "p.json")], tmp_path)
    assert code == 0, err
    assert json.loads((tmp_path / "p.json").read_text())["layout"]["offload_overlap"] is True
    code, out, err = invoke([*sizes, "--zero", "2"], tmp_path)
    assert code == 2 and "ZeRO-2 all-gathers the updated shards" in err, err
