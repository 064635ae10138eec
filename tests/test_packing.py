"""Packed fine-tuning windows (``--pack``, distlab.models.packing): records laid whole into each window,
each attending to itself only at its own positions -- so each computes what it computes alone, the loss
over the same targets is the unpacked one, and a skewed set wastes no window on padding."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.data import load_dataset
from distlab.data.sft import mark_start
from distlab.models import IGNORE_INDEX, build_model, task_loss

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
    at = 0
    for r in records:
        window[0, at] = mark_start(int(r[0, 0]))
        at += r.shape[1]
    with torch.no_grad():
        packed = net(window)
        alone = torch.cat([net(r) for r in records], 1)
        plain = net(torch.cat(records, 1))  # the same tokens, not packed: records see each other
    layers = sum(1 for m in net.modules() if any(True for _ in m.parameters(recurse=False)))
    widest = max(max(p.shape) for p in net.parameters())
    scale = max([1.0, alone.abs().max().item()] + [p.abs().max().item() for p in net.parameters()])
    bound = sum_tolerance(window.shape[1] * widest * layers, scale, torch.float64)
    assert (packed - alone).abs().max().item() <= bound
    assert (plain[:, 7:] - alone[:, 7:]).abs().max().item() > 1000 * bound  # the mask is what makes them equal


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
    xs, ys = (d.batch(torch.arange(len(d))) for d in (plain, packed))
    kept = [y[y != IGNORE_INDEX] for _, y in (xs, ys)]
    assert torch.equal(kept[0].sort().values, kept[1].sort().values)  # the same targets
    torch.manual_seed(0)
    net = build_model("llama", (160,), 256, n_layer=2, n_embd=32, n_head=4).eval()
    with torch.no_grad():
        sums = [task_loss(net(x), y, reduction="sum").item() for x, y in (xs, ys)]
    assert abs(sums[0] - sums[1]) <= sum_tolerance(160 * 256 * 8, 10.0) * kept[0].numel()
    with pytest.raises(ConfigError, match="`pack` lays fine-tuning records"):
        load_dataset("synthetic-text:2000", "train", block_size=16, pack=True)


def test_pack_from_the_command_line_trains_on_one_process_and_tensor_parallel(run_cli, refused_here, tmp_path):
    """`distlab train --dataset sft:... --pack`: the header says how the records were packed; one process and
    TP 2 + SP start at the same loss, and ZeRO-3 recomputing blocks over two micro-batches at one process's on
    the same batch (rounding only); a layout or a model that does not build the mask is refused before
    launch, in one line."""
    from distlab.tools.verify import sum_tolerance
    spec = _records(tmp_path / "r.jsonl")
    args = ["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--dataset", spec,
            "--pack", "--block-size", "160", "--global-batch-size", "2", "--max-steps", "2", "--log-every", "1",
            "--no-progress"]
    runs = {"one": [], "tp": ["--nproc-per-node", "2", "--tp", "2", "--sequence-parallel"],
            # recomputed blocks read the window their forward read; two micro-batches of one window each
            "zero3": ["--nproc-per-node", "2", "--zero", "3", "--activation-checkpointing", "--global-batch-size",
                      "4", "--grad-accum", "2"]}
    for name, extra in runs.items():
        proc = run_cli(*args, *extra, "--out", str(tmp_path / name), check=True)
        assert "36 records, packed into" in proc.stdout, proc.stdout
    first = [json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["loss"] for name in runs]
    assert abs(first[0] - first[1]) <= sum_tolerance(160 * 256 * 4, 10.0), first
    run_cli(*args, "--global-batch-size", "4", "--out", str(tmp_path / "one4"), check=True)
    four = json.loads((tmp_path / "one4" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(four - first[2]) <= sum_tolerance(160 * 256 * 4, 10.0), (four, first[2])
    for extra, message in [(["--nproc-per-node", "2", "--pp", "2"], "not built under --pp or --cp"),
                           (["--model", "gpt"], "model gpt does not read packed windows")]:
        proc = refused_here(*args, *extra)
        assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
