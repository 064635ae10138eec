"""``distlab bench``: every command writes OUT/SUITE.json and prints a table."""

from __future__ import annotations

import click

from distlab.cli.options import (COUNT, NONNEGATIVE, Number, csv_ints, device_name, float_list, launch_options,
                                 name_list, run_distributed, writable_dir)
from distlab.errors import ConfigError


@click.group()
def bench():
    """Measure: every command writes DIR/SUITE.json and prints a table."""
    import os

    from distlab.runtime.device import LOAD_AT_LAUNCH, load_before_run
    load = load_before_run()  # before the bench adds its own: every record, and the runs it starts, see this one
    if load is not None:
        os.environ.setdefault(LOAD_AT_LAUNCH, f"{load:.2f}")


def _progress(line: str) -> None:
    click.echo(line, err=True)


def _finish(module, records: list[dict], out: str, suite: str, plot_dir: str | None = None) -> None:
    """The table, then -- where the machine was busy before the bench -- that its timings mean less, then what
    was written: OUT/SUITE.json and, with --plot, the module's PNGs."""
    from distlab.bench.common import busy_bench
    click.echo(module.table(records))
    busy = busy_bench(records)
    if busy:
        click.echo(f"distlab: warning: {busy}", err=True)
    click.echo(f"wrote {out}/{suite}.json", err=True)
    for path in module.plot(records, plot_dir) if plot_dir else ():
        click.echo(f"wrote {path}", err=True)



@bench.command("collectives")
@click.option("--world", default="1,2,4,8,16,32", show_default=True, help="World sizes (processes).")
@click.option("--sizes", default="1e3,1e4,1e5,1e6", show_default=True, help="Elements per tensor.")
@click.option("--algorithms", default="native,ring,butterfly,direct,gather_scatter", show_default=True)
@click.option("--ops", default="sum", show_default=True, help="sum, avg, max, min, product.")
@click.option("--dtypes", default="float32", show_default=True, help="float32, float64, float16, bfloat16.")
@click.option("--warmup", type=NONNEGATIVE, default=3, show_default=True)
@click.option("--repeats", type=COUNT, default=20, show_default=True, help="Timed calls per run.")
@click.option("--runs", type=COUNT, default=1, show_default=True,
              help="Independent runs (fresh processes); times are the median of the runs' medians.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/collectives.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write time and busbw PNGs here.")
@click.option("--link", default=None,
              help="Launched across nodes: the link they ran over, recorded in the JSON (e.g. 1gbit).")
@click.option("--burst", default=None, help="Launched across nodes: the links' token-bucket burst, recorded.")
@launch_options
def bench_collectives(world, sizes, algorithms, ops, dtypes, warmup, repeats, runs, out, plot_dir, link, burst, **kw):
    """All-reduce algorithms vs torch's native one: time, bandwidth, accuracy, bytes, memory.

    Spawns its own ranks on this machine (one run per --world size); launched like training
    (--nproc-per-node with --nnodes ..., or under torchrun / `distlab cluster run`), it measures the
    group it was started in instead -- across the nodes' real links."""
    from distlab import runtime
    from distlab.bench import collectives
    args = (float_list(sizes), algorithms.split(","), ops.split(","), dtypes.split(","), warmup, repeats)
    if kw["nproc_per_node"] is not None or kw["rank"] is not None or runtime.under_launcher():
        kw["threads"] = kw["threads"] or 1
        records = run_distributed(kw, lambda rt: collectives.run_here(rt.rank, rt.world_size, *args, runs, out, link,
                                                                      burst))
        if records is not None:
            _finish(collectives, records, out, "collectives")
        return
    sizes_, algos, ops_, dtypes_, _, _ = args
    records = collectives.run(float_list(world), sizes_, algos, ops_, dtypes_, warmup, repeats, out, _progress, runs)
    for w, numel in collectives.crossovers(records).items():
        click.echo(f"world {w}: ring faster than butterfly "
                   + (f"from {numel:,} elements up" if numel else "at no size measured"))
    _finish(collectives, records, out, "collectives", plot_dir)
    said = collectives.write_fit(records, out)
    for i, line in enumerate(said):
        click.echo(line, err=i == len(said) - 1)  # (the last: what was written)


@bench.command("syncbn")
@click.option("--workers", default="1,2,4", show_default=True, help="Process counts.")
@click.option("--features", default="128,256,512,1024", show_default=True)
@click.option("--batches", default="32,64", show_default=True, help="Global batch sizes.")
@click.option("--warmup", type=NONNEGATIVE, default=5, show_default=True)
@click.option("--repeats", type=COUNT, default=50, show_default=True)
@click.option("--device", callback=device_name, default="cpu", show_default=True, help="cpu or cuda (torch's SyncBN needs cuda).")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/syncbn.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write time-vs-features PNGs here.")
def bench_syncbn(workers, features, batches, warmup, repeats, device, out, plot_dir):
    """SyncBatchNorm (distlab's, torch's on GPU) vs local BatchNorm: accuracy, time, memory."""
    from distlab.bench import syncbn
    records = syncbn.run(csv_ints(workers), csv_ints(features), csv_ints(batches), warmup=warmup, repeats=repeats,
                         device=device, out=out, progress=_progress)
    _finish(syncbn, records, out, "syncbn", plot_dir)


@bench.command("dp")
@click.option("--workloads", default="mlp,vgg11,resnet18-syncbn", show_default=True)
@click.option("--nproc", type=COUNT, default=2, show_default=True)
@click.option("--steps", type=COUNT, default=30, show_default=True)
@click.option("--batch", type=COUNT, default=64, show_default=True, help="Global batch size.")
@click.option("--methods", default="gather-scatter,allreduce,allreduce:ring,bucketed,bucketed:ring,ddp",
              show_default=True, help="Strategies (text form, e.g. bucketed:ring+accum=2), comma-separated.")
@click.option("--runs", type=COUNT, default=1, show_default=True, help="Repeat each configuration; median of medians.")
@click.option("--bucket-mb", "bucket_mbs", default=None,
              help="Bucket sizes in MB to sweep for the bucketed and ddp methods, e.g. 1,5,25,100.")
@click.option("--data-dir", default=None)
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/dp.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write samples/s bar charts here.")
@click.option("--cluster", is_flag=True, help="One worker per emulated node (network namespaces; needs root).")
@click.option("--bandwidth", default="1gbit", show_default=True, help="With --cluster: the links' rate.")
@click.option("--trace", is_flag=True, help="Trace the last two steps of each method's first run (OUT/traces/): "
                                            "the table adds the share of communication hidden behind compute.")
def bench_dp(workloads, nproc, steps, batch, methods, runs, bucket_mbs, data_dir, out, plot_dir, cluster, bandwidth,
             trace):
    """Every --dp-sync method vs DDP on real training: samples/s, bytes/step, memory, accuracy."""
    from distlab.bench import dp
    from distlab.parallel import Strategy
    sizes = None
    if bucket_mbs:
        try:
            sizes = [float(b) for b in bucket_mbs.split(",") if b.strip()]
        except ValueError:
            raise ConfigError(f"--bucket-mb takes sizes in MB separated by commas, e.g. 1,5,25,100; not {bucket_mbs!r}") from None
        if not sizes or min(sizes) <= 0:
            raise ConfigError(f"--bucket-mb sizes must be positive, not {bucket_mbs!r}")
    records = dp.run(workloads.split(","), nproc, steps, batch, Strategy.parse_list(methods), runs, data_dir, out,
                     progress=_progress, bucket_mbs=sizes, cluster=cluster, bandwidth=bandwidth, trace=trace)
    _finish(dp, records, out, "dp", plot_dir)


@bench.command("compression")
@click.option("--strategies", default=",".join(("bucketed", "bucketed+compress=powersgd:4", "ddp+compress=powersgd:4",
                                                "bucketed+compress=fp16", "ddp+compress=fp16")), show_default=True,
              callback=name_list, help="Strategies in their text form; the first is the baseline of 'speedup'.")
@click.option("--nodes", type=COUNT, default=2, show_default=True, help="Workers (emulated nodes with --cluster).")
@click.option("--epochs", type=COUNT, default=1, show_default=True)
@click.option("--max-steps", type=COUNT, default=None, help="Stop each run after this many steps.")
@click.option("--cluster", is_flag=True, help="One worker per emulated node (network namespaces; needs root).")
@click.option("--bandwidth", default="100mbit", show_default=True, help="With --cluster: the links' rate.")
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Rounds of every strategy, interleaved.")
@click.option("--data-dir", default=None)
@click.option("--out", callback=writable_dir, default="runs/bench-compression", show_default=True, help="Writes OUT/compression.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write a PNG here.")
def bench_compression(strategies, nodes, epochs, max_steps, cluster, bandwidth, runs, data_dir, out, plot_dir):
    """Gradient compression (fp16, bf16, PowerSGD) vs uncompressed and vs torch's DDP hooks: time, accuracy, bytes."""
    from distlab.bench import compression
    records = compression.run(strategies, nodes, epochs, max_steps, cluster, bandwidth,
                              runs, data_dir, out, progress=_progress)
    _finish(compression, records, out, "compression", plot_dir)


@bench.command("elastic")
@click.option("--nodes", type=COUNT, default=2, show_default=True, help="Emulated nodes, one worker each.")
@click.option("--epochs", type=COUNT, default=1, show_default=True)
@click.option("--max-steps", type=COUNT, default=None, help="Stop each run after this many steps.")
@click.option("--kill-at-step", type=COUNT, default=400, show_default=True,
              help="Kill the last node once rank 0 has logged this step.")
@click.option("--snapshot-every", type=COUNT, default=100, show_default=True)
@click.option("--log-every", type=COUNT, default=10, show_default=True, help="Also the resolution of 'steps redone'.")
@click.option("--revive", is_flag=True, help="Start the node again later; the job takes it back in.")
@click.option("--bandwidth", default="1gbit", show_default=True, help="The links' rate.")
@click.option("--data-dir", default=None)
@click.option("--out", callback=writable_dir, default="runs/bench-elastic", show_default=True, help="Writes OUT/elastic.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write a PNG here.")
def bench_elastic(nodes, epochs, max_steps, kill_at_step, snapshot_every, log_every, revive, bandwidth, data_dir, out,
                  plot_dir):
    """Lose a node mid-epoch on the emulated cluster (root): the rest re-form, reshard and finish; vs uninterrupted."""
    from distlab.bench import elastic
    records = elastic.run(nodes, epochs, kill_at_step, snapshot_every, log_every, revive,
                          None if bandwidth == "none" else bandwidth, data_dir, max_steps, out=out, progress=_progress)
    _finish(elastic, records, out, "elastic", plot_dir)


@bench.command("snapshot-format")
@click.option("--workloads", default="main,wide-mlp-zero3", show_default=True,
              help="main (the main job's MLP, data parallel, SGD) and/or wide-mlp-zero3 (4096x4096, ZeRO-3, Adam).")
@click.option("--nproc", type=COUNT, default=2, show_default=True)
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Saves and loads per format (medians).")
@click.option("--dataset", default="fashion-mnist", show_default=True, help="Only its shapes matter.")
@click.option("--dir", "directory", callback=writable_dir, default=None, help="Write the snapshots under this directory (its disk).")
@click.option("--out", callback=writable_dir, default="runs/bench-snapshot-format", show_default=True,
              help="Writes OUT/snapshot-format.json.")
def bench_snapshot_format(workloads, nproc, runs, dataset, directory, out):
    """distlab's snapshot files vs torch.distributed.checkpoint: save and load time, bytes on disk."""
    from distlab.bench import snapshot_format
    records = snapshot_format.run(workloads, nproc, runs, dataset, directory, out, progress=_progress)
    _finish(snapshot_format, records, out, "snapshot-format", None)


@bench.command("scaling")
@click.option("--world", default="1,2,4", show_default=True, help="Worker counts.")
@click.option("--modes", default="weak,strong", show_default=True,
              help="weak (fixed per-worker batch) and/or strong (fixed global batch).")
@click.option("--methods", default="ddp", show_default=True,
              help="Strategies to compare (text form: ddp, bucketed:ring, allreduce+accum=2 ...), comma-separated.")
@click.option("--per-worker-batch", type=COUNT, default=32, show_default=True, help="Weak scaling: batch per worker.")
@click.option("--global-batch", type=COUNT, default=128, show_default=True, help="Strong scaling: global batch.")
@click.option("--model", default="mlp", show_default=True)
@click.option("--mlp-widths", default=None, help="Hidden widths of the MLP (default: the model's).")
@click.option("--dataset", default="fashion-mnist", show_default=True)
@click.option("--data-dir", default=None)
@click.option("--epochs", type=COUNT, default=1, show_default=True)
@click.option("--max-steps", type=COUNT, default=None, help="Cap every run at this many steps.")
@click.option("--optimizer", default="adam", show_default=True)
@click.option("--lr", type=Number(0.0, low_open=True), default=1e-3, show_default=True, help="LR at the per-worker batch (weak) / global batch (strong).")
@click.option("--lr-scaling", default="sqrt", show_default=True, help="Weak scaling LR rule: none, linear, sqrt.")
@click.option("--val-fraction", type=Number(0.0, 1.0, high_open=True), default=0.1, show_default=True)
@click.option("--cluster", is_flag=True, help="Run multi-worker runs on an emulated cluster, one node per worker (root).")
@click.option("--bandwidths", default="100mbit,1gbit,10gbit", show_default=True, help="With --cluster: link rates.")
@click.option("--out", callback=writable_dir, default="runs/bench-scaling", show_default=True, help="Writes OUT/scaling.json and OUT/runs/.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write loss-vs-time and efficiency PNGs here.")
def bench_scaling(world, modes, methods, per_worker_batch, global_batch, model, mlp_widths, dataset, data_dir,
                  epochs, max_steps, optimizer, lr, lr_scaling, val_fraction, cluster, bandwidths, out, plot_dir):
    """Weak and strong scaling over 1, 2, 4 workers (or emulated nodes): time per epoch, accuracy, efficiency."""
    from distlab.bench import scaling
    links = [b for b in bandwidths.split(",") if b] if cluster else [None]
    records = scaling.run(list(csv_ints(world)), modes.split(","), [m for m in methods.split(",") if m],
                          per_worker_batch, global_batch, model, dataset, data_dir, epochs, max_steps, optimizer, lr,
                          lr_scaling, val_fraction, links, cluster, out, progress=_progress, mlp_widths=mlp_widths)
    _finish(scaling, records, out, "scaling", plot_dir)


@bench.command("parallel")
@click.option("--workloads", default="mlp,wide-mlp,gpt", show_default=True,
              help="mlp (512,256) and wide-mlp (4096,4096) on --dataset; gpt (2 blocks, width 128) on --text-dataset.")
@click.option("--strategies", default=",".join(("dp", "zero1", "zero2", "zero3", "tp-naive", "tp-megatron", "dp2xtp",
                                                 "tp-sp", "torch-zero1", "torch-fsdp2", "torch-tp", "torch-tp-sp")),
              show_default=True, callback=name_list,
              help="Short names (dp, zero1-3, tp-naive, tp-megatron, tp-sp: tp = --nproc, dp2xtp), any strategy "
                   "text (e.g. bucketed:ring, allreduce+tp=2+zero=1), and torch's torch-zero1, torch-fsdp2, torch-tp, "
                   "torch-tp-sp (DTensor). Sequence parallel (tp-sp, torch-tp-sp) runs on gpt only.")
@click.option("--nproc", type=COUNT, default=4, show_default=True)
@click.option("--steps", type=COUNT, default=20, show_default=True)
@click.option("--batch", type=COUNT, default=64, show_default=True, help="Global batch size.")
@click.option("--dataset", default="fashion-mnist", show_default=True)
@click.option("--text-dataset", default="fortunes", show_default=True, help="The gpt workload's data.")
@click.option("--runs", type=COUNT, default=1, show_default=True,
              help="Interleaved rounds of every cell: medians over them, ratios with their range.")
@click.option("--optimizer", default="adam", show_default=True,
              help="adam (lr 1e-3) or sgd (lr 0.05, momentum 0.9: runs agree within the float32 bound).")
@click.option("--data-dir", default=None)
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/parallel.json.")
def bench_parallel(workloads, strategies, nproc, steps, batch, dataset, text_dataset, runs, optimizer, data_dir, out):
    """DP, ZeRO-1/2/3, tensor parallel and DP x TP beside torch's ZeRO, FSDP2 and DTensor TP."""
    from distlab.bench import parallel
    records = parallel.run(workloads.split(","), strategies, nproc, steps, batch,
                           dataset, data_dir, out, progress=_progress, text_dataset=text_dataset, runs=runs,
                           optimizer=optimizer)
    _finish(parallel, records, out, "parallel")



@bench.command("pipeline")
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Pipeline stages (processes).")
@click.option("--microbatches", default="1,2,4,8", show_default=True, help="Micro-batch counts M.")
@click.option("--schedules", default="gpipe,1f1b", show_default=True,
              help="gpipe, 1f1b, interleaved (--virtual chunks per rank), zb (zero bubble), interleaved-zb.")
@click.option("--virtual", type=COUNT, default=2, show_default=True,
              help="Chunks per rank for the interleaved schedules.")
@click.option("--implementations", default="distlab,torch", show_default=True,
              help="distlab (PipelineStage), distlab-actions (GPipe and 1F1B played by the action-list executor in "
                   "place of their plain loops) and torch (torch.distributed.pipelining).")
@click.option("--steps", type=COUNT, default=10, show_default=True)
@click.option("--batch", type=COUNT, default=32, show_default=True, help="Sequences per step.")
@click.option("--runs", type=COUNT, default=1, show_default=True, help="Interleaved rounds; times are medians.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/pipeline.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write a step-time and bubble PNG here.")
def bench_pipeline(nproc, microbatches, schedules, virtual, implementations, steps, batch, runs, out, plot_dir):
    """Pipeline schedules (GPipe, 1F1B, interleaved, zero bubble), distlab's beside
    torch.distributed.pipelining: time, bubble, memory, losses."""
    from distlab.bench import pipeline
    records = pipeline.run(nproc, csv_ints(microbatches), schedules, implementations, steps, batch, runs, out,
                           progress=_progress, virtual=virtual)
    _finish(pipeline, records, out, "pipeline", plot_dir)


@bench.command("overhead")
@click.option("--workloads", default="mlp,gpt", show_default=True,
              help="mlp (784-512-256-10, batch 64, fashion-mnist), gpt (the default GPT, 32 x 64 tokens) and tiny "
                   "(16-8-2, batch 8: a step of almost no compute, the framework's own cost); for a GPU "
                   "gpt-12x768 (GPT-2 small's shape on bytes: 12 x 768, 1024 tokens, batch 16, AdamW) and llama-1b "
                   "(16 x 2048, 32 heads / 8 key-value, SwiGLU 8192, 2048 tokens, batch 4, AdamW); llama is "
                   "the default Llama-family decoder.")
@click.option("--precisions", default="fp32,bf16", show_default=True, help="fp32, bf16, fp16 (GPU only).")
@click.option("--steps", type=COUNT, default=300, show_default=True, help="Steps per side and round.")
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Interleaved rounds of every side.")
@click.option("--device", callback=device_name, default="auto", show_default=True, envvar="DISTLAB_DEVICE",
              help="auto (cuda if available), cpu or cuda: both sides run there.")
@click.option("--threads", type=COUNT, default=None, help="Torch threads of each side (default: every core).")
@click.option("--dataset", default=None, help="Instead of the workload's data set.")
@click.option("--data-dir", default=None)
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/overhead.json.")
@click.option("--plot", "plot_dir", callback=writable_dir, default=None, help="Also write a ratio PNG here.")
@click.option("--compile", "compiled", is_flag=True,
              help="Also both sides compiled: the plain loop's whole model through torch.compile, distlab train "
                   "--compile (the whole model on one process): their ratio, and what compiling gains distlab's "
                   "step.")
@click.option("--sides", default=None,
              help="Only these sides, comma-separated: plain, plain-resident (GPU), distlab, plain-compiled, "
                   "distlab-compiled (default: every side the device and --compile give).")
def bench_overhead(workloads, precisions, steps, runs, device, threads, dataset, data_dir, out, plot_dir, compiled,
                   sides):
    """distlab's single-process step beside a plain PyTorch loop: same model, data, precision, device."""
    from distlab.bench import overhead
    records = overhead.run(workloads, precisions, steps, runs, device, threads, dataset, data_dir, out,
                           progress=_progress, compile=compiled, sides=sides)
    _finish(overhead, records, out, "overhead", plot_dir)


@bench.command("snapshot")
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Processes (gloo, CPU), one thread each.")
@click.option("--state-mb", type=Number(0.001, 1e6), default=100.0, show_default=True,
              help="The model state per rank (parameters and Adam's moments) the snapshots write, at least.")
@click.option("--steps", type=COUNT, default=24, show_default=True)
@click.option("--every", type=COUNT, default=4, show_default=True, help="A snapshot every N steps.")
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Interleaved rounds of both modes.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/snapshot.json.")
def bench_snapshot(nproc, state_mb, steps, every, runs, out):
    """How long a snapshot stalls training: written synchronously, or copied to host memory and written in
    the background (--snapshot-async)."""
    from distlab.bench import snapshot_stall
    records = snapshot_stall.run(nproc, state_mb, steps, every, runs, out, progress=_progress)
    _finish(snapshot_stall, records, out, "snapshot", None)


@bench.command("load")
@click.option("--init-from", required=True, help="hf:DIR, the checkpoint each rank loads its part of.")
@click.option("--nproc", type=COUNT, default=4, show_default=True, help="Processes (gloo, CPU), one thread each.")
@click.option("--layouts", default="zero=3,tp=2", show_default=True,
              help="Strategies as `distlab verify` writes them (allreduce+tp=2, zero=3, ...), comma-separated.")
@click.option("--modes", default="deferred,whole", show_default=True,
              help="deferred: built on the meta device, each rank its part (what train does); whole: built whole "
                   "on every rank, then cut.")
@click.option("--sources", default="checkpoint,random", show_default=True,
              help="checkpoint: the values read from it; random: a new model of its shape, initialised from the seed.")
@click.option("--runs", type=COUNT, default=1, show_default=True, help="Rounds of every layout and mode.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/load.json.")
def bench_load(init_from, nproc, layouts, modes, sources, runs, out):
    """The memory each rank takes to load a checkpoint before its first step: built on the meta device and
    given only its part, or built whole first."""
    from distlab.bench import load_peak
    from distlab.bench.common import choose
    records = load_peak.run(init_from, nproc, layouts.split(","), choose("--modes", modes, load_peak.MODES),
                            choose("--sources", sources, load_peak.SOURCES), runs, out, progress=_progress)
    _finish(load_peak, records, out, "load", None)


@bench.command("finetune")
@click.option("--init-from", required=True, help="hf:DIR, the checkpoint to fine-tune.")
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Processes (gloo, CPU), one thread each.")
@click.option("--layout", default="zero=3", show_default=True, help="A strategy as `distlab verify` writes it.")
@click.option("--variants", default="full,lora,lora-bf16", show_default=True,
              help="full: every weight trained; lora: adapters (r 16 on q, k, v, o) on a frozen base; lora-bf16: "
                   "that base held in bf16 under bf16 autocast; lora-nf4: QLoRA, the adapted weights in 4-bit NF4 "
                   "with adapters on every linear layer (ZeRO holds those 4-bit weights whole; not under TP).")
@click.option("--steps", type=COUNT, default=4, show_default=True, help="Steps per run (the first untimed).")
@click.option("--block-size", type=COUNT, default=128, show_default=True)
@click.option("--batch", type=COUNT, default=2, show_default=True, help="Global batch (windows).")
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Interleaved rounds of every variant.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/finetune.json.")
def bench_finetune(init_from, nproc, layout, variants, steps, block_size, batch, runs, out):
    """A fine-tune's model state, peak memory and step time per rank: the whole model trained, low-rank
    adapters on a frozen base, that base in bf16."""
    from distlab.bench import finetune
    from distlab.bench.common import choose
    records = finetune.run(init_from, nproc, layout, choose("--variants", variants, finetune.VARIANTS), steps, runs,
                           block_size, batch, out, progress=_progress)
    _finish(finetune, records, out, "finetune", None)


@bench.command("packing")
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Processes (gloo, CPU), one thread each.")
@click.option("--records", type=COUNT, default=400, show_default=True, help="Records of skewed lengths it writes.")
@click.option("--block-size", type=COUNT, default=256, show_default=True)
@click.option("--batch", type=COUNT, default=8, show_default=True, help="Global batch (windows).")
@click.option("--runs", type=COUNT, default=3, show_default=True, help="Interleaved rounds of both modes.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/packing.json.")
def bench_packing(nproc, records, block_size, batch, runs, out):
    """Fine-tuning records padded one per window or packed (--pack): windows, padding, and the records' own
    tokens trained per second."""
    from distlab.bench import finetune
    rows = finetune.run_packing(nproc, records, block_size, batch, runs, out, progress=_progress)
    click.echo(finetune.table(rows))
    click.echo(f"wrote {out}/packing.json", err=True)


@bench.command("dry-run")
@click.option("--presets", default="llama3-8b,llama3-70b", show_default=True, help="Published models (plan --preset).")
@click.option("--world", type=COUNT, default=64, show_default=True, help="Ranks of the layouts.")
@click.option("--window", type=COUNT, default=8192, show_default=True, help="Tokens per sequence.")
@click.option("--local-batch", type=COUNT, default=1, show_default=True, help="Sequences per data-parallel rank.")
@click.option("--strategies", default=None, help="Layouts in their text form, comma-separated (default: verify's "
              "language-model layouts a dry run can follow).")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/dry-run.json.")
def bench_dry_run(presets, world, window, local_batch, strategies, out):
    """The planner's model state and activations at full size against a dry run of distlab's code (meta device)."""
    from distlab.bench import dry_run
    records = dry_run.run([p.strip() for p in presets.split(",") if p.strip()], world, window, local_batch, _progress,
                          out, strategies)
    _finish(dry_run, records, out, "dry-run")


@bench.command("checkpointing")
@click.option("--workloads", default="vgg11-bn,resnet18,gpt", show_default=True)
@click.option("--steps", type=COUNT, default=6, show_default=True, help="Steps per variant (the first 2 untimed).")
@click.option("--batch", type=COUNT, default=32, show_default=True)
@click.option("--runs", type=COUNT, default=1, show_default=True, help="Interleaved rounds of both variants.")
@click.option("--pp", type=COUNT, default=1, show_default=True,
              help="Pipeline stages: each variant runs as a 1F1B pipeline on this many local processes (1 thread each).")
@click.option("--microbatches", type=COUNT, default=None, help="With --pp: micro-batches per step (default: --pp).")
@click.option("--precision", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Both variants under this autocast.")
@click.option("--out", callback=writable_dir, default="runs/bench", show_default=True, help="Writes OUT/checkpointing.json.")
def bench_checkpointing(workloads, steps, batch, runs, pp, microbatches, precision, out):
    """Activation checkpointing: peak activation bytes and time per step, with and without (one process, or
    a pipeline with --pp)."""
    from distlab.bench import checkpointing
    records = checkpointing.run(workloads, steps=steps, batch=batch, runs=runs, out=out, progress=_progress, pp=pp,
                                microbatches=microbatches, precision=precision)
    _finish(checkpointing, records, out, "checkpointing")


@bench.command("markdown")
@click.argument("paths", nargs=-1, required=True)
def bench_markdown(paths):
    """Print README-ready Markdown tables from bench JSON files."""
    from distlab.bench import markdown
    for p in paths:
        try:
            click.echo(markdown.render(p) + "\n")
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"cannot make a table from {p}: {exc}") from None

