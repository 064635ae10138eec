"""``distlab bench finetune``: what a fine-tune of a downloaded checkpoint costs a rank -- the whole model
trained, low-rank adapters on a frozen base, that base held in bf16 or (QLoRA) its adapted layers' weights
in 4-bit NF4 -- and ``distlab bench packing``:
padded versus packed fine-tuning windows on a set of records of skewed lengths.

finetune: each variant trains ``--init-from`` (a Hugging Face checkpoint) for ``--steps`` steps on
``--nproc`` ranks with ``--layout`` (plain SGD: no optimizer state, so the whole model's training fits a small
machine -- AdamW would add 8 bytes per trained parameter), in fresh process groups, interleaved ``--runs``
times; per run, rank 0's summary: the model state it held at its peak (parameters, gradients: what the run measures),
the peak resident set of the ranks, the median step time. packing: each mode trains a small Llama on the same
records for one epoch; the rate is the records' own tokens (not the padding) per second of training.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from distlab.bench.common import format_table, machine, text_for, train_on_ranks, write

VARIANTS = {"full": {}, "lora": {"lora": "r=16,alpha=32,targets=q,k,v,o"},
            "lora-bf16": {"lora": "r=16,alpha=32,targets=q,k,v,o", "base_dtype": "bf16", "precision": "bf16"},
            # QLoRA as its recipes run it: adapters on every linear layer, so every linear weight is 4-bit
            "lora-nf4": {"lora": "r=16,alpha=32,targets=all", "base_dtype": "nf4", "precision": "bf16"}}
MODES = ("padded", "packed")


def _config(init_from: str, layout: str, variant: str, steps: int, block: int, batch: int):
    from distlab.tools.verify import parse_strategy
    from distlab.train import TrainConfig
    case = parse_strategy(layout)
    fields = {**case.strategy.to_dict(), **VARIANTS[variant]}
    return TrainConfig.from_flags(init_from=init_from, **text_for(init_from, "synthetic-text:20000"),
                                  block_size=block, global_batch_size=batch, max_steps=steps, optimizer="sgd",
                                  momentum=0.0, lr=1e-4, progress=False, verbose=False, eval_every_epoch=False,
                                  eval_batches=1, eval_batch_size=batch, timing_warmup_steps=1, **fields)


def run(init_from: str, nproc: int = 2, layout: str = "zero=3", variants=tuple(VARIANTS), steps: int = 4,
        runs: int = 3, block: int = 128, batch: int = 2, out: str | None = "runs/bench", progress=print) -> list[dict]:
    from distlab.launch.spawn import run_ranks
    for variant in variants:  # every variant checked before any rank starts
        _config(init_from, layout, variant, steps, block, batch).validate(nproc)
    records, facts = [], machine(nproc, 1)
    for r in range(runs):
        for variant in variants:
            progress(f"finetune: {variant}, round {r + 1} of {runs}, {nproc} processes ...")
            cfg = _config(init_from, layout, variant, steps, block, batch)
            summary = run_ranks(train_on_ranks, nproc, cfg, timeout=3600)[0]
            records.append({"variant": variant, "round": r, "layout": layout, "nproc": nproc, "init_from": init_from,
                            "steps": steps, "block_size": block, "global_batch_size": batch,
                            "num_parameters": summary["num_parameters"],
                            "model_state_bytes_per_rank": summary["model_state_bytes_per_rank"],
                            "peak_rss_mb": summary["peak_rss_mb"], "step_s": summary["time_per_step_s_median"],
                            **facts})
    write(records, out, "finetune")
    return records


def _skewed(path: Path, n: int, seed: int = 0) -> str:
    """``n`` records whose completions are mostly short and sometimes long (lengths drawn from a Pareto tail)."""
    rng = random.Random(seed)
    words = "the quick brown fox jumps over the lazy dog".split()
    with open(path, "w") as f:
        for i in range(n):
            length = min(int(rng.paretovariate(1.2) * 4), 200)
            f.write(json.dumps({"prompt": f"Q{i}: ", "completion": " ".join(rng.choice(words)
                                                                           for _ in range(length))}) + "\n")
    return f"sft:{path}"


def run_packing(nproc: int = 2, records: int = 400, block: int = 256, batch: int = 8, runs: int = 3,
                out: str | None = "runs/bench", progress=print) -> list[dict]:
    from distlab.data import load_dataset
    from distlab.launch.spawn import run_ranks
    from distlab.train import TrainConfig
    Path(out or ".").mkdir(parents=True, exist_ok=True)
    spec = _skewed(Path(out or ".") / "skewed.jsonl", records)
    rows, facts = [], machine(nproc, 1)
    for r in range(runs):
        for mode in MODES:
            data = load_dataset(spec, "train", block_size=block, pack=mode == "packed")
            real = _real_tokens(data)
            steps = max(1, len(data) // batch)
            cfg = TrainConfig.from_flags(model="llama", n_layer=4, n_embd=128, n_head=4, dataset=spec,
                                         block_size=block, global_batch_size=batch, max_steps=steps, pack=mode == "packed",
                                         progress=False, verbose=False, eval_every_epoch=False, timing_warmup_steps=1)
            progress(f"packing: {mode}, round {r + 1} of {runs}, {steps} steps on {nproc} processes ...")
            summary = run_ranks(train_on_ranks, nproc, cfg, timeout=3600)[0]
            epoch_s = summary["time_per_step_s_median"] * len(data) / batch  # one pass over the records
            rows.append({"mode": mode, "round": r, "records": records, "windows": len(data), "steps": steps,
                         "real_tokens": real, "window_tokens": len(data) * block,
                         "step_s": summary["time_per_step_s_median"], "epoch_s": epoch_s,
                         "real_tokens_per_s": real / epoch_s, **facts})
    write(rows, out, "packing")
    return rows


def _real_tokens(data) -> int:
    """The records' own tokens in ``data``'s windows, as inputs (the padding's are 0: no byte of text is)."""
    import torch
    x = data.batch(torch.arange(len(data)))[0]
    return int((x != 0).sum())


def table(records: list[dict], markdown: bool = False) -> str:
    if records and "mode" in records[0]:
        return _packing_table(records, markdown)
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in records):
        mine = [r for r in records if r["variant"] == variant]
        steps = [r["step_s"] for r in mine]
        rows.append([variant, mine[0]["layout"], str(mine[0]["nproc"]),
                     f"{statistics.median(r['model_state_bytes_per_rank'] for r in mine) / 2**30:.2f}",
                     f"{statistics.median(r['peak_rss_mb'] for r in mine) / 1024:.2f}",
                     f"{statistics.median(steps):.2f} ({min(steps):.2f}-{max(steps):.2f})", str(len(mine))])
    return format_table(["variant", "layout", "ranks", "model state GiB/rank", "peak RSS GiB/rank",
                         "step s (min-max)", "runs"], rows, markdown)


def _packing_table(records: list[dict], markdown: bool) -> str:
    rows, rates = [], {}
    for mode in dict.fromkeys(r["mode"] for r in records):
        mine = [r for r in records if r["mode"] == mode]
        rates[mode] = [r["real_tokens_per_s"] for r in mine]
        rows.append([mode, str(mine[0]["windows"]), f"{1 - mine[0]['real_tokens'] / mine[0]['window_tokens']:.0%}",
                     f"{statistics.median(r['epoch_s'] for r in mine):.1f}",
                     f"{statistics.median(rates[mode]):,.0f}", str(len(mine))])
    text = format_table(["mode", "windows", "padding", "epoch s", "record tokens/s", "runs"], rows, markdown)
    if set(MODES) <= set(rates):
        ratios = [p / q for p, q in zip(rates["packed"], rates["padded"])]
        text += (f"\npacked / padded: {statistics.median(ratios):.2f}x (median of {len(ratios)} rounds, "
                 f"{min(ratios):.2f}-{max(ratios):.2f})")
    return text
