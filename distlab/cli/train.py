"""Commands that train and check: ``train``, ``verify``, ``report``, ``doctor``."""

from __future__ import annotations

import itertools
import os
import re
import sys
import time
from pathlib import Path

import click

from distlab.cli.flag_tables import TRAIN_OPTIONS
from distlab.cli.options import (COUNT, NONNEGATIVE, Number, config_from_flags, field_options,
                                 launch_options, output_file, run_distributed, writable_dir)
from distlab.errors import ConfigError


def _refuse_code(config_file: str, settings: dict, model_on_command_line: bool, trusted: bool) -> None:
    """A settings file is data: a model of the user's own that it names (code that would run) is refused
    unless the command line names a model itself or trusts the file."""
    from distlab.models import is_user_model
    model = settings.get("model")
    if model and is_user_model(str(model)) and not model_on_command_line and not trusted:
        raise ConfigError(f"--config {config_file} names the model {model}, which would run that code; a settings "
                          f"file runs none: name it on the command line too (--model {model}) or, if you trust the "
                          f"file, pass --trust-config")


def _slug(name: str) -> str:
    """A model's or data set's name as one word of a directory name (a file's name, not its path):
    ``synthetic:1x8x8:4:256`` -> ``synthetic_1x8x8_4_256``, ``tensors:/data/x.pt`` -> ``tensors_x.pt``."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", "_".join(Path(part).name for part in name.split(":")))


@click.command()
@field_options(TRAIN_OPTIONS)
@click.option("--config", "config_file", default=None,
              help="Settings from this TOML file (keys: the flags' names with underscores; every run writes its "
                   "own as OUT/config.toml); flags given beside it override it. It runs no code: a model of your "
                   "own it names runs only with --model naming it too, or --trust-config.")
@click.option("--trust-config", is_flag=True,
              help="Let --config name your own model (path/to/file.py:build), whose code then runs.")
@launch_options
def train(config_file, trust_config, **kw):
    """Train a model: data parallel over every rank, with --tp and --pp a data x tensor x pipeline mesh."""
    from distlab.train import TrainConfig
    from distlab.train.config_file import read_config_file

    values = config_from_flags(kw, TRAIN_OPTIONS)
    if config_file:  # the file's settings where the command line did not give the flag
        ctx = click.get_current_context()
        given = {key for key in values if ctx.get_parameter_source(key) not in (None, click.core.ParameterSource.DEFAULT)}
        settings = read_config_file(config_file)
        _refuse_code(config_file, settings, "model" in given, trust_config)
        for key, value in settings.items():
            if key not in given:
                values[key] = value
    from distlab.runtime import under_launcher
    inherited = os.environ.get("DISTLAB_OUT") if under_launcher() else None  # the launching command's default
    values["out"] = values["out"] or inherited or os.path.join(
        "runs", f"{_slug(values['model'])}-{_slug(values['dataset'])}-{time.strftime('%Y%m%d-%H%M%S')}")
    if kw["nproc_per_node"] is not None and not under_launcher():
        os.environ["DISTLAB_OUT"] = values["out"]  # torchrun's workers inherit it: one default for every rank
    cfg = TrainConfig.from_flags(**values)
    from distlab.train.lock import check_writable
    check_writable(cfg.snapshot_dir, "snapshot_dir")  # before anything starts: one line, not a failed snapshot later
    check_writable(cfg.out, "out")
    check_writable(cfg.tensorboard, "tensorboard")
    device = kw["device"]
    elastic = ":" in str(kw.get("nnodes") or "")  # a node may join a running job: its workers decide
    multi_node = str(kw.get("nnodes") or "1") != "1"  # launchers on several hosts: rank 0 locks the directories

    def check(world_size: int) -> None:
        # Before any process starts: flags, the batch split and the data on disk.
        from distlab import runtime
        from distlab.data import locate
        cfg.validate(world_size)
        if cfg.strategy.sync_bn == "torch" and runtime.resolve_device(device, 0).type != "cuda":
            raise ConfigError("--sync-bn torch uses torch.nn.SyncBatchNorm, which only runs on GPUs; this run is on "
                              "the CPU: use --sync-bn distlab, which works on any device")
        from distlab.parallel.precision import check_device
        check_device(cfg.strategy.precision, runtime.resolve_device(device, 0))
        from distlab.parallel.offload import check_offload, check_unused  # (where the state goes: the device's)
        check_offload(cfg.offload, cfg.offload_dir, cfg.strategy.zero, runtime.resolve_device(device, 0).type)
        check_writable(cfg.offload_dir, "offload_dir")
        check_unused(cfg.offload_dir)
        if cfg.profile and cfg.out and (Path(cfg.out) / "profile").exists() and not (Path(cfg.out) / "profile").is_dir():
            raise ConfigError(f"--profile writes one trace per rank into {Path(cfg.out) / 'profile'}/, which is a "
                              f"file: move it, or give another --out")
        if cfg.strategy.compile:
            from distlab.parallel.compile import check_toolchain
            check_toolchain(runtime.resolve_device(device, 0), cfg.strategy.compile_backend)
        if cfg.dataset.startswith("tokens:"):
            from distlab.data.tokens import manifest_of, verify
            verify(cfg.dataset, manifest_of(cfg.dataset, cfg.vocab_size))  # a prepared corpus, whole: its checksums and token ids
        elif cfg.dataset.startswith("sft:"):
            from distlab.data.sft import read
            read(cfg.dataset, cfg.tokenizer, cfg.chat_turns, progress=True)  # every record readable (chat ones through the template), before launch
        elif cfg.dataset.startswith("dpo:"):
            from distlab.data.preference import read as read_pairs
            read_pairs(cfg.dataset, cfg.tokenizer, progress=True)  # every pair, as above
        elif cfg.dataset.startswith("rl:"):
            from distlab.data.rl import load_prompts
            load_prompts(cfg.dataset, "train", cfg.block_size, cfg.tokenizer)  # every prompt readable, before launch
        elif not cfg.dataset.startswith(("synthetic", "tensors:", "imagefolder:", "text:")):
            locate(cfg.dataset, cfg.data_dir)
        if cfg.resume not in (None, "auto"):
            from distlab.train.snapshot_load import check_path
            check_path(cfg.resume)
        from distlab.train.export import check_init
        check_init(cfg.weights_from())
        if cfg.resume is None and not elastic:
            from distlab.train.run_dirs import directory_problem
            problem = directory_problem(cfg.snapshot_dir, cfg.out, "", fresh=True)
            if problem:
                raise ConfigError(problem)
            events = sorted(Path(cfg.tensorboard).glob("events.out.tfevents.*")) if cfg.tensorboard else []
            if events:  # another run's curves: a new run's would be drawn into them
                raise ConfigError(f"--tensorboard {cfg.tensorboard} already holds another run's event files "
                                  f"({events[0].name}{', ...' if len(events) > 1 else ''}): give this run its own "
                                  f"directory, or continue that run with --resume auto")

    def body(rt):
        from distlab.train import Trainer
        from distlab.train.summary import print_summary
        trainer = Trainer(cfg, rt)
        summary = trainer.fit()
        if rt.is_main and trainer.already_finished:
            click.echo(f"distlab: run {summary.get('run_id')} had finished (step {summary.get('steps')}, "
                       f"{cfg.out}/summary.json): nothing to do, nothing changed", err=True)
        elif rt.is_main:
            print_summary(summary, cfg.out)
        if summary.get("stopped") == "interrupted" and not under_launcher():
            sys.exit(130)  # Ctrl-C, after the clean stop: the shell's "interrupted" (a launcher says it itself)
        from distlab.runtime import leave
        leave()  # every rank done: exit 0 now, whatever gloo's teardown would do

    def prelaunch():
        # One run per directory: held from here, before any worker starts, to the end of the job (the
        # workers die with this process, runtime.follow_launcher, so the lock never outlives it).
        from distlab.train import lock
        taken = []
        try:
            for directory, flag in ((cfg.snapshot_dir, "snapshot_dir"), (cfg.out, "out"),
                                    (cfg.tensorboard, "tensorboard")):  # tensorboard: two runs' events would mix
                if lock.hold(directory, flag=flag, export_to_children=True):
                    taken.append(directory)
        except ConfigError:
            lock.release_each(taken)
            raise
        return lambda: lock.release_each(taken)

    run_distributed(kw, body, check, None if multi_node else prelaunch)


# --------------------------------------------------------------------------- export


@click.command()
@click.argument("snapshot_path", metavar="SNAPSHOT|RUN_DIR")
@click.option("-o", "--out", required=True, help="The file to write: model.pt (torch.save), or model.safetensors; "
              "with --format hf, the directory.")
@click.option("--best", is_flag=True, help="The best validation model the snapshot keeps (runs with --val-fraction).")
@click.option("--format", "fmt", type=click.Choice(["auto", "hf", "peft"]), default="auto", show_default=True,
              help="auto: by OUT's suffix; hf: a Hugging Face directory (config.json, safetensors shards with an "
                   "index, the run's tokenizer.json) that transformers' from_pretrained loads; peft: a --lora run's "
                   "adapters (adapter_config.json, adapter_model.safetensors) for peft.PeftModel.from_pretrained.")
@click.option("--merge", is_flag=True, help="With --format hf, of a --lora run: the merged model (each adapted "
              "weight W + B A alpha / r).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="With --format hf: the weights' dtype (default: the checkpoint's own where the run started from "
                   "one, else float32).")
def export(snapshot_path, out, best, fmt, dtype, merge):
    """Write a snapshot's whole model (any layout, shards put back together) as one state_dict file; a
    run directory gives its last snapshot, or the final model a language model's run leaves there.

    torch.load(OUT, weights_only=True) (or safetensors.torch.load_file for a .safetensors OUT) and
    model.load_state_dict accept it; distlab train --init-from starts a run from it.
    """
    from distlab.train.export import export as write

    info = write(snapshot_path, out, best, fmt, dtype, merge)
    if fmt == "peft":
        click.echo(f"wrote {info['out']}: the low-rank adapters ({info['lora']}) of {info['model']} at step "
                   f"{info['step']}, {info['tensors']} tensors, {info['parameters']:,} parameters "
                   f"({', '.join(info['files'])})")
        click.echo(f"load it: peft.PeftModel.from_pretrained(base_model, {info['out']!r})")
        return
    if fmt == "hf":
        click.echo(f"wrote {info['out']}: {info['model']} at step {info['step']}, {info['tensors']} tensors, "
                   f"{info['parameters']:,} parameters in {info['dtype']} ({', '.join(info['files'])})")
        click.echo(f"load it: transformers.AutoModelForCausalLM.from_pretrained({info['out']!r})")
        return
    ranks = f" ({info['world_size']} ranks)" if info.get("world_size") else ""
    click.echo(f"wrote {info['out']}: {info['model']} at step {info['step']}{ranks}, "
               f"{info['tensors']} tensors, {info['parameters']:,} parameters, {info['bytes']:,} bytes, "
               f"sha256 {info['sha256'][:16]}... in {info['sha256_file']}"
               + (f"; its tokenizer in {info['tokenizer_file']}" if info.get("tokenizer_file") else ""))
    read = (f"safetensors.torch.load_file({info['out']!r})" if info["out"].endswith(".safetensors") else
            f"torch.load({info['out']!r}, weights_only=True)")
    click.echo(f"load it: model = {info['build']}; model.load_state_dict({read})")


@click.command()
@click.argument("source", metavar="RUN_DIR|SNAPSHOT|MODEL_FILE")
@click.option("--prompt", default="", help="The text to continue (tokenized as the model was trained).")
@click.option("--max-new-tokens", type=COUNT, default=200, show_default=True)
@click.option("--temperature", type=Number(0.0, 100.0), default=0.8, show_default=True,
              help="0: always the most likely token; higher: more varied.")
@click.option("--top-k", type=COUNT, default=None, help="Sample among the K most likely tokens only.")
@click.option("--seed", type=NONNEGATIVE, default=0, show_default=True, help="The same seed prints the same text.")
@click.option("--n-head", type=COUNT, default=None, help="For a plain model file: its attention heads.")
@click.option("--tokenizer", "tokenizer_file", default=None,
              help="For a plain model file trained with a BPE: its tokenizer.json (default: MODEL_FILE.tokenizer.json "
                   "beside it, which export writes; a model of 256 tokens reads bytes).")
@click.option("--top-p", type=Number(0.0, 1.0, low_open=True), default=None,
              help="Sample among the most likely tokens whose probabilities sum to P (nucleus sampling).")
@click.option("--cache/--no-cache", default=True, show_default=True,
              help="Keep the keys and values: the prompt runs once, then one token a step (the same tokens).")
@click.option("--chat", is_flag=True, help="hf:DIR with a chat template: --prompt is a user's message, rendered by "
              "the template with its generation prompt; the assistant's reply is printed.")
def generate(source, prompt, max_new_tokens, temperature, top_k, seed, n_head, tokenizer_file, top_p, cache, chat):
    """Print text from a trained language model: a run directory (its last snapshot), a snapshot of any
    layout, an exported model file, or hf:DIR (a Hugging Face checkpoint and its tokenizer.json). The text
    is printed as it is sampled; it stops at the tokenizer's end-of-sequence token, where it has one."""
    from distlab.tools.generate import chat_prompt, stream
    from distlab.train.loading import load
    for flag, value in (("--top-k", top_k), ("--top-p", top_p)):  # greedy decoding samples nothing
        if value is not None and temperature == 0:
            raise ConfigError(f"{flag} with --temperature 0: greedy decoding takes the most likely token every step; "
                              f"give a temperature above 0 to sample, or drop {flag}")
    loaded = load(source, n_head, tokenizer_file)
    model, tokenizer, where = loaded
    text = chat_prompt(source, prompt, loaded.meta) if chat else prompt
    click.echo(f"{where}: {sum(p.numel() for p in model.parameters()):,} parameters, {tokenizer.spec} tokens; "
               f"seed {seed}", err=True)
    pieces = stream(model, text, max_new_tokens, temperature, top_k, seed, tokenizer, cache, top_p, begin=not chat)
    first = next(pieces, "")  # the settings are checked before anything is printed
    for piece in itertools.chain([("" if chat else prompt) + first], pieces):
        click.echo(piece, nl=False)
        sys.stdout.flush()
    click.echo()


# --------------------------------------------------------------------------- verify


@click.command()
@click.option("--nproc", type=COUNT, default=2, show_default=True, help="Processes (gloo, CPU) for the distributed runs.")
@click.option("--strategy", "strategies", multiple=True,
              help="A strategy in its text form, repeatable: METHOD[:COLLECTIVE] then +accum=K, +bucket=MB, +syncbn, "
                   "+tp=N, +naive, +sp, +cp=N, +ulysses, +ep=N, +zero=S, +pp=P, +mb=M, +gpipe/+1f1b/+zb, +vpp=V, "
                   "+ckpt, +compile, +bf16, +reduce=DTYPE, +compress=C, and any registered component's +NAME; +adam (the "
                   "optimizer), +clip (gradients clipped by their global norm, every step), +smooth (the loss's "
                   "labels smoothed by 0.1), +mask (30% of the transformer's targets ignored: the loss a mean over the "
                   "rest), +gpt (the transformer) or +gpt-moe (with mixture-of-experts MLPs: for +ep) (e.g. bucketed:ring+accum=4, "
                   "zero=3, allreduce+tp=2+naive, bucketed+tp=2+pp=2+gpt, bucketed+cp=2+gpt, bucketed+ep=2+gpt-moe). Default: every --dp-sync x --collective, "
                   "accum=4 for each method, syncbn, and on an even world tp=2 both styles and two-stage pipelines.")
@click.option("--steps", type=COUNT, default=10, show_default=True, help="SGD steps per run.")
@click.option("--global-batch-size", type=COUNT, default=None, help="Default: 12 x --nproc.")
@click.option("--json", "json_path", default=None, callback=output_file, help="Write the records here.")
@click.option("--resume", "resume", is_flag=True,
              help="Instead: SIGKILL a worker mid-run under torchrun --max-restarts 1 and check that the resumed "
                   "run ends bitwise equal to an uninterrupted one (the kill drill of --faults; default strategy "
                   "allreduce+adam).")
@click.option("--faults", "faults", default=None, is_flag=False, flag_value="all", metavar="DRILLS",
              help="Instead: fault drills on real jobs, all or a comma list of kill, kill-in-snapshot, preempt, "
                   "reshard, disk-full: bitwise equal to an uninterrupted run after each (reshard: within float32 "
                   "rounding); disk-full fails in one line keeping the earlier snapshot (root only). Default "
                   "strategy allreduce+adam. Asked for by name only: link-cut (2 emulated nodes, root; node 1's "
                   "link dropped mid-epoch: every rank fails within --comm-timeout naming who is unreachable, "
                   "then --resume auto finishes bitwise).")
@click.option("--workdir", default=None, callback=writable_dir, help="With --resume or --faults: keep the runs here (default: a temporary "
                                              "directory).")
@click.option("--model", default=None, help="Your own model (path/to/file.py:build or package.module:build) instead "
                                            "of the built-in ones; by default the strategies it supports.")
@click.option("--model-arg", "model_args", multiple=True, help="With --model: key=value for its builder (repeatable).")
@click.option("--dataset", default=None, help="With --model: the data (default synthetic:3x8x8:4:480).")
@click.option("--collective", default=None, help="Run the strategies over this collective algorithm: one of distlab's "
                                                 "(ring, ring_plain, butterfly, direct) or your own all-reduce, "
                                                 "path/to/file.py:NAME or package.module:NAME (distlab.comm.user); "
                                                 "without --strategy: allreduce, bucketed, zero=2 and zero=3 over it.")
@click.option("--dp-sync", "dp_sync", default=None, help="Run the strategies with this gradient sync: one of distlab's "
                                                         "or your own SyncMethod subclass, path/to/file.py:NAME or "
                                                         "package.module:NAME; without --strategy: it alone and with "
                                                         "accum=2.")
def verify(nproc, strategies, steps, global_batch_size, json_path, resume, faults, workdir, model, model_args, dataset,
           collective, dp_sync):
    """Prove each strategy equals single-process training: largest parameter and loss differences."""
    import json
    import tempfile

    from distlab.tools import faults as f
    from distlab.tools import verify as v
    from distlab.train.metrics import atomic_write_text
    if nproc < 1 or steps < 1:
        raise ConfigError("--nproc and --steps must be at least 1")
    if resume and faults:
        raise ConfigError("--resume is the kill drill of --faults: give one of them")
    drills = ["kill"] if resume else (list(f.DRILLS) if faults == "all" else
                                      [d.strip() for d in faults.split(",") if d.strip()] if faults else None)
    unknown = [d for d in drills or [] if d not in f.RUNNERS]
    if unknown:
        raise ConfigError(f"unknown fault drill {unknown[0]!r}; choose from: {', '.join(f.DRILLS + f.OPT_IN)}")
    if drills and steps < 8:
        raise ConfigError(f"fault drills need at least 8 steps (snapshots every steps/4, a fault after steps/2), "
                          f"not {steps}")
    if (model_args or dataset) and not model:
        raise ConfigError("--model-arg and --dataset are for your own --model")
    if model and drills:
        raise ConfigError("--model verifies your model's strategies; the fault drills use the built-in model")
    mine = dict(model=model, model_args=model_args, dataset=dataset) if model else {}
    if collective is not None or dp_sync is not None:  # the same strategies (or those it serves) with it
        import dataclasses
        chosen = [v.parse_strategy(s) for s in strategies or (
            ("allreduce", "allreduce+accum=2") if dp_sync else ("allreduce", "bucketed", "zero=2", "zero=3"))]
        changes = {k: value for k, value in (("collective", collective), ("dp_sync", dp_sync)) if value is not None}
        chosen = [dataclasses.replace(c, strategy=c.strategy.replace(**changes)) for c in chosen]
    else:
        chosen = [v.parse_strategy(s) for s in strategies] or (
            [v.parse_strategy("allreduce+adam")] if drills else v.default_strategies(nproc))
    if model:  # the model against the data (and every check plain data parallel needs): once, for all strategies
        v.config_for(v.parse_strategy("allreduce"), nproc, steps, global_batch_size, **mine)
    usable = []
    for s in chosen:  # flags, batch split and what the model declares, before any process starts
        try:
            v.config_for(s, nproc, steps, global_batch_size, **mine)
            usable.append(s)
        except ConfigError as exc:
            if strategies or not model:  # asked for by name: refuse; a default the model cannot run: say so
                raise
            from distlab.tools.flags import flagify
            click.echo(f"skipped {s.name}: {flagify(str(exc))}", err=True)
    chosen = usable
    what = f"fault drills ({', '.join(drills)}) for" if drills else "verifying"
    click.echo(f"{what} {len(chosen)} strategies on {nproc} processes, {steps} steps each ...", err=True)
    if drills:
        with tempfile.TemporaryDirectory(prefix="distlab-verify-") as tmp:
            records = [r for i, s in enumerate(chosen)
                       for r in f.run_drills(s, nproc, steps, os.path.join(workdir or tmp, f"{i}-{s.name}"), drills)]
        click.echo(f.table(records))
    else:
        records = v.verify(chosen, nproc, steps, global_batch_size, **mine)
        click.echo(v.table(records))
    if json_path:
        atomic_write_text(json_path, json.dumps(records, indent=1) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    failed = [r["strategy"] + (f" ({r['drill']})" if "drill" in r else "") for r in records if r["passed"] is False]
    if failed:
        reason = "failed their fault drills" if drills else \
            "differ from single-process training beyond their rounding bound"
        click.echo(f"{len(failed)} strategies {reason}: {', '.join(failed)}", err=True)
        sys.exit(1)


# --------------------------------------------------------------------------- report


@click.command()
@click.argument("paths", nargs=-1, required=True)
@click.option("-o", "--output", default="report.html", show_default=True, help="The HTML file to write.")
@click.option("--title", default="distlab report", show_default=True)
@click.option("--images", default=None, help="Also write every plot as a PNG file into this directory.")
def report(paths, output, title, images):
    """One self-contained HTML page (plots + tables) from run directories and bench, verify and
    plan validate JSON files."""
    from distlab.tools.report import write_report
    inputs = write_report(list(paths), output, title, images)
    for path in inputs.images:
        click.echo(f"wrote {path}", err=True)
    for path, why in inputs.problems:
        click.echo(f"distlab: warning: {path}: {why}", err=True)
    skipped = f", {len(inputs.skipped)} other JSON file(s) skipped" if inputs.skipped else ""
    click.echo(f"wrote {output} ({len(inputs.read)} inputs, {len(inputs.problems)} could not be used{skipped})",
               err=True)




@click.command()
@click.option("--data-dir", default=None, help="Also look for datasets here.")
def doctor(data_dir):
    """What this machine offers: torch, backends, devices, cores, datasets."""
    from distlab.tools.doctor import report
    click.echo(report(data_dir))

