"""Published multi-GPU training runs of other projects, and the planner's prediction of each.

Each :class:`PublishedRun` is a row of a table its project published -- model, GPUs, layout, batch, window,
activation checkpointing, and what it measured (tokens/s per GPU or model TFLOP/s per GPU, peak memory) --
with where it was published. :func:`compare` predicts every row with :func:`~distlab.plan.predict.predict`
on the machine the row ran on (:mod:`distlab.plan.gpu`), from datasheet numbers and distlab's own
measurements only: nothing here is fitted to these tables. ``distlab plan published`` prints the errors.

What distlab plans is its own code path, so a row is predicted as distlab would run that layout: FSDP as
ZeRO-3 (float32 parameters gathered, float32 gradients reduce-scattered: FSDP2's mixed precision gathers
bfloat16, half the bytes), Megatron-style tensor parallel with sequence parallel, a pipeline under ZeRO-1,
and checkpointing as torchtitan's modes run it: full (every block), selective per layer (one block in two:
``ac_every`` 2) and selective per op (``ac_policy`` ops: attention's and every other matrix multiplication's
outputs kept).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from distlab.errors import ConfigError

TORCHTITAN_H100 = ("torchtitan docs/performance.md, 1D-4D tables measured 2024-12 on Grand Teton H100 hosts "
                   "(github.com/pytorch/torchtitan/blob/main/docs/performance.md)")
TORCHTITAN_A100 = ("torchtitan docs/performance.md, 2024-07 version: FSDP2 on 64 A100 80GB "
                   "(github.com/pytorch/torchtitan, docs/performance.md at its 2024-07 commits)")
TORCHTITAN_405B = ("torchtitan docs/performance.md, 2024-08 version: Llama 3.1 405B on 128 H100, FSDP 16 x TP 8 "
                   "(github.com/pytorch/torchtitan, docs/performance.md)")
LLAMA3_PAPER = ("The Llama 3 Herd of Models (arXiv:2407.21783), table 4: Llama 3 405B pre-training on H100 80GB "
                "(700 W), 8 per server on NVLink, 400 Gb/s RoCE per GPU")


@dataclass(frozen=True)
class PublishedRun:
    key: str
    source: str
    model: str            # a planner preset (distlab/plan/presets)
    machine: str          # a planner machine (distlab/plan/machines)
    gpus: int
    layout: dict          # Strategy fields (dp is what is left of the GPUs)
    local_batch: int      # sequences per data-parallel rank per step
    window: int           # tokens per sequence
    ac: str               # the checkpointing the run used, as published
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None  # model TFLOP/s per GPU, where that is what was published
    memory_gib: float | None = None
    note: str = ""
    options: dict = field(default_factory=dict)

    @property
    def dp(self) -> int:
        ways = self.layout.get("tp", 1) * self.layout.get("pp", 1) * self.layout.get("cp", 1)
        return self.gpus // ways


def _fsdp(ckpt: bool = True, every: int = 1, policy: str = "block", **more) -> dict:
    return dict(zero=3, precision="bf16", activation_checkpointing=ckpt, ac_every=every if ckpt else 1,
                ac_policy=policy if ckpt else "block", **more)


RUNS = [
    # torchtitan on Grand Teton H100s (bf16 rows; its Float8 rows need FP8 matmuls the planner does not time)
    PublishedRun("tt-8b-fsdp8", TORCHTITAN_H100 + ", table 1", "llama3.1-8b", "h100-grand-teton", 8,
                 _fsdp(policy="ops"), 2, 8192, "selective (op)", tokens_per_s_per_gpu=5762, memory_gib=82.4),
    PublishedRun("tt-8b-fsdp8-compile", TORCHTITAN_H100 + ", table 1", "llama3.1-8b", "h100-grand-teton", 8,
                 _fsdp(policy="ops", compile=True), 2, 8192, "selective (op)", tokens_per_s_per_gpu=6667,
                 memory_gib=77.0),
    PublishedRun("tt-8b-fsdp128", TORCHTITAN_H100 + ", table 3", "llama3.1-8b", "h100-grand-teton", 128,
                 _fsdp(policy="ops"), 2, 8192, "selective (op)", tokens_per_s_per_gpu=5605, memory_gib=67.0),
    PublishedRun("tt-8b-fsdp128-compile", TORCHTITAN_H100 + ", table 3", "llama3.1-8b", "h100-grand-teton", 128,
                 _fsdp(policy="ops", compile=True), 2, 8192, "selective (op)", tokens_per_s_per_gpu=6514,
                 memory_gib=62.0),
    PublishedRun("tt-405b-fsdp16-tp8", TORCHTITAN_405B, "llama3.1-405b", "h100-grand-teton", 128,
                 _fsdp(tp=8, sequence_parallel=True), 2, 8192, "full", tokens_per_s_per_gpu=109,
                 note="MFU 29.0% as published"),
    # ... and its Float8 rows, for their memory only (Float8 casts change what a step stores little: 76.8 GiB
    # against 77.0 in table 1; their throughput needs FP8 matmuls the planner does not time)
    PublishedRun("tt-70b-fsdp32-tp8", TORCHTITAN_H100 + ", table 4 (Float8, compiled)", "llama3.1-70b",
                 "h100-grand-teton", 256, _fsdp(tp=8, sequence_parallel=True), 16, 8192, "full", memory_gib=71.9),
    *(PublishedRun(f"tt-8b-cp{cp}", TORCHTITAN_H100 + ", table 2 (Float8, compiled)", "llama3.1-8b",
                   "h100-grand-teton", 8, _fsdp(cp=cp), 1, 32768 * cp, "full", memory_gib=mem)
      for cp, mem in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5))),
    # torchtitan on 64 A100 80GB, FSDP 64, local batch 1 (Llama 3) or 2 (Llama 2)
    PublishedRun("tt-a100-8b-layer", TORCHTITAN_A100, "llama3-8b", "a100-80g", 64, _fsdp(every=2), 1, 8192,
                 "selective (per layer)", tokens_per_s_per_gpu=2904, note="MFU 56.8% as published"),
    PublishedRun("tt-a100-8b-op", TORCHTITAN_A100, "llama3-8b", "a100-80g", 64, _fsdp(policy="ops"), 1, 8192,
                 "selective (op)", tokens_per_s_per_gpu=2973, note="MFU 58.2% as published"),
    PublishedRun("tt-a100-70b-full", TORCHTITAN_A100, "llama3-70b", "a100-80g", 64, _fsdp(), 1, 8192, "full",
                 tokens_per_s_per_gpu=331, note="MFU 51.7% as published"),
    PublishedRun("tt-a100-l2-13b-none", TORCHTITAN_A100, "llama2-13b", "a100-80g", 64, _fsdp(ckpt=False), 2, 4096,
                 "none", tokens_per_s_per_gpu=2162, note="MFU 61.1% as published"),
    PublishedRun("tt-a100-l2-13b-layer", TORCHTITAN_A100, "llama2-13b", "a100-80g", 64, _fsdp(every=2), 2, 4096,
                 "selective (per layer)", tokens_per_s_per_gpu=1914, note="MFU 54.1% as published"),
    PublishedRun("tt-a100-l2-70b-full", TORCHTITAN_A100, "llama2-70b", "a100-80g", 64, _fsdp(), 2, 4096, "full",
                 tokens_per_s_per_gpu=353, note="MFU 50.5% as published"),
    # Meta's own 405B run: TP 8 inside a server, PP 16, DP over the rest; 16M tokens per step
    PublishedRun("llama3-405b-8k-gpus", LLAMA3_PAPER, "llama3.1-405b", "h100-sxm", 8192,
                 dict(tp=8, sequence_parallel=True, pp=16, microbatches=32, zero=1, precision="bf16"), 32, 8192,
                 "none (as the paper describes)", tflops_per_gpu=430, note="BF16 MFU 43% as published"),
    PublishedRun("llama3-405b-16k-gpus", LLAMA3_PAPER, "llama3.1-405b", "h100-sxm", 16384,
                 dict(tp=8, sequence_parallel=True, pp=16, microbatches=16, zero=1, precision="bf16"), 16, 8192,
                 "none (as the paper describes)", tflops_per_gpu=400, note="BF16 MFU 41% as published"),
]


def predict_run(run: PublishedRun, traces: dict | None = None) -> dict:
    """The planner's prediction of ``run`` on its machine (traces cached in ``traces`` by model and window)."""
    from distlab.parallel import Strategy
    from distlab.plan import presets
    from distlab.plan.gpu import Cluster, load_machine
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    from distlab.plan.trace import trace
    traces = {} if traces is None else traces
    key = (run.model, run.window)
    if key not in traces:
        family, options, vocab = presets.options(run.model)
        traces[key] = trace(family, (run.window,), vocab, options=options, attention="flash")
    m = load_machine(run.machine)
    lay = Layout(dp=run.dp, strategy=Strategy(**run.layout), optimizer="adamw",
                 global_batch=run.local_batch * run.dp).check()
    p = predict(traces[key], lay, Link(), None, Cluster(m, run.gpus // m.gpus_per_node))
    tflops = p["mfu"] * m.peak("bf16") / 1e12
    row = {"key": run.key, "model": run.model, "machine": run.machine, "gpus": run.gpus,
           "layout": str(lay.strategy), "dp": lay.dp, "local_batch": run.local_batch, "window": run.window,
           "ac_published": run.ac, "source": run.source, "note": run.note,
           "predicted_tokens_per_s_per_gpu": p["tokens_per_s_per_gpu"], "predicted_tflops_per_gpu": tflops,
           "predicted_mfu": p["mfu"], "predicted_memory_gib": p["memory_bytes_per_rank"] / 2**30,
           "predicted_model_state_gib": p["model_state_bytes_per_rank"] / 2**30,
           "predicted_exposed_comm_s": p["exposed_comm_s"], "predicted_step_s": p["step_s"],
           "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu, "published_tflops_per_gpu": run.tflops_per_gpu,
           "published_memory_gib": run.memory_gib}
    if run.tokens_per_s_per_gpu:  # (a memory-only row has neither)
        row["throughput_err"] = p["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu - 1
    elif run.tflops_per_gpu:
        row["throughput_err"] = tflops / run.tflops_per_gpu - 1
    if run.memory_gib:
        row["memory_err"] = row["predicted_memory_gib"] / run.memory_gib - 1
    return row


def compare(keys: list[str] | None = None) -> dict:
    """Every published run (or those named) predicted, with the median absolute errors."""
    runs = [r for r in RUNS if not keys or r.key in keys]
    if keys and len(runs) != len(set(keys)):
        known = {r.key for r in RUNS}
        raise ConfigError(f"no published run {', '.join(k for k in keys if k not in known)}; they are: "
                          f"{', '.join(r.key for r in RUNS)}")
    traces: dict = {}
    rows = [predict_run(r, traces) for r in runs]
    thr = [abs(r["throughput_err"]) for r in rows if "throughput_err" in r]
    mem = [abs(r["memory_err"]) for r in rows if "memory_err" in r]
    from distlab.plan.gpu import DEFAULT_EFFICIENCY, EFFICIENCY_SOURCE
    return {"kind": "distlab-plan-published", "rows": rows,
            "median_abs_throughput_err": statistics.median(thr) if thr else None,
            "median_abs_memory_err": statistics.median(mem) if mem else None,
            "efficiency": DEFAULT_EFFICIENCY, "efficiency_source": EFFICIENCY_SOURCE}
