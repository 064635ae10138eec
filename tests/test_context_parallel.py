"""Context parallel: ring attention and Ulysses each compute exactly the whole sequence's causal
attention on every rank's tokens (forward and gradients, in float64 against one process), the
load-balanced layout gives every rank the same work, the bytes are the analytic volumes, and
training a GPT with the sequence split equals one process."""

import pytest
import torch
import torch.nn.functional as F

from distlab.errors import ConfigError
from distlab.parallel.context_parallel import ContextLayout, ContextParallel, ring_bytes, ulysses_bytes
from distlab.tools.verify import sum_tolerance
from tests.conftest import patience


def test_the_layout_gives_each_rank_a_chunk_and_its_mirror():
    layouts = [ContextLayout(3, r) for r in range(3)]
    assert [lay.positions(12).tolist() for lay in layouts] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    # causal work per rank: the query-key pairs the mask keeps, the same on every rank
    work = [sum(p + 1 for p in lay.positions(12).tolist()) for lay in layouts]
    assert len(set(work)) == 1
    x = torch.arange(24).reshape(2, 12)
    assert torch.equal(layouts[1].shard(x)[0], x[:, [2, 3, 8, 9]])
    with pytest.raises(ConfigError, match="2 x `cp` = 6 equal chunks"):
        layouts[0].positions(8)


def _attention(rank, world, style, heads, t, causal=True):
    from distlab.comm import accounting
    from distlab.parallel.context_parallel import ContextLayout, PlainRingAttention, RingAttention, UlyssesAttention
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, t, 8, generator=g, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(2, heads, t, 8, generator=g, dtype=torch.float64)
    layout = ContextLayout(world, rank)
    leaves = [z.clone().requires_grad_() for z in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    ref.backward(grad_out)
    index = layout.positions(t)
    mine = [z.index_select(2, index).clone().requires_grad_() for z in (q, k, v)]
    core = {"ring": RingAttention, "ring_plain": PlainRingAttention, "ulysses": UlyssesAttention}[style](
        None, layout, causal=causal)
    accounting.reset()
    out = core(*mine)
    out.backward(grad_out.index_select(2, index))
    sent = accounting.stats().bytes_sent
    diffs = [(out - ref.index_select(2, index)).abs().max().item()]
    diffs += [(m.grad - z.grad.index_select(2, index)).abs().max().item() for m, z in zip(mine, leaves)]
    return diffs, sent


def _volume(style: str, heads: int, t: int, world: int) -> int:
    if style == "ring_plain":  # every block's keys and values one hop forward, their gradient one hop back, n-1 times
        return 2 * (world - 1) * 2 * 2 * heads * (t // world) * 8 * 8
    return (ring_bytes if style == "ring" else ulysses_bytes)(2, heads, t, 8, world, itemsize=8)


@pytest.mark.parametrize("style,world,heads", [("ring", 2, 2), ("ring", 3, 2), ("ulysses", 2, 2), ("ulysses", 3, 3),
                                               ("ring_plain", 2, 2), ("ring_plain", 3, 2)])
def test_attention_over_the_ring_or_all_to_all_equals_the_whole_sequences(style, world, heads):
    """Each style against torch's attention over the whole sequences -- the plain ring (the idea alone) and the
    tuned one are held to the same exact reference, so to each other."""
    from distlab.launch.spawn import run_ranks
    t = 4 * world * 2
    results = run_ranks(_attention, world, style, heads, t, timeout=120)
    # float64: one softmax-weighted sum over at most t keys (values, gradients of size ~10), in another order
    bound = sum_tolerance(t * 8, 10.0, torch.float64)
    for diffs, _ in results:
        assert max(diffs) <= bound, (diffs, bound)
    volume = _volume(style, heads, t, world)
    assert all(sent == volume for _, sent in results), ([s for _, s in results], volume)


@pytest.mark.parametrize("style,world", [("ring", 2), ("ring", 3), ("ulysses", 2), ("ring_plain", 3)])
def test_non_causal_attention_over_the_ring_or_all_to_all_equals_the_whole_sequences(style, world):
    """An encoder's attention (torch's test_ring_attention_sdpa runs is_causal=False too): every query scores
    every key, so the ring visits every block of every rank, on the same bytes."""
    from distlab.launch.spawn import run_ranks
    t = 4 * world * 2
    results = run_ranks(_attention, world, style, world, t, False, timeout=120)
    bound = sum_tolerance(t * 8, 10.0, torch.float64)
    for diffs, _ in results:
        assert max(diffs) <= bound, (diffs, bound)
    volume = _volume(style, world, t, world)
    assert all(sent == volume for _, sent in results), ([s for _, s in results], volume)


def test_a_models_non_causal_attention_core_gets_a_non_causal_context_parallel_one():
    from distlab.models.decoder import AttentionCore
    from distlab.parallel.context_parallel import RingAttention, replacement
    core = AttentionCore()
    assert replacement(core, None, None, "ring").causal is True
    core.causal = False  # an encoder's: declared on the module the plan names
    assert isinstance(replacement(core, None, None, "ring"), RingAttention)
    assert replacement(core, None, None, "ring").causal is False and replacement(core, None, None, "ulysses").causal is False


def test_ulysses_needs_heads_that_divide():
    from distlab.launch.spawn import RankFailure, run_ranks
    with pytest.raises(RankFailure, match="do not divide; use --cp-style ring"):
        run_ranks(_attention, 2, "ulysses", 3, 8, timeout=60)


def test_training_with_the_sequence_split_equals_one_process():
    """On 4 ranks: dp 2 x cp 2, cp 4 (ring and Ulysses), cp with tensor parallel, cp with a pipeline
    and with ZeRO -- each trains the transformer as one process does (verify's float32 bound, SGD)."""
    from distlab.tools.verify import parse_strategy, verify
    cases = ["bucketed+cp=2+gpt", "bucketed+cp=4+gpt", "bucketed+cp=4+ulysses+gpt", "allreduce+tp=2+cp=2+gpt",
             "allreduce+tp=2+cp=2+ulysses+gpt", "bucketed+cp=2+pp=2+mb=2+gpt", "cp=2+zero=2+gpt"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=3, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r


def test_the_cli_splits_the_sequence_and_each_rank_holds_its_share_of_the_activations(refused_here, run_cli, tmp_path):
    common = ["train", "--model", "gpt", "--dataset", "synthetic-text:6000", "--n-layer", "1", "--n-embd", "32",
              "--n-head", "4", "--block-size", "64", "--global-batch-size", "8", "--max-steps", "3", "--lr-schedule",
              "constant", "--no-progress"]
    run_cli(*common, "--out", "one", check=True)
    proc = run_cli(*common, "--nproc-per-node", "2", "--cp", "2", "--out", "cp2", check=True, timeout=240)
    assert "dp 1 x cp 2: CP groups [0, 1]" in proc.stdout and "32 tokens of each sequence per context-parallel rank" in proc.stdout \
        and "context parallel: each sequence split over 2 ranks (ring: 1/2 of its tokens each, chunks c and 3-c of 4)" \
        in proc.stdout
    import json
    one, cp2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "cp2"))
    assert cp2["strategy"]["cp"] == 2 and cp2["mesh"]["cp"] == 2 and not cp2["inactive"]
    # each rank holds its 32 of the 64 tokens' activations: about half (the embedding's ids and the loss's
    # targets are small); never more than 0.6 of one process's
    ratio = cp2["activation_peak_bytes"] / one["activation_peak_bytes"]
    assert 0.4 < ratio < 0.6, ratio
    # the same 3 SGD steps in another summation order: verify's float32 bound (it bounds losses as parameters)
    from distlab.tools.verify import sgd_tolerance
    assert abs(cp2["test_loss"] - one["test_loss"]) <= sgd_tolerance(3, 0.05, 8 * 64, 0.9)
    bad = refused_here(*common, "--nproc-per-node", "2", "--cp", "2", "--block-size", "66", "--out", "bad")
    assert bad.returncode == 2 and "2 x --cp = 4 equal chunks" in bad.stderr
    bad = refused_here(*common, "--nproc-per-node", "2", "--cp", "2", "--tp", "2", "--out", "bad")
    assert bad.returncode == 2 and "does not divide the world size 2" in bad.stderr
    bad = refused_here("train", "--model", "mlp", "--dataset", "synthetic:1x4x4:2", "--nproc-per-node", "2", "--cp", "2",
                  "--out", "bad")
    assert bad.returncode == 2 and "context_parallel_plan" in bad.stderr


def test_the_plan_splits_activations_and_counts_the_ring_and_all_to_all_bytes():
    from distlab.parallel import Strategy
    from distlab.plan.trace import trace
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    t = trace("gpt", (64,), 256, n_layer=2, n_head=4, n_embd=32)
    assert t.attention_kv_bytes_per_sample == 2 * 2 * 64 * 32 * 4  # 2 attentions x (keys + values) x T x C floats
    one = predict(t, Layout(dp=1, global_batch=8), Link(), None)
    dp2 = predict(t, Layout(dp=2, global_batch=8), Link(), None)
    for style, volume in (("ring", ring_bytes), ("ulysses", ulysses_bytes)):
        p = predict(t, Layout(dp=1, strategy=Strategy(cp=2, cp_style=style), global_batch=8), Link(), None)
        assert p["context_parallel"]["bytes_per_step_per_rank"] == 2 * volume(8, 4, 64, 8, 2)  # 2 attentions
        # half of every sequence's activations; the ring's attention keeps its output and log-sum-exp, not the
        # scores the traced (math) attention saves
        kept = 0 if style == "ulysses" else sum(t.attention_scores.values()) * 8 / 2
        assert p["activation_bytes_per_rank"] == pytest.approx(one["activation_bytes_per_rank"] / 2 - kept, abs=2)
        assert p["model_state_bytes_per_rank"] == dp2["model_state_bytes_per_rank"]  # 2 replicas, as dp 2
    with pytest.raises(ConfigError, match="declares no attention"):
        predict(trace("mlp"), Layout(dp=1, strategy=Strategy(cp=2)), Link(), None)


def test_the_plan_hides_the_rings_hops_behind_the_scoring_and_only_there():
    """On a GPU cluster the ring's hops run beside each step's scoring: what that hides is off the critical
    path, the gradients' last hop home is not; Ulysses' all-to-alls wait for their results, all exposed."""
    from distlab.parallel import Strategy
    from distlab.plan.gpu import Cluster, load_machine
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    from distlab.plan.trace import trace
    t = trace("llama", (32768,), 1024, attention="flash", n_layer=2, n_head=32, n_kv_heads=8, n_embd=4096,
              ffn_hidden=8192)
    assert set(t.attention_flops) == set(t.attention_kv)
    assert sum(t.attention_flops.values()) == 2 * 4 * 32 * 32768 * 32768 * 128  # 2 attentions, q k^T and p v
    cluster = Cluster(load_machine("h100-sxm"), nodes=1)
    got = {}
    for style in ("ring", "ulysses"):
        lay = Layout(dp=1, strategy=Strategy(cp=8, cp_style=style, precision="bf16"), global_batch=1)
        p = predict(t, lay, Link(), None, cluster)
        got[style] = p["component_comm"]["cp"]
    home = [g for g in ContextParallel().price(t, t, Layout(dp=1, strategy=Strategy(cp=8), global_batch=1), 1,
                                               None).calls if not g.hidden_flops]
    assert len(home) == 2 and all(g.hops == 1 for g in home)  # per attention, one hop home
    ring, ulysses = got["ring"], got["ulysses"]
    # (the planner's analytic NCCL times and datasheet compute, nothing measured: exact functions of the model)
    assert ulysses["exposed_s"] == ulysses["seconds"] > 0
    # at 32768 tokens a step's scoring (2 pairs of 2048 x 2048 per head) outlasts a hop on NVLink: only the hops
    # home are waited for (per attention 1 hop of 15, 1 of the 22 key/value sizes the ring sends)
    assert 0 < ring["exposed_s"] < ring["seconds"] / 15


def test_a_context_parallel_run_resumes_bitwise_and_on_another_layout(run_cli, tmp_path):
    """Killed after its step-3 snapshot (here: only that snapshot kept), the cp 2 run resumes to the
    uninterrupted run's parameters bit for bit; the same snapshot resumed by one process (resharded)
    ends within verify's float32 bound of it."""
    import shutil

    from distlab.tools.verify import sgd_tolerance
    common = ["train", "--model", "gpt", "--dataset", "synthetic-text:6000", "--n-layer", "1", "--n-embd", "32",
              "--n-head", "4", "--block-size", "32", "--global-batch-size", "8", "--max-steps", "6", "--lr-schedule",
              "constant", "--no-progress", "--snapshot-every", "3", "--keep-snapshots", "5"]
    run_cli(*common, "--nproc-per-node", "2", "--cp", "2", "--snapshot-dir", "s", "--out", "full", check=True,
            timeout=240)
    for d in ("again", "one"):
        (tmp_path / d).mkdir()
        shutil.copytree(tmp_path / "s" / "step-00000003", tmp_path / d / "step-00000003")
    run_cli(*common, "--nproc-per-node", "2", "--cp", "2", "--snapshot-dir", "again", "--resume", "auto", "--out",
            "full", check=True, timeout=240)
    run_cli(*common, "--snapshot-dir", "one", "--resume", "auto", "--out", "one-out", check=True, timeout=240)
    models = {}
    for d in ("s", "again", "one"):
        run_cli("export", f"{d}/step-00000006", "-o", f"{d}.pt", check=True)
        models[d] = torch.load(tmp_path / f"{d}.pt", weights_only=True)
    assert all(torch.equal(models["s"][k], models["again"][k]) for k in models["s"])
    diff = max((models["s"][k] - models["one"][k]).abs().max().item() for k in models["s"])
    assert diff <= sgd_tolerance(6, 0.05, 8 * 32, 0.9)


def test_fault_drills_run_the_transformer_for_its_cases(tmp_path):
    """`verify --faults ... --strategy bucketed+cp=2+gpt` drills the GPT (an MLP cannot split a sequence)."""
    from distlab.tools.faults import _Job
    from distlab.tools.verify import parse_strategy
    command = _Job(parse_strategy("bucketed+cp=2+gpt"), 2, 8, tmp_path, 60).command()
    assert command[command.index("--model") + 1] == "gpt" and "--block-size" in command and "--cp" in command
    assert _Job(parse_strategy("bucketed"), 2, 8, tmp_path, 60).command().count("mlp") == 1


def test_the_plan_says_whether_the_attention_it_prices_is_masked():
    """The trace records whether every context-parallel attention is causal; the plan's context-parallel
    report then says which balance holds (chunks paired under a mask, or every key for an encoder's)."""
    from distlab.models import build_model
    from distlab.plan.trace import trace
    model = build_model("gpt", (16,), 32, n_layer=1, n_head=2, n_embd=8)
    assert trace(model, (16,), 32).attention_causal is True
    for m in model.modules():
        if hasattr(m, "causal"):
            m.causal = False
    assert trace(model, (16,), 32).attention_causal is False


def _hop_order(rank, world, backward):
    """Every message the ring posts and waits for, and every matrix multiplication between them."""
    import types

    from torch.utils._python_dispatch import TorchDispatchMode

    from distlab.comm import p2p
    from distlab.parallel import ring_attention
    from distlab.parallel.context_parallel import ContextLayout, RingAttention
    events, alive = [], []  # (the works kept alive: an id stays one work's)

    def post(fn):
        def wrapped(*args, **kwargs):
            work = fn(*args, **kwargs)
            alive.append(work)
            events.append(("post", id(work)))
            return work
        return wrapped

    def wait_all(works):
        p2p.wait_all(works)
        events.extend(("wait", id(w)) for w in works)

    def exchange(send, dst, recv, src, group=None):  # posted and waited for at once
        events.append(("post", "x"))
        p2p.exchange(send, dst, recv, src, group)
        events.append(("wait", "x"))

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if "mm" in func.__name__:
                events.append(("mm", None))
            return func(*args, **(kwargs or {}))

    ring_attention.p2p = types.SimpleNamespace(isend=post(p2p.isend), irecv=post(p2p.irecv), wait_all=wait_all,
                                               exchange=exchange)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    out = RingAttention(None, ContextLayout(world, rank))(q, k, v)
    if backward:
        events.clear()
        with Products():
            out.sum().backward()
    else:
        events.clear()
        with Products():
            RingAttention(None, ContextLayout(world, rank))(q, k, v)
    ring_attention.p2p = p2p
    hidden = exposed = 0
    for key in {e[1] for e in events if e[0] == "post"}:
        a = next(i for i, e in enumerate(events) if e == ("post", key))
        b = next(i for i, e in enumerate(events) if e == ("wait", key))
        if any(e[0] == "mm" for e in events[a:b]):
            hidden += 1
        else:
            exposed += 1
    return hidden, exposed


@pytest.mark.parametrize("world", [2, 3])
def test_the_ring_sends_each_block_while_it_scores_the_one_it_holds(world):
    """Forward: each of the cp - 1 hops (a send and a receive) is posted before the block held is scored and
    waited for after. Backward: the keys and values ahead and the gradients behind travel while the block
    computes; only the gradients' last hop home (one send, one receive) has nothing beside it."""
    from distlab.launch.spawn import run_ranks
    for hidden, exposed in run_ranks(_hop_order, world, False, timeout=patience(120)):
        assert (hidden, exposed) == (2 * (world - 1), 0)
    for hidden, exposed in run_ranks(_hop_order, world, True, timeout=patience(120)):
        assert (hidden, exposed) == (2 * (world - 1) * 2, 2)


def against_whole(layout, qkv, grad_out, whole, core) -> list[float]:
    """How far ``core`` on this rank's tokens of ``qkv`` (``(B, H, T, D)`` each) is from ``whole`` on every token:
    the output's and the three gradients' largest differences, backward from ``grad_out``."""
    leaves = [z.clone().requires_grad_() for z in qkv]
    ref = whole(*leaves)
    ref.backward(grad_out)
    index = layout.positions(qkv[0].shape[2])
    mine = [z.index_select(2, index).clone().requires_grad_() for z in qkv]
    out = core(*mine)
    out.backward(grad_out.index_select(2, index))
    diffs = [(out - ref.index_select(2, index)).abs().max().item()]
    return diffs + [(m.grad - z.grad.index_select(2, index)).abs().max().item() for m, z in zip(mine, leaves)]


def _windowed(rank, world, window, t):
    from distlab.models.contract import attend
    from distlab.parallel.context_parallel import ContextLayout, RingAttention
    from distlab.parallel.ring_attention import _pairs
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(2))  # grouped-query
    grad_out = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    layout = ContextLayout(world, rank)
    diffs = against_whole(layout, (q, k, v), grad_out, lambda *z: attend(*z, window=window),
                          RingAttention(None, layout, window=window))
    h = t // (2 * world)
    return diffs, [sum(1 for _ in _pairs(layout, o, True, None, window, h)) for o in range(world)]


@pytest.mark.parametrize("world,window", [(2, 3), (2, 5), (2, 8), (3, 4), (3, 7)])
def test_a_sliding_window_over_the_ring_equals_the_whole_sequences_and_skips_the_blocks_before_it(world, window):
    """A window shorter than the sequence over the ring: each query sees itself and the window - 1 keys before
    it, as on the whole sequence (output and gradients, float64, grouped-query heads); the block pairs wholly
    before the window are not scored -- a window no wider than a chunk leaves each rank its own two chunks
    and the ones just before them."""
    from distlab.launch.spawn import run_ranks
    t = 4 * 2 * world
    results = run_ranks(_windowed, world, window, t, timeout=patience(120))
    bound = sum_tolerance(t * 8, 10.0, torch.float64)
    assert max(max(d) for d, _ in results) <= bound, results
    scored = sum(sum(n) for _, n in results)
    chunks = 2 * world
    # the causal pairs d chunks apart (chunks - d of them) whose nearest query and key, (d - 1) x 4 + 1 apart,
    # are inside the window
    near = sum(chunks - d for d in range(chunks) if (d - 1) * 4 + 1 < window)
    assert scored == near < chunks * (chunks + 1) // 2, (scored, near)
