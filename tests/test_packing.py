"""Packed fine-tuning windows (``--pack``, distlab.models.packing): records laid whole into each window,
each attending to itself only at its own positions -- so each computes what it computes alone, the loss
over the same targets is the unpacked one, and a skewed set wastes no window on padding."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.data import load_dataset
from distlab.models import IGNORE_INDEX, build_model, task_loss
from distlab.tools.verify import sum_tolerance
from distlab.models.packing import Packed, bind, split

FAMILIES = [("llama", {}), ("llama", {"sliding_window": 5, "qk_norm": True, "head_dim": 8}),
            ("gemma3", {"sliding_window": 4, "global_every": 2}), ("llama-moe", {"experts": 4, "top_k": 2})]


@pytest.mark.parametrize("model,options", FAMILIES, ids=["llama", "window+qk-norm", "gemma3", "moe"])
def test_a_packed_window_computes_each_record_as_it_computes_alone(model, options):
    """Three records in one window: the logits at each record's positions are those of the record alone
    (float64, within the rounding of two summation orders: verify's sum_tolerance over 21 positions x the
    widest dimension x the layers) -- rotary positions restart, no record sees another (without the mask the
    second record's logits move by ~1e-1, far past that bound) -- through local windows, q/k norms, experts."""
    from distlab.tools.verify import sum_tolerance
    torch.manual_seed(0)
    net = build_model(model, (32,), 64, n_layer=2, n_embd=32, n_head=4, **options).double().eval()
    records = [torch.randint(0, 64, (1, n)) for n in (7, 9, 5)]
    window = torch.cat(records, 1)
    with torch.no_grad():
        bind(net, _structure((7, 9, 5)))
        packed = net(window)
        bind(net, None)
        alone = torch.cat([net(r) for r in records], 1)
        plain = net(window)  # the same tokens, not packed: records see each other
    layers = sum(1 for m in net.modules() if any(True for _ in m.parameters(recurse=False)))
    widest = max(max(p.shape) for p in net.parameters())
    scale = max([1.0, alone.abs().max().item()] + [p.abs().max().item() for p in net.parameters()])
    bound = sum_tolerance(window.shape[1] * widest * layers, scale, torch.float64)
    assert (packed - alone).abs().max().item() <= bound
    assert (plain[:, 7:] - alone[:, 7:]).abs().max().item() > 1000 * bound  # the mask is what makes them equal


def _structure(lengths, rows: int = 1) -> Packed:
    """The structure of ``rows`` windows each holding records of ``lengths`` one after another."""
    starts = torch.zeros(rows, sum(lengths), dtype=torch.bool)
    starts[:, torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return Packed.of_starts(starts)


def test_a_packed_batch_carries_its_structure_beside_plain_token_ids():
    """Positions restart at each record and the records are numbered along the window; the token ids are the
    records' own (no mark in them); a plain window's forward reads nothing from the device to know it is one:
    dynamo traces a Llama block's model as one graph."""
    f = _structure((3, 2, 4))
    assert f.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert f.records.tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]
    assert [m.records.tolist() for m in _structure((2, 2), rows=4).chunk(2)] == [[[1, 1, 2, 2]] * 2] * 2
    import torch._dynamo as dynamo
    net = build_model("llama", (16,), 64, n_layer=1, n_embd=16, n_head=2)
    explained = dynamo.explain(net)(torch.randint(0, 64, (2, 16)))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _packed_attention(rank, world, style, lengths):
    from distlab.parallel.context_parallel import ContextLayout, RingAttention, UlyssesAttention
    from distlab.parallel.ring_attention import _pairs, meeting
    from distlab.models.contract import attend
    from tests.test_context_parallel import against_whole
    g = torch.Generator().manual_seed(3)
    t = sum(lengths)
    q, k, v, grad_out = (torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(4))
    records = _structure(lengths, rows=2).records
    layout = ContextLayout(world, rank)
    core = (RingAttention if style == "ring" else UlyssesAttention)(None, layout)
    diffs = against_whole(layout, (q, k, v), grad_out, lambda *z: attend(*z, records=records),
                          lambda *z: core(*z, records=records))
    meets = meeting(records, 2 * world)
    scored = [sum(1 for _ in _pairs(layout, owner, True, meets)) for owner in range(world)]
    return diffs, sum(scored), sum(sum(1 for _ in _pairs(layout, owner)) for owner in range(world))


@pytest.mark.parametrize("style", ["ring", "ulysses"])
def test_packed_attention_over_the_ring_or_all_to_all_equals_the_whole_windows_and_the_ring_skips_apart_blocks(style):
    """Each record attends to itself only on 2 context-parallel ranks as on the whole window (output and the
    three gradients, float64, within one softmax sum's rounding); the ring scores only the block pairs whose
    chunks share a record -- a record boundary at every chunk's end leaves the diagonal blocks alone."""
    from distlab.launch.spawn import run_ranks
    from tests.conftest import patience
    bound = sum_tolerance(16 * 8, 10.0, torch.float64)
    for lengths, fewer in [((3, 6, 2, 5), True), ((4, 4, 4, 4), True), ((16,), False)]:
        results = run_ranks(_packed_attention, 2, style, lengths, timeout=patience(120))
        assert max(max(diffs) for diffs, _, _ in results) <= bound, (lengths, results)
        scored, every = (sum(r[i] for r in results) for i in (1, 2))
        assert (scored < every) == fewer, (lengths, scored, every)
        if lengths == (4, 4, 4, 4):
            assert scored == 4, scored  # each rank's two chunks with themselves only


def _records(path, n=40):
    """A skewed set: most completions short, a few long."""
    with open(path, "w") as f:
        for i in range(n):
            completion = "the lazy dog " * (12 if i % 8 == 0 else 1)
            f.write(json.dumps({"prompt": f"Q{i}: ", "completion": completion.strip()}) + "\n")
    return f"sft:{path}"


def test_packed_records_keep_every_target_and_give_the_unpacked_loss(tmp_path):
    """Packed, the same 36 train records fill fewer windows with less padding; the kept targets are the same
    tokens; a model's loss summed over them (the per-token mean's numerator) is the unpacked windows' within
    float32 rounding; a non-record data set is refused."""
    from distlab.errors import ConfigError
    from distlab.tools.verify import sum_tolerance
    spec = _records(tmp_path / "r.jsonl")
    plain, packed = (load_dataset(spec, "train", block_size=160, pack=p) for p in (False, True))
    assert len(plain) == 36 and len(packed) < len(plain) / 3
    assert "36 records, packed into" in packed.about and "attends to itself only" in packed.about
    batches = [split(d.batch(torch.arange(len(d)))) for d in (plain, packed)]
    assert batches[0][2] is None and batches[1][2] is not None  # a packed batch says so, a plain one has nothing
    assert batches[1][0].min() >= 0  # plain token ids
    kept = [y[y != IGNORE_INDEX] for _, y, _ in batches]
    assert torch.equal(kept[0].sort().values, kept[1].sort().values)  # the same targets
    torch.manual_seed(0)
    net = build_model("llama", (160,), 256, n_layer=2, n_embd=32, n_head=4).eval()
    sums = []
    with torch.no_grad():
        for x, y, fields in batches:
            bind(net, fields)
            sums.append(task_loss(net(x), y, reduction="sum").item())
    assert abs(sums[0] - sums[1]) <= sum_tolerance(160 * 256 * 8, 10.0) * kept[0].numel()
    with pytest.raises(ConfigError, match="`pack` lays fine-tuning records"):
        load_dataset("synthetic-text:2000", "train", block_size=16, pack=True)


def test_pack_from_the_command_line_trains_on_every_layout(run_cli, refused_here, tmp_path):
    """`distlab train --dataset sft:... --pack`: the header says how the records were packed; TP 2 + SP, a
    pipeline of 2 stages over context parallel's ring (each stage its micro-batch's structure, each chunk its
    positions) and ZeRO-3 recomputing blocks over two accumulated micro-batches train as one process does: each
    step's loss within verify's float32 bound for SGD; a model that does not build the mask is refused before
    launch, in one line."""
    from distlab.tools.verify import sgd_tolerance
    spec = _records(tmp_path / "r.jsonl")
    args = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--dataset", spec,
            "--pack", "--block-size", "160", "--global-batch-size", "4", "--max-steps", "2", "--log-every", "1",
            "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--no-progress"]
    runs = {"one": [], "tp": ["--nproc-per-node", "2", "--tp", "2", "--sequence-parallel"],
            "pp-cp": ["--nproc-per-node", "4", "--pp", "2", "--microbatches", "2", "--cp", "2"],
            # recomputed blocks read the window their forward read; two micro-batches of one window each
            "zero3": ["--nproc-per-node", "2", "--zero", "3", "--activation-checkpointing", "--grad-accum", "2"]}
    losses = {}
    for name, extra in runs.items():
        proc = run_cli(*args, *extra, "--out", str(tmp_path / name), check=True)
        assert "36 records, packed into" in proc.stdout, proc.stdout
        losses[name] = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    bound = sgd_tolerance(2, 0.05, 4, 0.9)
    assert all(len(v) == 2 for v in losses.values()), losses
    assert max(abs(a - b) for name in runs for a, b in zip(losses["one"], losses[name])) <= bound, losses
    for extra, message in [(["--model", "gpt"], "model gpt does not read packed windows")]:
        proc = refused_here(*args, *extra)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
