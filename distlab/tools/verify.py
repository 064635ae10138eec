"""``distlab verify``: each strategy on N processes against single-process training, step by step.

For every strategy, the distributed run (the real :class:`~distlab.train.Trainer` on N gloo
processes) and a plain single-process loop -- written here independently of the trainer: one
model, one SGD optimizer, the sequential global batches -- train from the same initial weights on
the same global batches. Reported: the largest parameter difference (absolute, and relative to
the largest entry of that parameter) after the last step and the largest difference of the
per-step global training loss.

**Tolerance from float32 rounding.** The runs differ only in summation order: a mean over the
global batch ``B`` summed per rank then across ranks, instead of in one go. That perturbs each
gradient entry by up to ``B * eps`` relative (``eps`` = float32 machine epsilon, 1.19e-7). SGD
with learning rate ``lr`` and momentum ``mu`` turns a gradient perturbation ``d`` into a
parameter change of at most ``lr / (1 - mu) * d`` per step, and the steps add up, so with
``|grad| <= 1``::

    tolerance = 2 * steps * lr / (1 - mu) * B * eps

(the factor 2 covers the loss and gradient being computed in another order as well). Leaving
out gradient synchronisation moves parameters by orders of magnitude more (tested).

**Reduced precision.** Under ``bf16``/``fp16`` autocast the reference trains under the same
autocast. The products are then rounded to the narrow dtype (unit roundoff ``u_p``: 2^-8 for
bfloat16, 2^-11 for float16) per rank instead of once over the whole batch, and activations
computed with another blocking may round the other way: the per-step gradient perturbation grows
by ``4 u_p`` (two roundings on either side). Gradients communicated in a narrow dtype (``reduce=``,
``compress=fp16|bf16``) are rounded once before sending and up to ``N - 1`` times in the sum:
``+ N u_w``. So ``d = B eps + 4 u_p + N u_w`` replaces ``B eps`` above. PowerSGD has no rounding
bound -- a low-rank approximation is not the mean -- so its runs are reported as approximate, with
the measured deviation and no pass/fail. Neither has **Adam**: it divides each gradient entry by
its own running size, so an entry whose gradient is rounding noise moves by up to ``lr`` either way
whatever the noise's size; ``+adam`` runs are reported the same way. Anything that must hold on every
machine compares SGD runs against :func:`sgd_tolerance`, or compares bitwise.

Strategies are written in :class:`~distlab.parallel.Strategy`'s text form, e.g. ``bucketed:ring``,
``ddp+accum=4``, ``allreduce+syncbn``, ``zero=3``, ``allreduce+tp=2+naive``, with ``+adam`` to train
with Adam. SyncBN strategies use a small CNN with BatchNorm2d, whose single-process reference
normalises over the whole global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from distlab.data.preference import is_preference
from distlab.errors import ConfigError, did_you_mean
from distlab.models import spec
from distlab.models.packing import bind, split
from distlab.tools.verify_data import (GRPO, GRPO_DATA, compare, dpo_mean, grpo_tolerance, grpo_training,  # noqa: F401
                                       packing_records, reference_key, reference_logps, scratch,
                                       table)  # (table: verify's)
from distlab.parallel import COLLECTIVES, SYNC_METHODS, Strategy
from distlab.parallel.strategy_text import modifier_words
from distlab.train.config import TrainConfig
from distlab.train.preference import DEFAULT_BETA
from distlab.tools.bounds import EPS32, UNIT_ROUNDOFF, evaluation_tolerance, gradient_tolerance, sgd_tolerance, \
    step_tolerance, sum_tolerance  # noqa: F401 (verify's bounds, where the tests and tools read them)


def verify_sizes() -> dict:
    """The small models' sizes (a case's ``+NAME=N`` sets any other option of its model's)."""
    return {"mlp_widths": (32, 16), "n_layer": 2, "n_head": 4, "n_embd": 16}


def case_models() -> tuple[str, ...]:
    """The model words of a case: every registered language model (+gpt: the transformer; +gpt-moe:
    with mixture-of-experts MLPs, 8 experts, top 2), a family of your own registered beside them."""
    from distlab.models import specs
    return tuple(s.name for s in specs() if s.text)
CLIP_NORM = 0.02  # +clip: the max-norm, below every step's gradient norm on verify's models (each step is clipped)
SMOOTHING = 0.1  # +smooth: the training loss's label smoothing
SMALL_BUCKET_MB = 0.004  # several buckets on the tiny models below (unless a strategy sets bucket=)
MASKED = 0.3  # +mask: this share of the transformer's targets ignored (IGNORE_INDEX), as a fine-tuning prompt's


@dataclass(frozen=True)
class Case:
    """A strategy to verify, the optimizer it trains with (``+adam`` in the text form) and the
    model (``+gpt``: a small transformer on synthetic text; otherwise an MLP, or a BN CNN for SyncBN)."""

    strategy: Strategy
    optimizer: str = "sgd"
    model: str | None = None
    clip: float | None = None  # +clip: gradients clipped to this global norm (CLIP_NORM)
    smoothing: float = 0.0  # +smooth: the loss's targets smoothed by this much (SMOOTHING)
    masked: bool = False  # +mask: a share MASKED of the transformer's targets ignored (the loss: a mean over the rest)
    options: tuple[tuple[str, int | str], ...] = ()  # +NAME=N after the model: its sizes beside verify's small ones
    # (or a text option's value: +rope_scaling=llama3,factor=8,original_max_position_embeddings=16)
    lora: str | None = None  # +lora=r=4,alpha=8,targets=q,v: low-rank adapters trained, the rest frozen
    base_dtype: str = "float32"  # +base=bf16 (or nf4: QLoRA's 4-bit weights): that frozen base's type (with +bf16)
    dpo: bool = False  # +dpo: DPO on generated preference pairs (the reference: the starting model)
    pack: bool = False  # +pack: generated fine-tuning records packed into windows, each attending to itself only
    grpo: bool = False  # +grpo: GRPO from a reward on generated prompts (rollouts, advantages, a KL to the start)
    offload: str = "none"  # +offload=optimizer (or params; ",overlap": its step beside the next forward): in a file

    @property
    def name(self) -> str:
        return (str(self.strategy) + ("+adam" if self.optimizer == "adam" else "")
                + (f"+{self.model}" if self.model else "") + "".join(f"+{k}={v}" for k, v in self.options)
                + ("+clip" if self.clip else "") + ("+smooth" if self.smoothing else "") + ("+mask" if self.masked else "")
                + (f"+lora={self.lora}" if self.lora else "") + (f"+base={self.base_dtype}" if self.base_dtype != "float32" else "")
                + ("+dpo" if self.dpo else "") + ("+pack" if self.pack else "") + ("+grpo" if self.grpo else "")
                + (f"+offload={self.offload}" if self.offload != "none" else ""))

    def flags(self) -> dict:
        return {**self.strategy.to_dict(), "optimizer": self.optimizer, **({"model": self.model} if self.model else {}),
                **({"clip_grad_norm": self.clip} if self.clip else {}),
                **({"label_smoothing": self.smoothing} if self.smoothing else {})}


def parse_strategy(text: str) -> Case:
    """The :class:`~distlab.parallel.Strategy` text form, plus ``+adam`` for the optimizer, ``+gpt`` (a
    language model) for the transformer and, after it, ``+NAME=N`` for one of its sizes (``+kv_heads=1``)."""
    tokens = [t.strip() for t in text.split("+")]
    lora = next((t.partition("=")[2] for t in tokens if t.startswith("lora=")), None)
    base = next((t.partition("=")[2] for t in tokens if t.startswith("base=")), "float32")
    offload = next((t.partition("=")[2] for t in tokens if t.startswith("offload=")), "none")
    tokens = [t for t in tokens if not t.startswith(("lora=", "base=", "offload="))]
    clip = CLIP_NORM if "clip" in tokens else None
    smoothing = SMOOTHING if "smooth" in tokens else 0.0
    masked, dpo, pack, grpo = "mask" in tokens, "dpo" in tokens, "pack" in tokens, "grpo" in tokens
    tokens = [t for t in tokens if t not in ("clip", "smooth", "mask", "dpo", "pack", "grpo")]
    model = next((t for t in tokens if t in case_models()), None)
    names = spec(model).options.names() if model else ()
    texts = {f.name for f in fields(spec(model).options) if "str" in str(f.type)} if model else set()
    options = tuple((k, int(v) if v.isdigit() else v) for k, _, v in (t.partition("=") for t in tokens)
                    if k in names and (v.isdigit() or k in texts and v))
    tokens = [t for t in tokens if t.partition("=")[0] not in dict(options)]
    for t in tokens[1:]:
        hint = did_you_mean(t, (*case_models(), "adam", "clip", "smooth", "mask"),
                            {"moe": "gpt-moe", "transformer": "gpt", "adamw": "adam", "masked": "mask"})
        if hint and t not in (*case_models(), "adam", *modifier_words()) and "=" not in t:
            raise ConfigError(f"strategy {text!r}: {t!r} is not a modifier{hint} (verify's models: +gpt, +gpt-moe; "
                              f"its optimizer: +adam; +clip clips gradients by their global norm; +smooth smooths "
                              f"the loss's labels; +mask ignores a share of the transformer's targets)")
    model = next((t for t in tokens if t in case_models()), None)
    if masked and not model:
        raise ConfigError(f"{text}: +mask ignores a share of a transformer's next-token targets; add +gpt or +gpt-moe")
    if model and "adam" in tokens:
        raise ConfigError(f"{text}: Adam on the transformer has no float32 tolerance to verify against -- it divides "
                          f"each gradient entry by its own size, so entries whose gradient is rounding noise move by "
                          f"up to lr either way; verify the transformer with SGD (drop +adam)")
    rest = "+".join(t for t in tokens if t not in ("adam", *case_models()))
    if (lora is not None or dpo or pack or grpo) and not model:
        word = "lora" if lora is not None else "dpo" if dpo else "pack" if pack else "grpo"
        raise ConfigError(f"{text}: +{word} trains a transformer; add +llama or another language model")
    return Case(Strategy.parse(rest) if rest else Strategy(), "adam" if "adam" in tokens else "sgd", model, clip,
                smoothing, masked, options, lora, base, dpo, pack, grpo, offload)


def planned(strategy: Strategy) -> bool:
    """Whether ``distlab plan`` prices ``strategy``: all but the plain ZeRO, ring and dispatch (the tuned ones)."""
    return strategy.zero_impl == "tuned" and strategy.cp_style != "ring_plain" and strategy.ep_dispatch == "all_to_all"


def default_strategies(world_size: int | None = None) -> list[Case]:
    """Every dp_sync x collective, each method with grad_accum 4, SyncBN, ZeRO 1-3 (tuned and plain; hybrid), activation
    checkpointing (with SyncBN too), bf16 autocast, a bf16 reduction, PowerSGD, and -- where ``world_size`` is
    even -- tensor parallel in both styles, pipelines with each schedule and context parallel in both styles, the
    mixture of experts with expert parallel (beside ZeRO too; both dispatches), interleaved and zero-bubble
    pipelines (with TP, CP x PP and EP x PP where it divides by 4); clipping over ZeRO-2's shards and TP+SP's
    transformer with label smoothing; compiled blocks under ZeRO-3 and checkpointing; ignored targets over DP with
    accumulation, the experts, TP's vocabulary shards, a pipeline and CP; LoRA, DPO, packing and GRPO; offload."""
    out = [Strategy("gather-scatter")]
    out += [Strategy(m, c) for m in ("allreduce", "bucketed", "ddp") for c in COLLECTIVES]
    out += [Strategy(m, grad_accum=4) for m in SYNC_METHODS]
    out += [Strategy(m, sync_bn="distlab") for m in ("allreduce", "bucketed", "ddp")]
    out += [Strategy(zero=z) for z in (1, 2, 3)]  # bucketed reduce-scatters (small buckets here); prefetching ZeRO-3
    out += [Strategy(zero=z, zero_impl="plain") for z in (1, 2, 3)]  # the partition alone
    if world_size and world_size % 2 == 0:  # hybrid sharding: shard groups of 2 (of 1 on 2 ranks: all replicated)
        out += [Strategy(zero=3, dp_shard=1)] + ([Strategy(zero=2, dp_shard=2)] if world_size % 4 == 0 else [])
    out += [Strategy("bucketed", activation_checkpointing=True),
            Strategy("bucketed", sync_bn="distlab", activation_checkpointing=True)]
    out += [Strategy("bucketed", precision="bf16"), Strategy(zero=2, reduce_dtype="bf16"),  # bounded by bf16 rounding
            Strategy("bucketed", grad_compression="powersgd:2")]  # approximate: its deviation is reported
    if world_size and world_size % 2 == 0:
        out += [Strategy("allreduce", tp=2), Strategy("allreduce", tp=2, tp_style="naive")]
        out += [Strategy("bucketed", pp=2, microbatches=3), Strategy("allreduce", pp=2, microbatches=4, pp_schedule="gpipe")]
    cases = [Case(s) for s in out] + [Case(Strategy(zero=2), clip=CLIP_NORM)]  # clipping over ZeRO's shards
    # offload: SGD's momentum in a file beside DP; ZeRO-3's shards and state there (each step beside the next forward)
    offloads = ((Strategy("bucketed"), "optimizer"), (Strategy(zero=3), "params"))
    cases += [Case(s, offload=o + w) for s, o in offloads for w in ("", ",overlap")]
    even = bool(world_size) and world_size % 2 == 0
    cases += [Case(Strategy("allreduce", tp=2), model="gpt", offload="optimizer")] if even else []
    # compiled transformer blocks, ZeRO-3's gathers between their pieces, recomputed by checkpointing
    cases += [Case(Strategy(zero=3, activation_checkpointing=True, compile=True), model="gpt")]
    # ignored targets over data parallel's ranks and accumulated micro-batches: each kept target weighs alike
    cases += [Case(Strategy("bucketed", grad_accum=2), model="gpt", masked=True),
              Case(Strategy("bucketed"), model="gpt-moe", masked=True)]
    if world_size and world_size % 2 == 0:
        # clipping over TP's replicated LayerNorms, label smoothing across the split vocabulary
        cases += [Case(Strategy("allreduce", tp=2, sequence_parallel=True), model="gpt", clip=CLIP_NORM,
                       smoothing=SMOOTHING)]
        cases += [Case(Strategy("bucketed", cp=2, cp_style=style), model="gpt") for style in ("ring", "ulysses",
                                                                                                "ring_plain")]
        cases += [Case(Strategy(zero=3, cp=2, dp_shard=2), model="gpt")] if world_size % 4 == 0 else []
        # ignored targets: a mean over the global batch's kept targets, across the vocabulary shards (with
        # smoothing), a pipeline's last stage, context parallel's sequence chunks
        cases += [Case(Strategy("allreduce", tp=2), model="gpt", smoothing=SMOOTHING, masked=True),
                  Case(Strategy("bucketed", pp=2, microbatches=4), model="gpt", masked=True),
                  Case(Strategy("bucketed", cp=2), model="gpt", masked=True)]
        # the Llama family (rotary positions, grouped-query attention, SwiGLU): data parallel, ZeRO-3 recomputing,
        # TP+SP splitting query heads and key/value groups, the ring and all-to-all over grouped heads with
        # each rank's rotary positions offset, a pipeline
        cases += [Case(Strategy("bucketed"), model="llama"),
                  # ZeRO-3 recomputing; and over 2 accumulated micro-batches, the LM head gathering the embedding
                  # it shares (held through backward: the peak falls in a block's recomputation), one block of two
                  # recomputed (selective checkpointing per block)
                  Case(Strategy(zero=3, activation_checkpointing=True), model="llama"),
                  Case(Strategy(zero=3, grad_accum=2, activation_checkpointing=True, ac_every=2), model="llama",
                       options=(("tie_embeddings", 1),)),
                  # ... under a sliding window of 4 over sequences of 8 (each rank's heads, the same band)
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True), model="llama",
                       options=(("sliding_window", 4),)),
                  # the ring again, and the all-to-all, each rank's positions through a scaled rotary table
                  # (Llama 3.1's frequency bands; yarn's too, with its attention factor on the angles)
                  Case(Strategy("bucketed", cp=2, activation_checkpointing=True), model="llama",
                       options=(("rope_scaling", "llama3,factor=8,original_max_position_embeddings=16"),)),
                  Case(Strategy("bucketed", cp=2, cp_style="ulysses"), model="llama",  # the window as a mask
                       options=(("rope_scaling", "yarn,factor=4,original_max_position_embeddings=4"),
                                ("sliding_window", 4))),
                  # its LM head tied to the token embedding across the two stages: their gradients summed
                  Case(Strategy("bucketed", pp=2, microbatches=2), model="llama", options=(("tie_embeddings", 1),)),
                  Case(Strategy("bucketed", ep=2), model="llama-moe"),  # SwiGLU experts shared out
                  # one key/value head for 2 tensor-parallel ranks: kept whole on each, its gradient summed; the
                  # LM head tied to the token embedding, split by the same vocabulary rows; the blocks recomputed
                  # (their forward collectives again, but the last row-parallel layer's)
                  # (with Qwen3's heads: wider than n_embd / n_head, each query and key head normed by one weight
                  # whose gradient every rank's heads add to)
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True, activation_checkpointing=True),
                       model="llama", options=(("kv_heads", 1), ("tie_embeddings", 1), ("head_dim", 8),
                                               ("qk_norm", 1)))]
        # Gemma 3: the embedding's scale and the norms after each branch under sequence parallel, its q/k
        # norms' gradients summed over tensor parallel; its own score scale over the ring (its local layers'
        # window of 4 over sequences of 8: the block pairs before it skipped, the band masked; a global layer
        # every 2nd)
        gemma = (("kv_heads", 2), ("head_dim", 4), ("ffn_hidden", 32), ("sliding_window", 4), ("global_every", 2))
        cases += [Case(Strategy("allreduce", tp=2, sequence_parallel=True), model="gemma3", options=gemma),
                  Case(Strategy("bucketed", cp=2), model="gemma3", options=gemma)]
        # low-rank adapters, the base frozen (no gradient, sync or update): data parallel all-reducing the adapters'
        # gradients only; ZeRO-3 sharding and gathering the frozen base too (released after each layer's backward);
        # TP+SP splitting B with a column layer's rows and A with a row layer's columns; a pipeline
        lora = "r=2,alpha=4,targets=q,v,o,down"
        cases += [Case(Strategy("bucketed"), model="llama", lora=lora),
                  Case(Strategy(zero=3), model="llama", lora=lora),
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True), model="llama", lora=lora),
                  Case(Strategy("bucketed", pp=2, microbatches=2), model="llama", lora=lora)]
        # DPO: ZeRO-3 with adapters (the reference: adapters off), CP (log-probabilities summed over the ring), TP+SP;
        # GRPO's rollouts from ZeRO-3's gathered adapters, the reference the base, adapters off
        cases += [Case(Strategy(zero=3), model="llama", lora=lora, dpo=True),
                  Case(Strategy(zero=3), model="llama", lora=lora, grpo=True),
                  Case(Strategy("bucketed", cp=2), model="llama", dpo=True),
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True), model="llama", dpo=True)]
        # packed records: each pipeline stage binding its micro-batch's structure (recomputed too), the ring skipping
        # block pairs sharing no record, the all-to-all masking the gathered sequence
        cases += [Case(Strategy("bucketed", pp=2, microbatches=2, activation_checkpointing=True), model="llama", pack=True),
                  Case(Strategy("bucketed", cp=2), model="llama", pack=True),
                  Case(Strategy("bucketed", cp=2, cp_style="ulysses"), model="llama", pack=True)]
        cases += [Case(Strategy("bucketed", ep=2, ep_dispatch=d), model="gpt-moe") for d in ("all_to_all", "all_gather")]
        # the dense gradients compressed (fp16 on the wire), the experts' reduced over their own group
        cases += [Case(Strategy("bucketed", ep=2, grad_compression="fp16"), model="gpt-moe"),
                  # ZeRO-3 sharding the dense part, the expert shards held whole (their own group reduces them); the
                  # blocks recomputed (their exchanges again)
                  Case(Strategy(zero=3, ep=2, activation_checkpointing=True), model="gpt-moe"),
                  Case(Strategy("bucketed", pp=2, microbatches=4, pp_virtual=2), model="gpt"),
                  Case(Strategy("bucketed", pp=2, microbatches=4, pp_schedule="zb"), model="gpt")]
    if world_size and world_size % 4 == 0:
        cases += [Case(Strategy("bucketed", tp=2, pp=2, microbatches=2)),
                  Case(Strategy("allreduce", tp=2, cp=2), model="gpt"),
                  Case(Strategy("bucketed", cp=2, pp=2, microbatches=2), model="gpt"),
                  Case(Strategy("bucketed", ep=2, pp=2, microbatches=2), model="gpt-moe"),
                  # ZeRO-2 over 4 ranks beside experts replicated over pairs (their gradients summed over the pair)
                  Case(Strategy(zero=2, ep=2), model="gpt-moe"),
                  # each tensor-parallel rank routing its own positions to the experts of its expert-parallel
                  # group, the experts' gradients summed over the tensor-parallel ranks too
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True, ep=2), model="gpt-moe"),
                  # zero bubble's weight pass from each weight's own product: no reduce-scatter or combine again
                  Case(Strategy("allreduce", tp=2, sequence_parallel=True, pp=2, microbatches=4, pp_schedule="zb"),
                       model="gpt"),
                  Case(Strategy("bucketed", ep=2, pp=2, microbatches=4, pp_schedule="zb"), model="gpt-moe")]
    return cases


USER_DATASET = "synthetic:3x8x8:4:480"  # for a user's model unless --dataset says otherwise
PACKED_BLOCK = 16  # +pack: windows of 16 tokens, two or three records each


def config_for(case: Case, world_size: int, steps: int, global_batch: int | None = None,
               seed: int = 0, model: str | None = None, model_args: tuple[str, ...] = (),
               dataset: str | None = None) -> TrainConfig:
    """A small, fast training run: an MLP (or a BN CNN for SyncBN) on synthetic data, SGD+momentum;
    or ``model`` (your own, ``file.py:build``, with ``model_args``) on ``dataset``."""
    strategy = case.strategy.check(world_size)
    if strategy.bucket_mb == Strategy.bucket_mb:
        strategy = strategy.replace(bucket_mb=SMALL_BUCKET_MB)
    batch = global_batch or 12 * strategy.dp_size(world_size)
    bn = strategy.sync_bn != "off"
    mine, data = model, dataset
    model, dataset = ("small-cnn-bn", "synthetic:3x8x8:4:480") if bn else ("mlp", "synthetic:1x8x8:4:480")
    if case.model in case_models():
        model, dataset = case.model, f"synthetic-text:4000:masked={MASKED}" if case.masked else "synthetic-text:4000"
        dataset = "synthetic-pairs:40" if case.dpo else packing_records() if case.pack else GRPO_DATA if case.grpo \
            else dataset
    if mine:
        model, dataset = mine, data or USER_DATASET
    small = {**verify_sizes(), **dict(case.options)}
    sizes = {} if mine else {k: v for k, v in small.items() if k in spec(model).options.names()}
    return TrainConfig.from_flags(model=model, model_args=tuple(model_args) if mine else (), **sizes,
                       block_size=PACKED_BLOCK if case.pack else 8, pack=case.pack,
                       dataset=dataset, epochs=max(1, steps), max_steps=steps,
                       global_batch_size=batch, lr=0.005 if case.optimizer == "adam" else 0.05,
                       lr_schedule="constant", momentum=0.9, optimizer=case.optimizer, seed=seed, log_every=1,
                       clip_grad_norm=case.clip, label_smoothing=case.smoothing, lora=case.lora,
                       base_dtype=case.base_dtype, **(GRPO if case.grpo else {}), offload=case.offload.split(",")[0],
                       offload_dir=scratch("offload") if case.offload != "none" else None,
                       offload_overlap=case.offload.endswith(",overlap"),
                       progress=False, verbose=False, eval_every_epoch=False, eval_batches=1,  # (compared: the
                       strategy=strategy).validate(world_size)  # parameters and losses; the test set is not read)


def tolerance(cfg: TrainConfig, world_size: int = 1, num_parameters: int = 0) -> float | None:
    """The float32 bound of the module docstring (:func:`sgd_tolerance`), widened for reduced
    precision and, with clipping, for the global norm of the ``num_parameters`` gradient entries; None
    where there is no rounding bound (PowerSGD, Adam)."""
    s = cfg.strategy
    if s.grad_compression.startswith("powersgd") or cfg.optimizer != "sgd":
        return None
    if cfg.reward is not None:
        return grpo_tolerance(cfg, world_size)
    if is_preference(cfg.dataset):  # a pair's gradient: beta x its 2 x block_size tokens' (each entry at most 1)
        width = 2 * cfg.block_size
        return sgd_tolerance(cfg.max_steps, cfg.lr * (cfg.dpo_beta or DEFAULT_BETA) * width,
                             cfg.global_batch_size * width, cfg.momentum, s.precision, s.wire_dtype or "fp32",
                             s.dp_size(world_size))
    return sgd_tolerance(cfg.max_steps, cfg.lr, cfg.global_batch_size, cfg.momentum, s.precision,
                         s.wire_dtype or "fp32", s.dp_size(world_size),
                         num_parameters if cfg.clip_grad_norm else 0, cfg.clip_grad_norm or 1.0)


def reference_run(cfg: TrainConfig, norms: list[float] | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """Single-process SGD on the sequential global batches (no distlab trainer involved); with
    ``clip_grad_norm``, ``torch.nn.utils.clip_grad_norm_`` before each step (its norms appended to ``norms``)."""
    from distlab.data.sampler import sequential_batches
    from distlab.models import build_model, task_loss
    from distlab.parallel import Precision

    data = cfg.load("train")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options())
    if cfg.lora is not None:  # the base frozen, adapters at their starting values (no random state drawn)
        from distlab.models import lora
        lora.apply(model, cfg.lora)
        lora.fill(model, lora.initial_state(model, cfg.seed))
        from distlab.train.fine_tuning import narrow_base
        narrow_base(model, cfg.base_dtype)
        if cfg.base_dtype == "nf4":  # the adapted layers' weights quantized as the run quantizes them
            from distlab.train.quantized_base import quantize
            quantize(model)
    score, rollout = task_loss, grpo_training(cfg, model, data)  # GRPO: each step's rollout and its loss
    if is_preference(cfg.dataset):  # DPO: the starting model's log-probabilities, then each step the pairs' mean
        data.reference = reference_logps(model, data)
        score = dpo_mean(cfg.dpo_beta or DEFAULT_BETA)
    opt = (torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay) if cfg.optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay))
    losses, step, epoch = [], 0, 0
    while step < cfg.max_steps:
        batches = sequential_batches(len(data), batch_size=cfg.global_batch_size, shuffle=True, seed=cfg.seed,
                                     epoch=epoch)
        for idx in (idx for idx in batches for _ in range(cfg.ppo_epochs)):  # (GRPO: each rollout K steps)
            if step == cfg.max_steps:
                break
            x, y, fields = split(data.batch(torch.tensor(idx)))
            if rollout is not None:
                x, y, score = rollout(y, step)
            bind(model, fields)  # a packed batch's structure: each record attends to itself only
            opt.zero_grad()
            with Precision(cfg.strategy.precision).autocast():
                loss = score(model(x), y, label_smoothing=cfg.label_smoothing)
            loss.backward()
            if cfg.clip_grad_norm:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
                if norms is not None:
                    norms.append(norm.item())
            opt.step()
            losses.append(loss.item())
            step += 1
        epoch += 1
    from distlab.parallel.placement import value_copy
    return [value_copy(p) for p in model.parameters()], losses


def _distributed_runs(rank: int, world: int, configs: list[TrainConfig]):
    from distlab import runtime
    from distlab.parallel.compile import compiled_graphs
    from distlab.train import Trainer

    out = []
    for cfg in configs:
        if cfg.strategy.compile:  # each case compiles its own model: no guards and caches of the cases before
            import torch._dynamo  # (six compiled cases in one process crashed torch 2.13's dynamo)
            torch._dynamo.reset()
        graphs = compiled_graphs()
        trainer = Trainer(cfg, runtime.from_process_group())
        trainer.fit()
        out.append((trainer.full_parameters(), [r["loss"] for r in trainer.history],
                    [r["grad_norm"] for r in trainer.history if "grad_norm" in r], compiled_graphs() - graphs))
    return out if rank == 0 else None


def verify(strategies: list[Case], world_size: int, steps: int = 10, global_batch: int | None = None,
           timeout: float = 600.0, **model) -> list[dict]:
    """Run every strategy on ``world_size`` gloo processes (one process group, one after another)
    and single-process; return one record per strategy (the ``--json`` contract). ``model``:
    :func:`config_for`'s ``model``, ``model_args`` and ``dataset`` (your own model)."""
    from distlab.launch.spawn import RankFailure, run_ranks

    configs = [config_for(s, world_size, steps, global_batch, **model) for s in strategies]
    try:
        results = run_ranks(_distributed_runs, world_size, configs, timeout=timeout)[0]
        scratch.clear()  # (the offload files)
    except RankFailure as exc:  # (a collective of the user's own that sends nothing counted, say): one line
        if exc.config_error is None:
            raise
        raise ConfigError(exc.config_error) from None
    from distlab.runtime.device import machine_facts
    records, facts = [], machine_facts()
    references: dict[str, tuple] = {}  # layouts of one model, data and optimizer share their one process's run
    for strategy, cfg, (params, losses, norms, graphs) in zip(strategies, configs, results):
        key = reference_key(cfg)
        if key not in references:
            ref_norms: list[float] = []
            references[key] = (*reference_run(cfg, ref_norms), ref_norms)
        ref_params, ref_losses, ref_norms = references[key]
        diffs = compare(params, losses, ref_params, ref_losses)
        tol = tolerance(cfg, world_size, sum(p.numel() for p in ref_params))
        if cfg.clip_grad_norm:  # the norms themselves (the first from equal weights), and how many steps clipped
            rel = [abs(a - b) / b for a, b in zip(norms, ref_norms)]
            diffs.update(first_rel_grad_norm_diff=rel[0], max_rel_grad_norm_diff=max(rel),
                         clipped_steps=sum(n > cfg.clip_grad_norm for n in ref_norms),
                         num_parameters=sum(p.numel() for p in ref_params))
        if cfg.strategy.compile:  # rank 0's graphs compiled by this run (none: the blocks ran eagerly)
            diffs["compiled_graphs"] = graphs
        passed = None if tol is None else diffs["max_abs_param_diff"] <= tol and diffs["max_loss_diff"] <= tol
        records.append({"strategy": strategy.name, "flags": strategy.flags(), "world_size": world_size,
                        "steps": steps, "model": cfg.model, "global_batch_size": cfg.global_batch_size, **diffs,
                        "tolerance": tol, "approximate": tol is None or not cfg.strategy.exact, "passed": passed,
                        **facts})
    return records
