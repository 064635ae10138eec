"""What several commands share: launch flags, the strategy and training flags (one row per config
field, the default read from the dataclass), and small parsers."""

from __future__ import annotations

import math
import sys

import click

from distlab.errors import ConfigError
from distlab.cli.model_flags import model_help, model_options


COUNT = click.IntRange(min=1)  # how many of something: at least one
NONNEGATIVE = click.IntRange(min=0)


class Number(click.ParamType):
    """A finite float within bounds (click's FloatRange lets nan through every comparison)."""

    name = "number"

    def __init__(self, low: float | None = None, high: float | None = None, low_open: bool = False,
                 high_open: bool = False):
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            number = value
        else:
            try:
                number = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        below = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        above = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if below or above:
            lo = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
            hi = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"
            self.fail(f"{value} is not {' and '.join(x for x in (lo, hi) if x)}", param, ctx)
        return number


SECONDS = Number(0.0, 1e6, low_open=True)  # a timeout: more than 0, at most ~11 days


def device_name(ctx, param, value):
    """click callback: a device name distlab knows (auto, cpu, cuda)."""
    from distlab.runtime import DEVICES
    if value is not None and value not in DEVICES:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(DEVICES)}")
    return value


def writable_dir(ctx, param, value):
    """click callback: a directory this command may write into (made later; checked now)."""
    from distlab.train.lock import check_writable
    if value is not None:
        if not str(value).strip():
            raise click.BadParameter("is empty: give a directory")
        check_writable(value, param.opts[-1].lstrip("-"))
    return value


def name_list(ctx, param, value):
    """click callback: comma-separated names, at least one -> a list."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    if not names:
        raise click.BadParameter(f"names nothing ({value!r}): give at least one, comma-separated")
    return names


def output_file(ctx, param, value):
    """click callback: a file this command will write (not a directory; its directory writable)."""
    from pathlib import Path
    from distlab.train.lock import check_writable
    if value is not None:
        path = Path(value)
        if not str(value).strip() or path.name in ("", ".", "..") or path.is_dir():
            raise click.BadParameter(f"{value!r} is a directory, not a file to write" if path.is_dir() and
                                     str(value).strip() else "is empty: give a file name")
        check_writable(path.parent if str(path.parent) else ".", param.opts[-1].lstrip("-"))
    return value


def csv_ints(value: str) -> tuple[int, ...]:
    """Comma-separated positive integers (widths, counts, sizes), at least one."""
    try:
        numbers = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"expected comma-separated positive integers, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise ConfigError(f"expected comma-separated positive integers, got {value!r}")
    return numbers


def float_list(value: str) -> list[int]:
    """Comma-separated positive counts, written as numbers (``1e6``), at least one."""
    try:
        numbers = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated numbers, got {value!r}") from None
    if not numbers or not all(math.isfinite(n) and 1 <= n <= 1e12 for n in numbers):
        raise ConfigError(f"expected comma-separated counts from 1 to 1e12 (e.g. 1e3,1e6), got {value!r}")
    return [int(n) for n in numbers]


def launch_options(f):
    """The flags every multi-process command shares (torchrun's names where they overlap)."""
    options = [
        click.option("--nproc-per-node", type=COUNT, default=None,
                     help="Start N local workers through torchrun (omit under torchrun/mpirun/srun)."),
        click.option("--nnodes", default="1", show_default=True, help="Number of nodes (torchrun's N or MIN:MAX)."),
        click.option("--node-rank", type=NONNEGATIVE, default=0, show_default=True, help="This node's rank (torchrun)."),
        click.option("--master-addr", "--master-ip", "master_addr", default=None,
                     help="Address of rank 0 / node 0 (default 127.0.0.1)."),
        click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                     help="Port of rank 0 / node 0 (default: a free one on a single node, else 29500)."),
        click.option("--rdzv-endpoint", default=None, help="torchrun c10d rendezvous HOST:PORT (elastic jobs)."),
        click.option("--local-addr", default=None,
                     help="This node's address as the other nodes reach it (torchrun; elastic jobs)."),
        click.option("--rdzv-conf", default=None,
                     help="torchrun rendezvous settings, e.g. last_call_timeout=5,join_timeout=300 (elastic jobs)."),
        click.option("--max-restarts", type=NONNEGATIVE, default=0, show_default=True,
                     help="Restarts of the worker group after a failure (torchrun)."),
        click.option("--rank", type=NONNEGATIVE, default=None, help="Manual start: this process's global rank."),
        click.option("--world-size", "--num-nodes", "world_size", type=COUNT, default=None,
                     help="Manual start: total number of processes (one per node in a one-process-per-node job)."),
        click.option("--backend", default="auto", show_default=True, help="auto (nccl on GPU, else gloo), gloo, nccl, mpi."),
        click.option("--device", default="auto", show_default=True, envvar="DISTLAB_DEVICE", callback=device_name,
                     help="auto (cuda if available), cpu or cuda; also $DISTLAB_DEVICE."),
        click.option("--comm-timeout", type=SECONDS, default=300.0, show_default=True,
                     help="Seconds a collective waits for a dead or hung peer before it becomes an error."),
        click.option("--init-timeout", type=SECONDS, default=None,
                     help="Seconds start-up waits for every rank to arrive (default: --comm-timeout); waiting "
                          "ranks say so every ~10 s."),
        click.option("--threads", type=COUNT, default=None,
                     help="Torch threads per rank (default: cores // local ranks)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _resolvable(flag: str, host: str) -> None:
    import socket
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        raise ConfigError(f"{flag} {host!r}: no such host (give a name or address this machine resolves)") from None


def check_addresses(lopts) -> None:
    """Before a launch: the node count, node rank and every address are well formed and resolve."""
    worlds = lopts.possible_world_sizes()  # --nnodes N or MIN:MAX
    if not lopts.elastic and lopts.node_rank >= lopts.max_nodes:
        raise ConfigError(f"--node-rank {lopts.node_rank} with --nnodes {lopts.nnodes}: node ranks go from 0 to "
                          f"{lopts.max_nodes - 1}")
    if lopts.rdzv_endpoint is not None:
        host, colon, port = lopts.rdzv_endpoint.rpartition(":")
        host = host if colon else lopts.rdzv_endpoint
        if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(f"--rdzv-endpoint {lopts.rdzv_endpoint!r}: write HOST:PORT with a port from 1 to 65535")
        if not host:
            raise ConfigError(f"--rdzv-endpoint {lopts.rdzv_endpoint!r}: write HOST:PORT")
        _resolvable("--rdzv-endpoint", host.strip("[]"))
    for flag, host in (("--master-addr", lopts.master_addr), ("--local-addr", lopts.local_addr)):
        if host is not None:
            _resolvable(flag, host)
    if lopts.rdzv_conf is not None and not all("=" in item for item in lopts.rdzv_conf.split(",")):
        raise ConfigError(f"--rdzv-conf {lopts.rdzv_conf!r}: write KEY=VALUE pairs separated by commas, e.g. "
                          f"last_call_timeout=5,join_timeout=300")
    return worlds


def run_distributed(kw: dict, body, planned_check=None, prelaunch=None):
    """Launch through torchrun if asked (after ``planned_check`` for each world size the launch may have,
    then ``prelaunch()``; what it returns is called when the launch ends), else join the job: ``body(runtime)``."""
    from distlab import runtime
    from distlab.launch.torchrun import LaunchOptions, launch

    lopts = LaunchOptions(kw.pop("nproc_per_node"), kw.pop("nnodes"), kw.pop("node_rank"), kw["master_addr"],
                          kw["master_port"], kw.pop("rdzv_endpoint"), kw.pop("max_restarts"), kw["threads"],
                          kw.pop("rdzv_conf"), kw.pop("local_addr"))
    manual = kw["rank"] is not None or kw["world_size"] is not None
    if lopts.nproc_per_node is not None and not runtime.under_launcher():
        if manual:
            raise ConfigError("--nproc-per-node (torchrun launch) and --rank/--world-size (manual start) "
                              "cannot be combined: use one or the other")
        check_addresses(lopts)
        runtime.check_local_devices(kw["device"], lopts.nproc_per_node)
        device = runtime.resolve_device(kw["device"], 0)
        runtime.resolve_backend(kw["backend"], device)  # once, before any worker
        if device.type == "cpu":
            runtime.hide_gpus()  # the workers' torch defaults to the CPU too (DDP hooks, device meshes)
        if planned_check:  # an elastic job may run at any world size of its range: each must work
            for world in lopts.possible_world_sizes():
                planned_check(world)
        release = prelaunch() if prelaunch else None
        try:
            code = launch(lopts, sys.argv[1:])
        finally:
            if release:  # held while the workers ran; this process may go on (distlab.cli.main called from Python)
                release()
        sys.exit(code)
    if planned_check and manual and kw["world_size"]:
        planned_check(kw["world_size"])
    elif planned_check and not manual and not runtime.under_launcher():
        planned_check(1)  # one process: the same checks before any work
    rt = runtime.init(backend=kw.pop("backend"), device=kw.pop("device"), timeout_s=kw.pop("comm_timeout"),
                      init_timeout_s=kw.pop("init_timeout"),
                      threads=kw.pop("threads"), rank=kw.pop("rank"), world_size=kw.pop("world_size"),
                      master_addr=kw.pop("master_addr"), master_port=kw.pop("master_port"))
    try:
        return body(rt)
    finally:
        runtime.shutdown()


def default_of(name: str):
    """A field's default, from the one place it is set (TrainConfig or Strategy)."""
    from dataclasses import fields

    from distlab.parallel import Strategy
    from distlab.train import TrainConfig
    for cls in (TrainConfig, Strategy):
        for f in fields(cls):
            if f.name == name:
                return getattr(cls(), name)
    raise KeyError(name)


# The strategy's flags (shared by train and plan), then train's own. Each is a field of Strategy or
# TrainConfig, written once here with its help; the default comes from the dataclass.
STRATEGY_OPTIONS = [
    ("dp_sync", dict(default=None, help="Gradient sync: gather-scatter (via rank 0), allreduce (per parameter, after "
                     "backward), bucketed (overlapped with backward; the default) or ddp (torch's DDP). With --zero: "
                     "ZeRO's own reduce-scatter.")),
    ("collective", dict(default=None, help="Collective algorithm: native (gloo/NCCL), ring, butterfly or direct "
                        "(distlab.comm), or auto (per collective, the one measured fastest). Default: native for "
                        "data parallel's all-reduce, auto for --zero's reduce-scatter and all-gather.")),
    ("bucket_mb", dict(type=float, help="Bucket size in MB for --dp-sync bucketed and ddp.")),
    ("grad_accum", dict(type=int, help="Micro-batches per optimizer step (no communication until the last).")),
    ("sync_bn", dict(help="off, distlab (any device) or torch (nn.SyncBatchNorm, GPU only); statistics over the "
                     "data-parallel group.")),
    ("find_unused", dict(is_flag=True, help="Parameters without a gradient in a step count as zero.")),
    ("tp", dict(type=int, help="Tensor-parallel size: ranks that split each Linear layer (must divide the world size).")),
    ("tp_style", dict(help="megatron (column then row parallel, one all-reduce each way per block) or naive "
                      "(every layer column parallel, activations all-gathered).")),
    ("sequence_parallel", dict(is_flag=True, help="With --tp on a transformer: LayerNorm and residual regions split "
                               "along the sequence (all-gather / reduce-scatter in place of all-reduce: same bytes, "
                               "1/tp of those activations).")),
    ("cp", dict(type=int, help="Context-parallel size: ranks that split every sequence for the whole model (a "
                "transformer; tp x cp x pp must divide the world size; --block-size divisible by 2 x cp).")),
    ("cp_style", dict(help="With --cp: ring (key/value blocks passed around the ring, exact online softmax) or "
                      "ulysses (all-to-all from sequence shards to head shards and back; heads divisible by cp).")),
    ("ep", dict(type=int, help="Expert-parallel size: data-parallel ranks that share out a mixture of experts' "
                "experts (--model gpt-moe; divides the data-parallel size and --experts), tokens exchanged by "
                "all-to-all.")),
    ("zero", dict(type=click.IntRange(0, 3), help="ZeRO stage over the data-parallel ranks: 1 shards optimizer "
                  "state, 2 also gradients, 3 also parameters.")),
    ("activation_checkpointing", dict(is_flag=True, help="Keep only each block's input (VGG stage, ResNet block, "
                                      "transformer block) and recompute the rest in backward: less activation "
                                      "memory for about a third more compute.")),
    ("ac_every", dict(type=int, help="With --activation-checkpointing: recompute one block in every K (the "
                      "first, then every K-th): selective checkpointing per block, less recomputation for more "
                      "memory (default 1: every block).")),
    ("ac_policy", dict(help="With --activation-checkpointing: what a checkpointed block keeps -- block (its input "
                       "alone, the default) or ops (also the outputs of attention and of every other matrix "
                       "multiplication: selective checkpointing per op, recomputing the cheap rest).")),
    ("compile", dict(is_flag=True, help="Each block (transformer block, ResNet block, VGG stage's layers) through "
                     "torch.compile: fused kernels, the same parameters and snapshots; the first step pays the "
                     "compilation. Composes with every layout but the zero-bubble pipeline.")),
    ("compile_backend", dict(help="With --compile: torch.compile's backend -- inductor (fused kernels, on a CPU built "
                             "by a C++ compiler), aot_eager (the same graphs run by eager kernels) or eager.")),
    ("precision", dict(help="fp32, bf16 (autocast in bfloat16: CPU and GPU) or fp16 (autocast in float16 with dynamic "
                       "loss scaling: GPU only); parameters and optimizer state stay float32.")),
    ("reduce_dtype", dict(default=None, help="Dtype gradients are communicated in: fp32, bf16 or fp16 (default: "
                          "the gradients' own, float32).")),
    ("grad_compression", dict(help="none, fp16, bf16 or powersgd:R (rank-R PowerSGD with error feedback and warm "
                              "start; --dp-sync allreduce, bucketed or ddp, the last through torch's hooks).")),
    ("pp", dict(type=int, help="Pipeline stages: the model's layers cut into this many parts on as many ranks "
                "(tp x pp must divide the world size; the rest is data parallel).")),
    ("microbatches", dict(type=int, default=None, help="With --pp: micro-batches per step on each pipeline (must "
                          "divide the per-rank batch; default --pp).")),
    ("pp_schedule", dict(help="With --pp: gpipe (all forwards, then all backwards), 1f1b (one forward, one "
                         "backward: at most --pp micro-batches held) or zb (zero bubble: each backward split into "
                         "the input's gradient and the weights', which fill 1F1B's idle slots).")),
    ("pp_virtual", dict(type=int, help="With --pp: model chunks per pipeline rank (interleaved 1F1B, bubble "
                        "(P-1)/(V M + P-1); --microbatches a multiple of --pp; or zero bubble).")),
    ("pp_balance", dict(default=None, help="With --pp: layers per stage, comma-separated (default: cut where the "
                        "parameters balance; the header lists the layers).")),
    ("components", dict(default=None, help="Model-sharding components of your own, by the names they are "
                        "registered under (DISTLAB_COMPONENTS=NAME=module:Class), colon-separated; applied after "
                        "the built-in ones.")),
    ("dims", dict(default=None, help="Sizes of the mesh dimensions your own components own, NAME=N, comma-"
                  "separated (in a strategy's text: +NAME=N); the data-parallel size shrinks by them.")),
]


MODEL_OPTIONS, CSV_OPTIONS = model_options()  # CSV_OPTIONS: tuples, written comma-separated
TRAIN_OPTIONS = [
    ("model", dict(help=model_help())),
    ("model_args", dict(multiple=True, default=(), help="key=value for your model's builder (repeat the flag; "
                        "values read as Python literals: 64, 0.1, True, 'text').")),
    *MODEL_OPTIONS,
    ("block_size", dict(type=int, help="Text: context length in tokens per sample.")),
    ("dataset", dict(help="Images: fashion-mnist, mnist, cifar10, cifar100, synthetic:CxHxW:K[:N]; text: fortunes, "
                     "synthetic-text[:N]; your own: tensors:FILE (.pt or .npz with inputs and labels), "
                     "imagefolder:DIR (a subfolder of PNG/JPEG images per class), text:PATH (a text file, documents "
                     "separated by blank lines, or a directory of text files), tokens:DIR (a corpus prepare-text "
                     "wrote, or nanoGPT's train.bin/val.bin with --vocab-size; memory-mapped), sft:FILE.jsonl (prompt/completion or chat messages records to "
                     "fine-tune on: the loss on the completions, the last replies).")),
    ("tokenizer", dict(help="Text: bytes (a token per byte) or bpe:N (a byte-level BPE of N tokens learned from the "
                       "training split; kept in OUT/tokenizer.json and in snapshots); for sft: records also hf:DIR "
                       "(a pretrained model's tokenizer.json).")),
    ("vocab_size", dict(type=int, default=None, help="Text: the model's vocabulary -- a corpus of bare token ids' "
                        "(nanoGPT's train.bin/val.bin say none), or more than the data's (e.g. 50304: GPT-2's 50257 "
                        "rounded up to a multiple of 64).")),
    ("data_dir", dict(help="Where the dataset is; the only place searched when given (default: $DISTLAB_DATA, "
                     "else /usr/share/datasets).")),
    ("data_on_device", dict(help="auto, on or off: keep the data set in GPU memory and gather each batch there "
                            "(auto: on a GPU run whose data takes at most 25% of the free GPU memory).")),
    ("epochs", dict(type=int, help="Passes over the training set (default: 1, or as many as --max-steps takes).")),
    ("max_steps", dict(type=int, help="Stop after this many optimizer steps (alone, it sets the run's length; with "
                       "--epochs, whichever ends first).")),
    ("global_batch_size", dict(type=int, aliases=("--batch-size",),
                               help="Samples per optimizer step over all ranks (split over the data-parallel ranks).")),
    ("lr", dict(type=float)),
    ("optimizer", dict(help="sgd, adam or adamw.")),
    ("lr_schedule", dict(help="constant, cosine or linear decay to 0.")),
    ("momentum", dict(type=float, help="SGD momentum.")),
    ("weight_decay", dict(type=float)),
    ("clip_grad_norm", dict(type=float, default=None, help="Scale each step's gradients so their global norm (the "
                            "whole model, every parameter counted once, on any layout) is at most this; the norm "
                            "before clipping is logged as grad_norm.")),
    ("seed", dict(type=int)),
    ("log_every", dict(type=int, help="Log the loss every N steps (rank 0).")),
    ("sample_every", dict(type=int, default=None, help="gpt: every N steps (and at the end) print a short text the "
                          "model generates, also kept in that step's metrics.jsonl record as 'sample'.")),
    ("label_smoothing", dict(type=float, help="Smooth the training loss's targets: 1 - S on the true class (or "
                             "token) plus S / classes on every class, as torch's cross_entropy (also across a "
                             "vocabulary split by tensor parallel); evaluations report the plain cross-entropy.")),
    ("peak_tflops", dict(type=float, default=None, help="A device's dense peak TFLOP/s at the run's precision, for "
                         "MFU (model FLOPs utilisation) beside tokens/s (default: a known GPU's data-sheet peak; "
                         "none on a CPU).")),
    ("eval_batch_size", dict(type=int, default=None, help="Samples each rank scores at a time in an evaluation "
                             "(default: a language model's training micro-batch, since its logits fill memory; "
                             "1000 for a classifier).")),
    ("eval_every", dict(type=int, default=None, help="Evaluate every N steps (and at the end) instead of every "
                        "epoch; the evaluation's numbers join that step's metrics.jsonl record.")),
    ("eval_batches", dict(type=int, default=None, help="Evaluate on the first N batches of --eval-batch-size "
                          "(default 1000) samples of the test (and validation) set only: a fixed subset, the same every time "
                          "(default: all of it).")),
    *STRATEGY_OPTIONS,
    ("lr_scaling", dict(help="Scale --lr with the global batch: none, linear (x G/B) or sqrt (x sqrt(G/B)), "
                        "B = --base-batch-size.")),
    ("base_batch_size", dict(type=int, help="The global batch size --lr was tuned for.")),
    ("warmup_steps", dict(type=int, help="Linear LR warm-up steps.")),
    ("val_fraction", dict(type=float, help="Hold out this fraction of the training set (seeded) for validation; the "
                          "best validation loss and its model go into snapshots.")),
    ("snapshot_dir", dict(help="Write snapshots here (every --snapshot-every steps and at the end).")),
    ("snapshot_every", dict(type=int, help="Snapshot every N optimizer steps.")),
    ("snapshot_async", dict(is_flag=True, help="Copy the state to host memory at the step and write the snapshot "
                            "in the background (the same files, checksums and atomic rename; at most one write in "
                            "flight): training stalls for the copy only.")),
    ("keep_snapshots", dict(type=int, help="Keep the newest K snapshots.")),
    ("trace", dict(default=None, help="A:B -- record every rank's timeline of optimizer steps A to B (data, "
                   "forward, backward, each bucket's all-reduce from issue to completion, the optimizer step) "
                   "into OUT/trace.json, Chrome's trace format: open it in Perfetto or chrome://tracing.")),
    ("profile", dict(default=None, help="A:B -- run torch.profiler over optimizer steps A to B: one kernel-level "
                     "trace per rank, OUT/profile/rank-N.json (Perfetto, chrome://tracing), distlab's own spans "
                     "(forward, bucket 3 all-reduce, ...) among torch's operators.")),
    ("resume", dict(help="auto (newest good snapshot in --snapshot-dir; also the default after torchrun restarts "
                    "the workers) or a snapshot directory.")),
    ("init_from", dict(help="Start from the weights in this whole-model state_dict file (distlab export writes "
                       "one; any torch.save(model.state_dict()) of the same model works), or hf:DIR, a Hugging "
                       "Face checkpoint (config.json + safetensors: Llama, Mistral), whose config gives the "
                       "model's options and vocabulary; a snapshot being resumed takes precedence.")),
    ("lora", dict(default=None, help="r=16,alpha=32,dropout=0.0,targets=q,k,v,o -- train low-rank adapters "
                  "(LoRA) on these layers and freeze the rest: no gradient, optimizer state or gradient sync for "
                  "the base. Targets as PEFT's target_modules (q_proj or q, k, v, o, gate, up, down; all: every "
                  "linear layer but the LM head); y = W x + B A x * alpha / r, B starting at zero.")),
    ("pack", dict(is_flag=True, help="sft: records packed into each window whole, as many as fit -- each attends "
                  "to itself only, its positions from 0 -- instead of one record per padded window.")),
    ("dpo_beta", dict(type=float, default=None, help="dpo:FILE.jsonl: DPO's beta, how far the trained model's "
                      "log-probability ratios to its starting model may go (default 0.1); the reference is the "
                      "starting model (with --lora: the base without adapters).")),
    ("base_dtype", dict(type=click.Choice(["float32", "bf16", "nf4"]), help="With --lora and --precision bf16: "
                        "hold (and under ZeRO-3 gather) the frozen base in bf16 -- or, nf4, each adapted layer's "
                        "weight in 4-bit NormalFloat (QLoRA; torchao's NF4 tensor; data, pipeline, context or "
                        "expert parallel); the adapters and their optimizer state stay float32.")),
    ("lora_from", dict(default=None, help="peft:DIR -- start the adapters at those PEFT saved (adapter_config.json, "
                       "adapter_model.safetensors) for the --init-from hf:DIR base; its config gives --lora.")),
    ("time_budget_s", dict(default=None, help="Stop cleanly (evaluation, snapshot, summary) before this much "
                           "training time, counted across restarts: 2h, 90m, 3600s, 1h30m.")),
    ("out", dict(help="Run directory for metrics.jsonl and summary.json (default runs/MODEL-DATASET-TIME).")),
    ("tensorboard", dict(default=None, help="Also write TensorBoard event files here (loss, LR, throughput, "
                         "evaluations, each rank's memory; needs pip install tensorboard).")),
    ("progress", dict(flag_pair=True, default=None, help="Progress bar on rank 0 (default: when a terminal).")),
]


def field_options(table):
    """click options for ``(field, settings)`` rows: the flag from :func:`distlab.tools.flags.flag`, the
    default from the dataclass unless the row gives one."""
    from distlab.tools.flags import flag

    def decorate(f):
        for name, settings in reversed(table):
            settings = dict(settings)
            names = [flag(name), *settings.pop("aliases", ())]
            if settings.pop("flag_pair", False):
                names = [f"{flag(name)}/--no-{flag(name)[2:]}"]
            if "default" not in settings and not settings.get("is_flag"):
                value = default_of(name)
                settings["default"] = ",".join(map(str, value)) if isinstance(value, tuple) else value
                settings["show_default"] = value is not None
            f = click.option(*names, name, **settings)(f)
        return f

    return decorate


def model_options_of(model: str, kw: dict):
    """Pop the model flags (:data:`MODEL_OPTIONS`) from click's ``kw``: ``model``'s options object from the
    ones given (None where none is: the family's defaults); one line naming a flag ``model`` does not take."""
    from distlab.models import options_from
    given = {name: kw.pop(name) for name, _ in MODEL_OPTIONS}
    given = {k: csv_ints(v) if k in CSV_OPTIONS else v for k, v in given.items() if v is not None}
    return options_from(model, given) if given else None


def config_from_flags(kw: dict, table) -> dict:
    """Pop the table's fields from click's ``kw``, converted to the dataclass's types."""
    from distlab.train.config import parse_duration
    values = {name: kw.pop(name) for name, _ in table}
    for name, _ in MODEL_OPTIONS:
        if name in CSV_OPTIONS and values.get(name) is not None:
            values[name] = csv_ints(values[name])
    if "model_args" in values:
        values["model_args"] = tuple(values["model_args"])
    if values.get("pp_balance") is not None:
        values["pp_balance"] = csv_ints(values["pp_balance"])
    if "time_budget_s" in values:
        values["time_budget_s"] = parse_duration(values["time_budget_s"])
    return values
