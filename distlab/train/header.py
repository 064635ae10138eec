"""What a run says before its first step (rank 0 prints it): the data and how much of it each
evaluation scores, the model, the layout and mesh, the batch, the optimizer, the state a rank holds,
and every warning that makes its numbers mean less -- each setting read once, as
:mod:`distlab.train.summary` reads them at the end."""

from __future__ import annotations


from distlab.errors import with_article
from distlab.models import count_parameters, is_user_model
from distlab.parallel import components
from distlab.parallel.compile import compiled_modules
from distlab.parallel.cost import Optim, data_parallel_bytes
from distlab.parallel.pipeline import ideal_bubble
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.plan.trace import trace
from distlab.runtime import busy_machine, cores, load_before_run
from distlab.train.evaluate import MAPPED_EVAL_BATCHES
from distlab.train.summary import inactive_settings, oversubscription, plural


def _optimizer_words(cfg, total_steps: int) -> str:
    """The header's line of what updates the weights: optimizer, learning rate and its schedule, weight
    decay, clipping, label smoothing."""
    parts = [cfg.optimizer + (f" (momentum {cfg.momentum:g})" if cfg.optimizer == "sgd" and cfg.momentum else "")]
    lr = f"lr {cfg.effective_lr:g}" + (f" (--lr {cfg.lr:g}, {cfg.lr_scaling} scaling)" if cfg.lr_scaling != "none" else "")
    schedule = "constant" if cfg.lr_schedule == "constant" else f"{cfg.lr_schedule} to 0 over {total_steps:,} steps"
    parts.append(f"{lr}, {schedule}" + (f" after {cfg.warmup_steps} warmup steps" if cfg.warmup_steps else ""))
    parts.append(f"weight decay {cfg.weight_decay:g}" if cfg.weight_decay else "no weight decay")
    if cfg.clip_grad_norm:
        parts.append(f"gradients clipped to a global norm of {cfg.clip_grad_norm:g}")
    if cfg.label_smoothing:
        parts.append(f"labels smoothed by {cfg.label_smoothing:g}")
    return ", ".join(parts)


def _tokens(data) -> str:
    """What a token is: a byte, or a BPE's token (its vocabulary, learned size and rate on the text)."""
    tok = data.tokenizer
    if tok is None and data.tokens_per_byte is None:
        return f"token ids of a vocabulary of {data.num_classes:,}, no tokenizer"
    if tok is None or tok.spec == "bytes":
        return "bytes"
    if tok.spec == "hf":
        eos = f", end of sequence {tok.eos} between documents" if tok.eos is not None and not data.records else ""
        return (f"a pretrained model's tokenizer, {tok.learned:,} tokens in a vocabulary of {tok.vocab_size:,}{eos}, "
                f"{data.tokens_per_byte:.3f} tokens/byte")
    return (f"{tok.spec}: byte-level BPE learned from the training split, {tok.learned:,} of {tok.vocab_size:,} "
            f"tokens, {data.tokens_per_byte:.3f} tokens/byte")


def zero_costs_more(trainer) -> str | None:
    """Why ZeRO would hold more model state per rank than plain data parallel here (None: it holds
    less), by the memory model of ``distlab plan`` (exact for these models, see docs/RESULTS.md)."""
    cfg, mesh = trainer.cfg, trainer.mesh
    if mesh.tp > 1 or mesh.pp > 1:
        return None
    try:
        t = trace(cfg.model, tuple(trainer.train_set.input_shape), trainer.train_set.num_classes, lora=cfg.lora,
                  base_dtype=cfg.base_dtype, **cfg.model_options())
    except Exception:  # noqa: BLE001 - a model the memory model cannot trace: no prediction, no warning
        return None
    optim = Optim.of(cfg.optimizer, cfg.momentum, cfg.optimizer_state, cfg.offload)
    st = cfg.strategy
    zero = zero_peak_bytes(t, st.zero, mesh.replicas, optim, grad_accum=st.grad_accum, bucket_mb=st.bucket_mb)
    plain = data_parallel_bytes(t, optim)
    if zero <= plain:
        return None
    helps = "more ranks" + (", Adam" if cfg.optimizer == "sgd" else "") + (", or stage 2-3" if st.zero == 1 else "")
    return (f"zero {st.zero} on {mesh.replicas} data-parallel ranks holds more than plain data parallel would "
            f"({zero / 2**20:.2f} vs {plain / 2**20:.2f} MiB predicted): with {cfg.optimizer}"
            f"{f' (momentum {cfg.momentum:g})' if cfg.optimizer == 'sgd' else ''} the state it shards is small next "
            f"to the full gradients and flat shard copies it keeps; ZeRO pays off with {helps}")


def _evaluation_words(trainer) -> str:
    """What every evaluation scores: the whole test split, or how much of it (``--eval-batches``, or a
    memory-mapped corpus's bounded default)."""
    cfg, test, scored = trainer.cfg, trainer.test_set, trainer.eval_test
    unit = "pairs" if test.pairs else "windows" if test.predicts_tokens else "samples"
    at = f", {trainer.eval_batch:,} at a time per rank" if test.predicts_tokens else ""
    if len(scored) == len(test):
        return f"each evaluation scores all {len(test):,} test {unit}{at}"
    why = f"--eval-batches {cfg.eval_batches}" if cfg.eval_batches else \
        f"a memory-mapped corpus's default, {MAPPED_EVAL_BATCHES} global batches; --eval-batches N for more"
    return f"each evaluation scores the first {len(scored):,} of {len(test):,} test {unit} ({why}){at}"


def header(trainer) -> list[str]:
    """What is about to run, before the first step: data, model, strategy, mesh, batch, parameters."""
    cfg, rt, mesh, run = trainer.cfg, trainer.rt, trainer.mesh, trainer.run
    data = trainer.train_set
    where = data.source or "generated"
    if hasattr(data, "unigram_entropy"):
        lines = [f"data     {cfg.dataset} from {where}: {len(data):,} train, {len(trainer.test_set):,} test"
                 + (f", {len(trainer.val_set):,} validation" if trainer.val_set is not None else "")
                 + f"{' pairs of' if data.pairs else ''} windows of {data.block_size} tokens "
                   f"({_tokens(data)})"
                 # a loss on some targets only (a fine-tune's replies, a pair's) has no context-free baseline to beat
                 + ("" if data.ignores_targets or data.pairs else
                    f"; unigram entropy {data.unigram_entropy:.3f} nats/token: the loss to beat")]
    else:
        lines = [f"data     {cfg.dataset} from {where}: {len(data):,} train, {len(trainer.test_set):,} test"
                 + (f", {len(trainer.val_set):,} validation" if trainer.val_set is not None else "")
                 + f" ({'x'.join(map(str, data.input_shape))}, {data.num_classes} classes)"]
        if cfg.dataset.startswith(("tensors:", "imagefolder:")):  # statistics computed from the training split
            lines.append(f"         normalised per channel with the training split's mean "
                         f"{', '.join(f'{m:.4g}' for m in data.mean)} and std {', '.join(f'{s:.4g}' for s in data.std)}")
    lines += [f"         {data.about}"] if getattr(data, "about", "") else []
    lines += [f"         warning: {note}" for note in getattr(data, "notes", ())]
    lines.append(f"         {trainer.data_where}")
    lines.append(f"         {_evaluation_words(trainer)}")
    per_rank = count_parameters(trainer.engine.module)
    described = cfg.options.describe() if cfg.options is not None else ""
    if hasattr(data, "unigram_entropy"):
        described = ", ".join(filter(None, (described, f"context {cfg.block_size}")))
    shape = f" ({described})" if described and not is_user_model(cfg.model) else ""
    if is_user_model(cfg.model):  # where it came from
        where, _, name = cfg.model.rpartition(":")
        args = ", ".join(cfg.model_args)
        shape = f" (your model: {with_article(type(trainer.engine.module).__name__)} that {where}'s {name}({args}) returns)"
    lines.append(f"model    {cfg.model}{shape}: {trainer.num_parameters:,} parameters"
                 + (f", {per_rank:,} on each rank" if per_rank != trainer.num_parameters and mesh.pp == 1 else ""))
    if (spec := cfg.lora) is not None:
        lines.append(f"adapters LoRA {spec.text()} (scale {spec.scale:g}): {trainer.num_trainable:,} trained "
                     f"parameters ({trainer.num_trainable / trainer.num_parameters:.2%}); the base frozen"
                     + (f" and held in {cfg.base_dtype}" if cfg.base_dtype != "float32" else "")
                     + " -- no gradient, optimizer state or gradient sync for it")
        if cfg.lora_from is not None:  # adapters PEFT saved for a base: the one they name, against --init-from
            from distlab.models.peft_files import other_base
            other = other_base(cfg.lora_from[5:], cfg.init_from[3:])
            lines += [f"warning  {other}"] if other else []
    if rt.world_size == 1:
        lines.append(f"strategy single process ({plural(rt.threads, 'thread')}, {rt.device})"
                     + (f", {cfg.strategy.micro_steps} micro-batches per step" if cfg.strategy.micro_steps > 1 else ""))
    else:
        lines.append(f"strategy {cfg.strategy.label(rt.world_size)} on {rt.world_size} processes x {plural(rt.threads, 'thread')}, "
                     f"{rt.backend} on {rt.device.type}")
        lines.append(f"mesh     {mesh.describe()}")
    for kind in components.wanted(cfg.strategy):  # each parallelism that splits the model says how
        lines += kind.describe(trainer.engine)
    stages = trainer.engine.schedule.stages()
    if stages:
        cuts = "; ".join(f"stage {d['stage']}{' on rank ' + str(d['rank']) if 'rank' in d else ''} = layers "
                         f"{d['layers'][0]}-{d['layers'][1] - 1} ({d['first']} .. {d['last']}), {d['parameters']:,} "
                         f"parameters" for d in stages)
        st = cfg.strategy
        chunks = f" x {st.pp_virtual} chunks each (interleaved)" if st.pp_virtual > 1 else ""
        lines.append(f"pipeline {st.pp} stages{chunks}, schedule {st.pp_schedule}, {st.microbatches} micro-batches per step "
                     f"(ideal bubble {ideal_bubble(st.pp, st.microbatches, st.pp_schedule, st.pp_virtual):.0%}): {cuts}")
    micro_steps = cfg.strategy.micro_steps
    micro = trainer.local_batch // micro_steps
    lines.append(f"batch    {cfg.global_batch_size} global = {mesh.dp} data-parallel rank(s) x {trainer.local_batch}"
                 + (f" (micro-batches of {micro} x {micro_steps})" if micro_steps > 1 else "")
                 + (f", {cfg.block_size // mesh.cp} tokens of each sequence per context-parallel rank"
                    if mesh.cp > 1 else "")
                 + f"; {trainer.total_steps} steps, {trainer.steps_per_epoch} per epoch" + _left_out(trainer))
    lines.append(f"optim    {_optimizer_words(cfg, trainer.total_steps)}")
    lines += [f"warning  {w}" for w in trainer.observer.unreached(trainer.total_steps)]
    if cfg.max_steps and cfg.epochs and cfg.max_steps > trainer.total_steps:
        lines.append(f"warning  --max-steps {cfg.max_steps} is past --epochs {cfg.epochs}'s "
                     f"{trainer.total_steps:,} steps: the run stops at {trainer.total_steps:,} (drop --epochs to let "
                     f"--max-steps alone set the length)")
    if cfg.strategy.compile:
        n = len(compiled_modules(trainer.engine.module))
        whole = compiled_modules(trainer.engine.module) == [trainer.engine.module]
        what = "the whole model (nothing in this layout acts inside it)" if whole else \
            f"{n} module{'s' if n != 1 else ''} of the model's blocks"
        backend = "" if cfg.strategy.compile_backend == "inductor" else f" ({cfg.strategy.compile_backend})"
        lines.append(f"compile  {what} through torch.compile{backend}: the first step compiles "
                     f"{'it' if whole else 'them'} (seconds to minutes on a CPU), evaluation and a smaller last "
                     f"batch once more" if n else "warning  compile: the model lists no module to compile; it runs "
                     "eagerly")
    held = sum(p.numel() * p.element_size() for p in trainer.engine.module.parameters())
    extra = trainer.engine.peak_bytes - held
    lines.append(f"state    {held / 2**20:.2f} MiB of parameters"
                 + (f" + {extra / 2**20:.2f} MiB of the strategy's own copies (ZeRO's flat shards)" if extra > 0 else "")
                 + " on this rank before the first step (gradients and optimizer state follow; the summary gives "
                   "the peak)")
    if cfg.strategy.zero and mesh.replicas > 1 and rt.is_main and cfg.verbose:  # (a trace: only where it is shown)
        costlier = zero_costs_more(trainer)
        if costlier:
            lines.append(f"warning  {costlier}")
    crowded = oversubscription(rt)
    if crowded:
        lines.append(crowded)
    busy = busy_machine(load_before_run(), rt.local_world_size * rt.threads, cores(), rt.local_world_size) \
        if rt.device.type == "cpu" and not crowded else None
    if busy:
        lines.append(f"warning  {busy}")
    lines += [f"warning  {note}" for note in inactive_settings(cfg.strategy, mesh)]
    if cfg.snapshot_dir:
        lines.append(f"snapshots {cfg.snapshot_dir}" + (f" every {cfg.snapshot_every} steps" if cfg.snapshot_every else "")
                     + f", run {run.run_id}" + (f", resumed from {run.resumed_from}" if run.resumed_from else ""))
    return lines


def _left_out(trainer) -> str:
    """What each epoch does not train: the samples past its last whole global batch (every step is one global
    batch, so a step equals one process's), others each epoch where the order is shuffled."""
    n, drawn = len(trainer.train_set), trainer.steps_per_epoch * trainer.cfg.global_batch_size
    kind = "windows" if trainer.train_set.predicts_tokens else "samples"
    return (f"; each epoch leaves out {n - drawn:,} of its {n:,} training {kind} (the last, partial global batch; "
            f"others each epoch, as the order is shuffled)" if n > drawn else "")

