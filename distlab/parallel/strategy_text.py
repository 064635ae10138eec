"""The text form of a :class:`~distlab.parallel.strategy.Strategy` (``str`` and ``Strategy.parse``);
the class is passed in (``cls``, ``self``): this module is imported by it.

``METHOD[:COLLECTIVE]`` then ``+``-separated modifiers, e.g. ``bucketed:ring+accum=4+syncbn``, ``zero=3``, ``allreduce+tp=2+naive``::

    METHOD          dp_sync: gather-scatter, allreduce, bucketed, ddp (default bucketed; with
                    ZeRO, ZeRO's own reduce-scatter, written without a method)
    :COLLECTIVE     collective: native, ring, butterfly, direct, auto (default native; with
                    zero, auto: distlab's ring for reduce-scatter and all-gather on gloo)
    accum=K         grad_accum: micro-batches per optimizer step
    bucket=MB       bucket_mb: bucket size of bucketed and ddp
    syncbn[=KIND]   sync_bn: distlab (the default of the bare word) or torch, or FILE.py:NAME (distlab's
                    with the user's own input gradient)
    find_unused     find_unused: parameters without a gradient count as zero
    tp=N, naive     tp and tp_style (megatron unless naive)
    sp              sequence_parallel: a transformer's LayerNorm/residual regions split along the
                    sequence over the tensor-parallel group (needs tp)
    cp=N, ulysses   cp and cp_style: context parallel, every sequence split over N ranks for the
                    whole model, attention by ring (the default) or by all-to-all over heads
                    (cp_style=ring_plain: the plain ring, the tuned one's oracle)
    ep=N            ep: expert parallel, a mixture of experts' experts sharded over N of the
                    data-parallel ranks (tokens dispatched to them by all-to-all;
                    ep_dispatch=all_gather: the plain dispatch, the all-to-all's oracle)
    zero=S          zero: ZeRO stage 1-3
    dp_shard=N      dp_shard: with zero, shard over groups of N replicas and replicate across the groups
                    (hybrid sharding, HSDP: gathers stay inside a group, one reduced shard crosses them)
    zero_impl=plain zero_impl: the plain ZeRO (the partition alone) in place of the tuned one, or
                    FILE.py:NAME (the user's own PlainZero subclass)
    ckpt            activation_checkpointing: recompute each block's activations in backward
    ac_every=K      ac_every: with ckpt, recompute one block in every K (selective, per block)
    ac_policy=ops   ac_policy: with ckpt, keep the outputs of attention and every other matrix
                    multiplication inside a checkpointed block (selective, per op); block: its input alone
    compile         compile: each block (transformer block, ResNet block, ...) through ``torch.compile``
    compile_backend=B
                    compile_backend: with compile, torch.compile's backend -- inductor (the default: fused
                    kernels), aot_eager (the same graphs, forward and backward, run by eager kernels) or eager
    bf16, fp16      precision: forward and backward under autocast in that dtype (fp32 master
                    weights and optimizer state; fp16 with dynamic loss scaling, GPU only)
    reduce=DTYPE    reduce_dtype: the dtype gradients are communicated in (fp32, bf16, fp16)
    compress=C      grad_compression: none, fp16, bf16 or powersgd:R (rank-R PowerSGD with error
                    feedback and warm start; data parallel's allreduce, bucketed and ddp)
    pp=P            pp: pipeline stages (the model's layers cut into P parts on P ranks)
    mb=M            microbatches: a pipeline step's micro-batches (default P)
    gpipe, 1f1b, zb pp_schedule: the order of a stage's forwards and backwards (default 1f1b; zb:
                    zero bubble, backward split into input and weight gradients)
    vpp=V           pp_virtual: V model chunks per pipeline rank (interleaved 1F1B, or zero bubble)
    balance=A:B:..  pp_balance: layers per stage (default: cut where the parameters balance)
    NAME            components: a model-sharding component registered under NAME
                    (:mod:`distlab.parallel.components`), applied after the built-in ones
    NAME=N          dims: the size of the mesh dimension such a component owns (its kind's ``dim``)

Any field may also be written ``FIELD=VALUE`` (``dp_sync=ddp+collective=ring``), so plan's
``KEY=VALUE+KEY=VALUE`` spellings read the same. :meth:`Strategy.to_dict` is the JSON object of
``summary.json`` (:meth:`Strategy.from_dict` reads it back, old files included).
"""

from __future__ import annotations

from dataclasses import fields

from distlab.errors import ConfigError, did_you_mean
from distlab.parallel.components import names as component_names
from distlab.parallel.data_parallel import SYNC_METHODS

_KEYS = {"reduce": "reduce_dtype", "compress": "grad_compression", "accum": "grad_accum", "bucket": "bucket_mb", "style": "tp_style", "method": "dp_sync", "syncbn": "sync_bn",
         "mb": "microbatches", "schedule": "pp_schedule", "balance": "pp_balance", "vpp": "pp_virtual",
         "cp_style": "cp_style"}
_WORDS = {"naive": ("tp_style", "naive"), "megatron": ("tp_style", "megatron"), "syncbn": ("sync_bn", "distlab"),
          "find_unused": ("find_unused", True), "find-unused": ("find_unused", True), "sp": ("sequence_parallel", True),
          "gpipe": ("pp_schedule", "gpipe"), "1f1b": ("pp_schedule", "1f1b"), "zb": ("pp_schedule", "zb"),
          "ckpt": ("activation_checkpointing", True), "compile": ("compile", True), "bf16": ("precision", "bf16"), "fp16": ("precision", "fp16"),
          "fp32": ("precision", "fp32"), "ulysses": ("cp_style", "ulysses")}


def strategy_text(self) -> str:
    """The text form of ``self`` (what ``str(strategy)`` prints)."""
    parts = []
    default = self.collective == self.default_collective
    if ":" in self.dp_sync:  # the user's own FILE.py:NAME: by its field (a method's ':' is the collective's)
        parts.append(f"dp_sync={self.dp_sync}" + ("" if default else f"+collective={self.collective}"))
    elif not self.zero or not default or self.dp_sync != self.zero_dp_sync:
        parts.append(self.dp_sync + ("" if default else f":{self.collective}"))
    if self.grad_accum != 1:
        parts.append(f"accum={self.grad_accum}")
    if self.bucket_mb != type(self).bucket_mb:
        parts.append(f"bucket={self.bucket_mb:g}")
    if self.sync_bn != "off":
        parts.append("syncbn" if self.sync_bn == "distlab" else f"syncbn={self.sync_bn}")
    if self.find_unused:
        parts.append("find_unused")
    if self.tp != 1:
        parts.append(f"tp={self.tp}" + ("+naive" if self.tp_style == "naive" else "")
                     + ("+sp" if self.sequence_parallel else ""))
    if self.cp != 1:
        parts.append(f"cp={self.cp}" + {"ring": "", "ulysses": "+ulysses"}.get(self.cp_style, f"+cp_style={self.cp_style}"))
    if self.ep != 1:
        parts.append(f"ep={self.ep}" + (f"+ep_dispatch={self.ep_dispatch}" if self.ep_dispatch != "all_to_all" else ""))
    if self.zero:
        parts.append(f"zero={self.zero}" + (f"+dp_shard={self.dp_shard}" if self.dp_shard else "")
                     + (f"+zero_impl={self.zero_impl}" if self.zero_impl != "tuned" else ""))
    if self.pp != 1:
        parts += [f"pp={self.pp}", f"mb={self.microbatches}", self.pp_schedule]
        parts += [f"vpp={self.pp_virtual}"] if self.pp_virtual != 1 else []
        parts += [f"balance={':'.join(map(str, self.pp_balance))}"] if self.pp_balance else []
    if self.activation_checkpointing:
        parts.append("ckpt" + (f"+ac_every={self.ac_every}" if self.ac_every != 1 else "")
                     + (f"+ac_policy={self.ac_policy}" if self.ac_policy != "block" else ""))
    if self.compile:
        backend = self.compile_backend
        parts.append("compile" + (f"+compile_backend={backend}" if backend != "inductor" else ""))
    if self.precision != "fp32":
        parts.append(self.precision)
    if self.reduce_dtype is not None:
        parts.append(f"reduce={self.reduce_dtype}")
    if self.grad_compression != "none":
        parts.append(f"compress={self.grad_compression}")
    parts += [f"{name}={size}" for name, size in self.dims] + list(self.components)
    return "+".join(parts)


def parse(cls: type, text: str, **defaults):
    """Read the text form (see the module docstring); ``defaults`` fill fields the text leaves out."""
    values: dict = dict(defaults)
    known = {f.name for f in fields(cls)}
    tokens = [t.strip() for t in text.strip().split("+")]
    if not text.strip() or any(not t for t in tokens):
        raise ConfigError(f"cannot read strategy {text!r}: write METHOD[:COLLECTIVE][+MODIFIER...], "
                          f"e.g. bucketed:ring+accum=4 or zero=3 or allreduce+tp=2+naive")
    for i, token in enumerate(tokens):
        key, eq, value = token.partition("=")
        key = key.replace("-", "_") if key.replace("-", "_") in known else key
        if eq and i > 0 and key in component_names():  # a registered kind's own dimension
            try:
                values["dims"] = (*values.get("dims", ()), (key, int(value)))
            except ValueError:
                raise ConfigError(f"strategy {text!r}: {token!r}: the size of {key}'s dimension is a whole "
                                  f"number, not {value!r}") from None
        elif eq:
            name = _KEYS.get(key, key)
            if name not in known:
                raise ConfigError(f"strategy {text!r}: unknown modifier {token!r} (known: accum=K, bucket=MB, "
                                  f"syncbn[=torch], find_unused, tp=N, naive, sp, cp=N, ulysses, ep=N, zero=S, pp=P, mb=M, gpipe, 1f1b, zb, vpp=V, ckpt, compile, bf16, fp16, "
                                  f"reduce=DTYPE, compress=C, or FIELD=VALUE with FIELD "
                                  f"one of {', '.join(known)})")
            values[name] = _convert(cls, name, value, text)
        elif token in _WORDS:
            name, value = _WORDS[token]
            values[name] = value
        elif i > 0 and token in component_names():
            values["components"] = (*values.get("components", ()), token)
        elif i == 0:
            method, _, collective = token.partition(":")
            if method:
                values["dp_sync"] = method
            if collective:
                values["collective"] = collective
        else:
            raise ConfigError(f"strategy {text!r}: {token!r} is not a modifier"
                              f"{did_you_mean(token, (*_WORDS, *component_names()))}; the "
                              f"method ({', '.join(SYNC_METHODS)}) comes first")
    return cls(**values).check()

def parse_list(cls: type, text: str, world: int | None = None, global_batch: int | None = None) -> list:
    """Comma-separated text forms, each checked against ``world`` (and the batch split) if given."""
    out = [parse(cls, part) for part in text.split(",") if part.strip()]
    if not out:
        raise ConfigError(f"no strategy in {text!r}: give at least one, e.g. bucketed,zero=1")
    for s in out if world else ():
        s.check(world)
        if global_batch:
            s.check_batch(global_batch, world)
    return out


def modifier_words() -> tuple[str, ...]:
    """The modifiers written as a bare word: distlab's own (``+naive``, ``+zb``) and every registered
    component's name (``+NAME``)."""
    return (*_WORDS, *component_names())


def _convert(cls: type, name: str, value: str, text: str):
    if name == "pp_balance":
        try:
            return tuple(int(v) for v in value.replace(",", ":").split(":"))
        except ValueError:
            raise ConfigError(f"strategy {text!r}: balance={value!r} is not layer counts like 2:3") from None
    if name == "reduce_dtype":
        return value
    if name == "components":
        return tuple(n for n in value.split(":") if n)
    kind = type(getattr(cls(), name))
    try:
        if kind is bool:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(value)
            return value.lower() in ("1", "true", "yes")
        return kind(value)
    except ValueError:
        raise ConfigError(f"strategy {text!r}: {name}={value!r} is not a {kind.__name__}") from None
