"""The dry run (one rank of a layout on the meta device, torch's fake process group for the others, distlab's own
code path) measures what the planner predicts: the model state exactly on every layout `verify` checks, the
activations autograd saves within 1% -- and on the CLI at a size no machine here could hold."""

import json

import pytest

from distlab.data import dataset_shape
from distlab.plan import Layout, Link, predict, trace
from distlab.errors import ConfigError
from distlab.plan.dry_run import dry_run, unfollowable
from distlab.tools.verify import config_for, default_strategies, planned
from tests.conftest import invoke

WORLD = 4
LANGUAGE = ("gpt", "llama", "gemma3")
CASES = [c for c in default_strategies(WORLD) if c.model in LANGUAGE and not c.dpo and not unfollowable(c.strategy)
         and planned(c.strategy)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_dry_run_measures_what_the_plan_predicts(case):
    """Every language-model layout of `verify` a dry run can follow (no pipeline or expert routing: they read
    values): its measured model state is the plan's to the byte, its saved activations within 5% -- beyond
    that only where ZeRO-3 holds a gathered parameter through backward (a tied LM head's embedding, a frozen
    base under adapters), which the plan counts as model state and the meter also sees saved."""
    cfg = config_for(case, WORLD, steps=2)
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size)
    t = trace(cfg.model, shape, classes, options=cfg.options, lora=cfg.lora)
    st = cfg.strategy
    lay = Layout(dp=st.dp_size(WORLD), strategy=st, optimizer=cfg.optimizer, momentum=cfg.momentum,
                 global_batch=cfg.global_batch_size)
    p = predict(t, lay, Link(), None)
    m = dry_run(cfg.model, cfg.options, classes, shape, st, WORLD, WORLD - 1, cfg.global_batch_size, cfg.optimizer,
                lora=cfg.lora)
    assert m["model_state_bytes"] == p["model_state_bytes_per_rank"], m
    planned, measured = p["activation_bytes_float32_per_rank"], m["activation_bytes"]
    held = [n for u, n in enumerate(t.numels) if not t.trains(u) or t.names[u] in t.tied.values()]
    if st.zero == 3 and held:
        assert planned <= measured <= planned * 1.05 + sum(held) * t.element_size, (planned, measured)
    else:
        assert measured == pytest.approx(planned, rel=0.05)
    with pytest.raises(ConfigError, match="does not have"):
        dry_run(cfg.model, cfg.options, classes, shape, st.replace(dp_sync="ddp", zero=0), WORLD, 0,
                cfg.global_batch_size)


def test_dry_run_of_a_real_size_model_on_the_cli(tmp_path):
    """Llama 3.2 1B's shape, ZeRO-3 over 64 ranks, on this CPU in seconds: the measured state equals the plan's
    (8B and 70B: ``distlab bench dry-run``, results/plan-dry-run)."""
    code, out, err = invoke(["plan", "--preset", "llama3.2-1b", "--block-size", "512", "--dp", "64", "--zero", "3",
                             "--global-batch-size", "64", "--optimizer", "adamw", "--dry-run", "5",
                             "--json", "dry.json"], tmp_path)
    assert code == 0, err
    d = json.loads((tmp_path / "dry.json").read_text())
    assert d["dry_run"]["rank"] == 5 and d["dry_run"]["world_size"] == 64
    assert d["dry_run"]["model_state_bytes"] == d["model_state_bytes_per_rank"]
    assert "dry run" in out and "measured" in out
    code, out, err = invoke(["plan", "--model", "gpt", "--dp", "2", "--dry-run", "2"], tmp_path)
    assert code != 0 and "ranks 0..1" in err


def test_bench_dry_run_of_chosen_layouts(tmp_path):
    """`bench dry-run --strategies` dry-runs the layouts given (verify's set without it); one it cannot follow,
    or one that does not divide the world, is refused before anything is built."""
    code, out, err = invoke(["bench", "dry-run", "--presets", "llama3.2-1b", "--world", "4", "--window", "32",
                             "--strategies", "allreduce+tp=2+sp,zero=3", "--out", "b"], tmp_path)
    assert code == 0, err
    records = json.loads((tmp_path / "b" / "dry-run.json").read_text())
    assert [r["strategy"] for r in records] == ["allreduce+tp=2+sp+bf16", "zero=3+bf16"]
    assert all(r["state_equal"] for r in records)
    for bad, needle in (("zero=1+pp=2", "cannot follow"), ("allreduce+tp=3", "does not divide"), ("zero=9", "zero")):
        code, out, err = invoke(["bench", "dry-run", "--presets", "llama3.2-1b", "--world", "4", "--window", "32",
                                 "--strategies", bad, "--out", "b2"], tmp_path)
        assert code == 2 and needle in err and err.count("\n") == 1, (bad, err)
    assert not (tmp_path / "b2" / "dry-run.json").exists()


@pytest.mark.parametrize("ckpt", ["zero=3+ckpt", "zero=3+ckpt+ac_every=2", "bucketed+ckpt+ac_policy=ops",
                                  "zero=3+ckpt+ac_policy=ops", "allreduce+tp=2+sp+ckpt+ac_policy=ops",
                                  "allreduce+tp=2+ckpt+ac_policy=ops"])
def test_every_checkpointing_mode_with_a_gpus_attention_is_planned_as_measured(ckpt):
    """Attention as a GPU's flash kernel runs it, each checkpointing mode (every block, one in two, per op) on a
    Llama: the plan's activations are what a dry run of the layout saves, within 1%, its state exact (per op under
    tensor parallel: a row-parallel layer's kept output is its partial sums over every position, whole)."""
    from distlab.parallel import Strategy
    st = Strategy.parse(ckpt)
    t = trace("llama", (64,), 256, attention="flash")
    p = predict(t, Layout(dp=4 // st.model_ways, strategy=st, optimizer="adamw", global_batch=8), Link(), None)
    m = dry_run("llama", None, 256, (64,), st, 4, 3, 8, "adamw", attention="flash")
    assert m["model_state_bytes"] == p["model_state_bytes_per_rank"]
    assert m["activation_bytes"] == pytest.approx(p["activation_bytes_float32_per_rank"], rel=0.01)
    if st.ac_policy == "ops":  # half the matrix multiplications run again, not the whole forward
        assert 0 < p["activation_checkpointing"]["recompute_flops_share"] < 0.5
