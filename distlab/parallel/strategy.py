"""One description of a parallel layout: :class:`Strategy`, its text form, and its checks.

Every part of distlab that names a layout -- ``distlab train``'s flags, ``verify --strategy``,
``bench dp --methods``, ``bench parallel --strategies``, ``plan --strategies`` and the
``"strategy"`` object of ``summary.json`` -- goes through this one class. It is frozen, compares
by value, and is checked once against a world size (:meth:`Strategy.check`), with messages that
name the fields and the numbers.

The text form (``str`` and :meth:`Strategy.parse`: ``bucketed:ring+accum=4+syncbn``, ``zero=3``,
``allreduce+tp=2+naive``) is :mod:`distlab.parallel.strategy_text`. :meth:`Strategy.to_dict` is the
JSON object of ``summary.json`` (:meth:`Strategy.from_dict` reads it back, old files included).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields
from typing import ClassVar

from distlab import comm
from distlab.errors import ConfigError, did_you_mean
from distlab.parallel.compile import BACKENDS as COMPILE_BACKENDS, check as check_compile
from distlab.parallel.components import load as load_kind, names as component_names, registered
from distlab.parallel.expert_parallel import DISPATCHES as EP_DISPATCHES
from distlab.parallel.compression import parse_compression
from distlab.parallel.context_parallel import STYLES as CP_STYLES
from distlab.parallel.data_parallel import sync_method
from distlab.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from distlab.parallel.strategy_text import parse, parse_list, strategy_text
from distlab.parallel.sync_bn import MODES as SYNC_BN, user_input_gradient
from distlab.parallel.tensor_parallel import STYLES as TP_STYLES
from distlab.parallel.zero import STAGES as ZERO_STAGES
from distlab.parallel.zero.hsdp import check_shard_groups
from distlab.parallel.zero.plain import PlainZero, implementation
ZERO_IMPLS = ("tuned", "plain")  # or the user's own PlainZero subclass, FILE.py:NAME
PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_DP_SYNC = "bucketed"  # the fastest exact method on CPU/gloo (docs/RESULTS.md, data parallel)
ZERO_DP_SYNC = "allreduce"    # what a ZeRO strategy records: its gradients are reduced after backward

@dataclass(frozen=True)
class Strategy:
    """How a model is spread over ranks. ``dp_sync=None`` means the default for the layout."""

    zero_dp_sync: ClassVar[str] = ZERO_DP_SYNC  # what a ZeRO strategy records as its method

    dp_sync: str | None = None
    collective: str | None = None  # None: the default for the layout (default_collective)
    bucket_mb: float = 25.0
    grad_accum: int = 1
    sync_bn: str = "off"
    find_unused: bool = False
    tp: int = 1
    tp_style: str = "megatron"
    sequence_parallel: bool = False
    cp: int = 1              # context parallel: each sequence split over cp ranks (distlab.parallel.context_parallel)
    cp_style: str = "ring"   # ring (key/value blocks around the ring) or ulysses (all-to-all over heads)
    ep: int = 1              # expert parallel: experts sharded over ep data-parallel ranks (distlab.parallel.expert_parallel)
    ep_dispatch: str = "all_to_all"  # or all_gather: the plain dispatch (distlab.parallel.expert_dispatch_plain)
    zero: int = 0
    dp_shard: int = 0        # with zero: shard over groups of this many replicas, replicated across them (0: all)
    zero_impl: str = "tuned"  # tuned (parallel.zero.Zero), plain (the partition alone: zero.plain) or FILE.py:NAME
    pp: int = 1
    microbatches: int | None = None  # None: pp (1 without a pipeline)
    pp_schedule: str = "1f1b"
    pp_balance: tuple[int, ...] | None = None  # layers per stage; None: balanced by parameters
    pp_virtual: int = 1      # model chunks per pipeline rank (interleaved schedules)
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    ac_every: int = 1        # with activation_checkpointing: one block in every ac_every (selective, per block)
    ac_policy: str = "block"  # what a checkpointed block keeps: its input (block) or its chosen ops' outputs too (ops)
    compile: bool = False    # each block through torch.compile (distlab.parallel.compile)
    compile_backend: str = "inductor"  # torch.compile's backend (distlab.parallel.compile.BACKENDS)
    precision: str = "fp32"  # autocast dtype of forward/backward (parameters and optimizer state stay fp32)
    reduce_dtype: str | None = None  # dtype of gradient communication; None: the gradients' own (fp32)
    grad_compression: str = "none"  # none, fp16, bf16, powersgd:R
    components: tuple[str, ...] = ()  # registered model-sharding components by name (distlab.parallel.components)
    dims: tuple[tuple[str, int], ...] = ()  # registered kinds' own mesh dimensions, (name, size), outermost first

    def __post_init__(self):
        if self.dp_sync is None:
            object.__setattr__(self, "dp_sync", ZERO_DP_SYNC if self.zero else DEFAULT_DP_SYNC)
        if self.collective is None:
            object.__setattr__(self, "collective", self.default_collective)
        if self.tp == 1:  # no tensor parallel: the style means nothing, keep equal strategies equal
            object.__setattr__(self, "tp_style", "megatron")
        for size, name, default in (("cp", "cp_style", "ring"), ("ep", "ep_dispatch", "all_to_all")):
            if getattr(self, size) == 1:  # no context or expert parallel: the style means nothing
                object.__setattr__(self, name, default)
        if self.microbatches is None:
            object.__setattr__(self, "microbatches", self.pp if isinstance(self.pp, int) and self.pp > 1 else 1)
        if self.pp == 1:  # no pipeline: no schedule
            object.__setattr__(self, "pp_schedule", "1f1b")
            if isinstance(self.pp_virtual, int) and self.pp_virtual >= 1:
                object.__setattr__(self, "pp_virtual", 1)
        if self.pp_balance is not None:  # JSON gives a list; the dataclass is frozen and hashable
            object.__setattr__(self, "pp_balance", tuple(int(b) for b in self.pp_balance))
        if not isinstance(self.components, tuple):  # None from a flag not given, a list from JSON, "a:b" from text
            names = self.components.split(":") if isinstance(self.components, str) else self.components or ()
            object.__setattr__(self, "components", tuple(n for n in names if n))
        dims = self.dims.items() if isinstance(self.dims, dict) else self.dims or ()  # a dict from JSON
        if isinstance(dims, str):  # a flag: NAME=N,NAME=N
            dims = [part.partition("=")[::2] for part in dims.split(",") if part.strip()]
        try:
            object.__setattr__(self, "dims", tuple((str(n), int(k)) for n, k in dims if int(k) != 1))
        except (TypeError, ValueError):
            raise ConfigError(f"`dims` {self.dims!r}: write NAME=N for each mesh dimension of your own "
                              f"(e.g. mine=2), N a whole number") from None

    # ------------------------------------------------------------------ checks

    def check(self, world_size: int | None = None) -> "Strategy":
        """Every field, every combination, and (with ``world_size``) the mesh: raise ConfigError naming them."""
        sync_method(self.dp_sync)  # (the user's own FILE.py:NAME loaded: a bad one refused here)
        if ":" in self.collective:  # the user's own FILE.py:NAME, loaded: a bad one refused here
            comm.check_algorithm(self.collective)
        elif comm.ALIASES.get(self.collective, self.collective) not in (*comm.BUILT_IN, "auto"):
            raise ConfigError(f"unknown `collective` {self.collective!r}; choose one of: {', '.join(comm.BUILT_IN)}, "
                              f"auto, or your own all-reduce as path/to/file.py:NAME or package.module:NAME")
        _choice("sync_bn", self.sync_bn, SYNC_BN) if ":" not in self.sync_bn else user_input_gradient(self.sync_bn)
        _choice("tp_style", self.tp_style, TP_STYLES)
        _choice("cp_style", self.cp_style, CP_STYLES)
        _choice("ep_dispatch", self.ep_dispatch, EP_DISPATCHES)
        _choice("zero", self.zero, ZERO_STAGES)
        _choice("zero_impl", self.zero_impl, ZERO_IMPLS) if ":" not in self.zero_impl else implementation(self.zero_impl, PlainZero)
        self._check_plain_zero()
        _choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("compile_backend", self.compile_backend, COMPILE_BACKENDS)
        check_compile(self)
        if self.reduce_dtype is not None:
            _choice("reduce_dtype", self.reduce_dtype, PRECISIONS)
        self._check_compression()
        self._check_components()
        if not self.bucket_mb > 0:
            raise ConfigError(f"`bucket_mb` must be positive, not {self.bucket_mb}")
        if self.grad_accum < 1:
            raise ConfigError(f"`grad_accum` must be at least 1, not {self.grad_accum}")
        if self.ac_every < 1:
            raise ConfigError(f"`ac_every` must be at least 1, not {self.ac_every}")
        _choice("ac_policy", self.ac_policy, ("block", "ops"))
        if self.ac_policy != "block" and not self.activation_checkpointing:
            raise ConfigError(f"`ac_policy` {self.ac_policy} says what activation checkpointing keeps: turn on "
                              f"`activation_checkpointing` too, or drop `ac_policy`")
        if self.ac_every > 1 and not self.activation_checkpointing:
            raise ConfigError(f"`ac_every` {self.ac_every} says which blocks activation checkpointing recomputes: "
                              f"turn on `activation_checkpointing` too, or drop `ac_every`")
        for name in ("tp", "pp", "cp", "ep", "microbatches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be at least 1, not {getattr(self, name)}")
        if self.cp > 1 and self.sequence_parallel:
            raise ConfigError(f"`sequence_parallel` and `cp` {self.cp} both split the sequence: context parallel "
                              f"already splits it for the whole model; drop `sequence_parallel`")
        if self.pp > 1:
            self._check_pipeline()
        elif self.pp_balance is not None:
            raise ConfigError(f"`pp_balance` {','.join(map(str, self.pp_balance))} gives layers per pipeline stage, and "
                              f"there is no pipeline (`pp` 1): set `pp` or drop `pp_balance`")
        elif self.microbatches != 1:
            raise ConfigError(f"`microbatches` {self.microbatches} splits a pipeline's batch, and there is no pipeline "
                              f"(`pp` 1): set `pp`, or use `grad_accum` for gradient accumulation")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("`sequence_parallel` splits the sequence over the tensor-parallel group: it needs `tp` "
                              "of 2 or more")
        if self.dp_sync == "gather-scatter" and self.collective not in ("native", "auto"):
            raise ConfigError(f"`dp_sync` gather-scatter is its own communication pattern (through rank 0) and "
                              f"cannot use `collective` {self.collective}: drop `collective` or pick another `dp_sync`")
        if self.zero and self.dp_sync != ZERO_DP_SYNC:
            raise ConfigError(f"`zero` {self.zero} does its own gradient sync (reduce-scatter to each shard's owner), "
                              f"so `dp_sync` {self.dp_sync} cannot apply: drop `dp_sync` or set `zero` 0")
        if self.zero and self.find_unused:
            raise ConfigError(f"`find_unused` is implied by `zero` {self.zero} (parameters without a gradient count as "
                              f"zero): drop `find_unused`")
        if world_size is not None and world_size % self.model_ways:
            divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
            if self.dims:
                sizes = " x ".join(f"`{k}` {v}" for k, v in self._sizes() if v > 1)
                raise ConfigError(f"{sizes} = {self.model_ways} does not divide the world size {world_size}: the "
                                  f"data-parallel size is the world over their product; use sizes whose product "
                                  f"divides it ({divisors})")
            if self.cp > 1:
                sizes = " x ".join(f"`{k}` {v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp))
                                   if v > 1)
                raise ConfigError(f"{sizes} = {self.tp * self.cp * self.pp} does not divide the world size "
                                  f"{world_size}: the world is data x context x tensor x pipeline parallel, so the "
                                  f"product of `tp`, `cp` and `pp` must divide it ({divisors})")
            if self.pp == 1:
                raise ConfigError(f"`tp` {self.tp} does not divide the world size {world_size}: use a `tp` that divides "
                                  f"it (e.g. {divisors})")
            what = f"`pp` {self.pp}" if self.tp == 1 else f"`tp` {self.tp} x `pp` {self.pp} = {self.tp * self.pp}"
            raise ConfigError(f"{what} does not divide the world size {world_size}: the world is data x tensor x "
                              f"pipeline parallel, so the product of `tp` and `pp` must divide it ({divisors})")
        check_shard_groups(self, world_size)
        if world_size is not None and self.dp_size(world_size) % self.ep:
            dp = self.dp_size(world_size)
            fits = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
            raise ConfigError(f"`ep` {self.ep} does not divide the data-parallel size {dp} (world {world_size}"
                              f"{'' if dp == world_size else ' / tp x cp x pp'}): expert parallel shards the experts "
                              f"over data-parallel ranks; use an `ep` of {fits}")
        return self

    def _check_plain_zero(self) -> None:  # the plain implementations are the idea alone
        if self.zero_impl != "tuned" and not self.zero:
            raise ConfigError(f"`zero_impl` {self.zero_impl} is an implementation of ZeRO: give a stage (`zero` 1-3)")
        plain = (f"`zero_impl` {self.zero_impl}", "drop `zero_impl`") if self.zero_impl != "tuned" else \
            ("`dp_sync` bucketed_plain", "use `dp_sync` bucketed") if self.dp_sync == "bucketed_plain" else None
        beside = {"tp": self.tp > 1 and self.zero, "cp": self.cp > 1 and self.zero, "ep": self.ep > 1 and self.zero,
                  "compile": self.compile and self.zero, "reduce_dtype": self.reduce_dtype is not None,
                  "grad_compression": self.grad_compression != "none", "find_unused": self.find_unused}
        clash = next((name for name, on in beside.items() if on), None) if plain else None
        if clash:
            raise ConfigError(f"{plain[0]} with `{clash}`: the plain implementation is the idea alone and leaves "
                              f"{clash} to the tuned one -- {plain[1]} (or drop `{clash}`)")

    def _check_components(self) -> None:
        """Every name in `components` and `dims` registered (distlab.parallel.components), none twice; a
        dimension's kind owns one, a listed kind none."""
        known = component_names()
        for field_name, name in (*(("components", n) for n in self.components), *(("dims", n) for n, _ in self.dims)):
            if name not in known:
                where = f"registered: {', '.join(known)}" if known else "none is registered"
                raise ConfigError(f"`{field_name}` names {name!r}, which is not a registered component"
                                  f"{did_you_mean(name, known)} ({where}; register one with NAME=module:Class in "
                                  f"DISTLAB_COMPONENTS)")
        if len(set(self.components)) != len(self.components):
            raise ConfigError(f"`components` names a component twice: {':'.join(self.components)}")
        for name, size in self.dims:
            dim = load_kind(registered()[name]).dim
            if dim != name:
                raise ConfigError(f"component {name} has no mesh dimension of its own to size ({name}={size}): "
                                  f"name it as +{name}")
            if size < 1:
                raise ConfigError(f"`{name}` must be at least 1, not {size}")
        for name in self.components:
            if load_kind(registered()[name]).dim == name:
                raise ConfigError(f"component {name} splits over a mesh dimension of its own: give its size, "
                                  f"+{name}=N")

    def _check_compression(self) -> None:
        """`grad_compression` and `reduce_dtype`: what they apply to, each refusal with its reason."""
        kind, rank = parse_compression(self.grad_compression)
        if kind == "none" and self.reduce_dtype in (None, "fp32"):
            return
        what = (f"`grad_compression` {self.grad_compression}" if kind != "none"
                else f"`reduce_dtype` {self.reduce_dtype}")
        if self.dp_sync == "gather-scatter":
            raise ConfigError(f"{what} with `dp_sync` gather-scatter: rank 0 gathers and averages the gradients as "
                              f"they are, and there is no all-reduce to compress; use `dp_sync` allreduce, bucketed "
                              f"or ddp")
        if kind in ("fp16", "bf16") and self.reduce_dtype not in (None, kind):
            raise ConfigError(f"`grad_compression` {kind} sends gradients in {kind} and `reduce_dtype` "
                              f"{self.reduce_dtype} says otherwise: keep one of them")
        if kind == "powersgd":
            if self.zero:
                raise ConfigError(f"{what} with `zero` {self.zero}: PowerSGD compresses an all-reduce into two "
                                  f"small ones, and ZeRO reduce-scatters each gradient to its shard's owner; use "
                                  f"`grad_compression` fp16/bf16 (or `reduce_dtype`) with ZeRO, or PowerSGD "
                                  f"without it")
            if self.reduce_dtype not in (None, "fp32"):
                raise ConfigError(f"{what} with `reduce_dtype` {self.reduce_dtype}: PowerSGD's factors are "
                                  f"orthogonalised and travel in float32; drop `reduce_dtype`")
        if self.dp_sync == "ddp" and self.collective != "native" and kind in ("powersgd", "fp16"):
            raise ConfigError(f"{what} with `dp_sync` ddp runs as torch's communication hook, which replaces the "
                              f"all-reduce of `collective` {self.collective}: use `dp_sync` bucketed for distlab's "
                              f"compression over {self.collective}, or `collective` native")

    @property
    def wire_dtype(self) -> str | None:
        """The dtype gradients travel in when not float32 (`reduce_dtype`, or fp16/bf16 compression); else None."""
        kind = self.grad_compression if self.grad_compression in ("fp16", "bf16") else None
        wire = self.reduce_dtype or kind
        return None if wire in (None, "fp32") else wire

    def checkpointed(self, blocks: list) -> list:
        """The blocks activation checkpointing recomputes: none without it, else one in every ``ac_every``
        (the first, then every ``ac_every``-th after it)."""
        return list(blocks[::self.ac_every]) if self.activation_checkpointing else []

    @property
    def exact(self) -> bool:
        """Whether the step equals single-process float32 training up to summation order (no
        reduced precision anywhere, no compression)."""
        return self.precision == "fp32" and self.wire_dtype is None and self.grad_compression == "none"

    def _check_pipeline(self) -> None:
        """The combinations a pipeline refuses, each with its reason."""
        from distlab.parallel.pipeline import check_virtual
        check_virtual(self.pp, self.pp_virtual, self.microbatches, self.pp_schedule)
        parts = self.pp * self.pp_virtual
        if self.pp_balance is not None and (len(self.pp_balance) != parts or min(self.pp_balance) < 1):
            chunks = f" ({self.pp_virtual} chunks on each of {self.pp} ranks)" if self.pp_virtual > 1 else ""
            raise ConfigError(f"`pp_balance` {','.join(map(str, self.pp_balance))} must give {parts} positive layer "
                              f"counts, one per stage{chunks}")
        if self.grad_accum != 1:
            raise ConfigError(f"a pipeline accumulates gradients over its `microbatches` already: drop `grad_accum` "
                              f"{self.grad_accum} and set `microbatches` to {self.grad_accum * self.microbatches}")
        if self.zero == 3 and self.pp_schedule == "zb":
            raise ConfigError(f"`zero` 3 with `pp_schedule` zb: ZeRO-3 reduce-scatters a layer's gradient and frees "
                              f"its gathered parameters when the layer's backward ends, and zero bubble computes the "
                              f"weight gradients in a later pass of their own; use `pp_schedule` 1f1b (or `zero` 2)")
        if self.dp_sync == "ddp":
            raise ConfigError(f"`dp_sync` ddp with `pp` {self.pp}: torch's DDP must see every forward through its "
                              f"wrapper, and a pipeline stage runs its layers piece by piece; use `dp_sync` bucketed "
                              f"(the same bucketed all-reduce, overlapped with the last micro-batch's backward)")

    @property
    def deferrable(self) -> bool:
        """Whether the model can be built on the meta device and given values after the layout cuts it (each
        rank materialising only its part); torch's DDP wraps real tensors, so its model is built whole."""
        return self.dp_sync != "ddp"

    @property
    def micro_steps(self) -> int:
        """Micro-batches each rank runs per optimizer step (`grad_accum` or a pipeline's `microbatches`)."""
        return self.grad_accum * self.microbatches

    def dp_size(self, world_size: int) -> int:
        """Data-parallel ranks: each holds a shard of the global batch."""
        return world_size // self.model_ways

    def size(self, dim: str) -> int:
        """The size of mesh dimension ``dim``: a field's (``tp``, ``pp``, ``cp``, ``ep``) or a registered
        kind's own (``dims``); 1 for one the strategy does not split over."""
        return getattr(self, dim) if dim in ("tp", "pp", "cp", "ep") else dict(self.dims).get(dim, 1)

    def _sizes(self) -> list[tuple[str, int]]:
        return [("tp", self.tp), ("cp", self.cp), ("pp", self.pp), *self.dims]

    @property
    def model_ways(self) -> int:
        """Ranks per data-parallel rank: tensor x context x pipeline parallel x the extra dimensions."""
        return math.prod(n for _, n in self._sizes())

    @property
    def replica_ways(self) -> int:
        """Ranks per data-parallel rank that hold the same part of the model (context parallel's, and the
        extra dimensions that replicate it)."""
        return self.cp * math.prod(d.size for d in self.extra_dims() if d.replicates)

    def extra_dims(self) -> tuple:
        """The registered kinds' own dimensions, as the mesh makes them (:class:`~distlab.parallel.mesh.Dim`)."""
        from distlab.parallel.mesh import Dim
        return tuple(Dim(name, n, load_kind(registered()[name]).replicates) for name, n in self.dims)

    def check_batch(self, global_batch: int, world_size: int) -> None:
        """The global batch must split into equal micro-batches on every data-parallel rank."""
        dp = self.dp_size(world_size)
        model = " x ".join(f"`{k}` {v}" for k, v in self._sizes() if v > 1)
        what = f"world size {dp}" if dp == world_size else f"the data-parallel size {dp} (world {world_size} / {model})"
        if global_batch % dp:
            fits = [d for d in range(1, global_batch + 1) if global_batch % d == 0][:8]
            raise ConfigError(f"`global_batch_size` {global_batch} is not divisible by {what}: use a multiple of "
                              f"{dp} (e.g. {dp * max(1, global_batch // dp)}), or keep {global_batch} (a resumed snapshot keeps "
                              f"its global batch) on a {'world' if dp == world_size else 'data-parallel'} size that "
                              f"divides it: {', '.join(map(str, fits))}")
        if self.pp > 1 and (global_batch // dp) % self.microbatches:
            unit = dp * self.microbatches
            raise ConfigError(f"`microbatches` {self.microbatches} does not divide the per-rank batch {global_batch // dp} "
                              f"(`global_batch_size` {global_batch} / {dp} data-parallel ranks): use a "
                              f"`global_batch_size` that is a multiple of {unit} (e.g. {unit * max(1, global_batch // unit)}) "
                              f"or `microbatches` that divides {global_batch // dp}")
        unit = dp * self.grad_accum
        if global_batch % unit:
            ranks = f"{dp} data-parallel ranks" if dp != world_size else f"{world_size} ranks"
            raise ConfigError(f"`global_batch_size` {global_batch} must split into `grad_accum` {self.grad_accum} equal "
                              f"micro-batches on each of {ranks}: use a multiple of {unit} "
                              f"(e.g. {unit * max(1, global_batch // unit)})")

    # ------------------------------------------------------------------ text and JSON

    @property
    def default_collective(self) -> str:
        """ZeRO's reduce-scatters and all-gathers: ``auto`` (gloo's own take 1.5-3x as long as
        distlab's ring); an all-reduce: ``native``."""
        return "auto" if self.zero else "native"

    def label(self, world_size: int) -> str:
        """The text form as a run's label on ``world_size`` ranks: without the default gradient sync where
        nothing is synchronised (one data-parallel rank: ``pp=2+mb=4+1f1b``, not ``bucketed+pp=2...``),
        ``single process`` where nothing else is left."""
        text = str(self)
        method = self.dp_sync + ("" if self.collective == self.default_collective else f":{self.collective}")
        alone = world_size // max(1, self.model_ways) == 1
        if alone and self.dp_sync == DEFAULT_DP_SYNC and self.collective == self.default_collective \
                and text.split("+")[0] == method:
            text = text[len(method):].lstrip("+")
        return text or "single process"

    def __str__(self) -> str:
        return strategy_text(self)

    @classmethod
    def parse(cls, text: str, **defaults) -> "Strategy":
        """Read the text form (:mod:`distlab.parallel.strategy_text`); ``defaults`` fill fields the text
        leaves out."""
        return parse(cls, text, **defaults)

    @classmethod
    def parse_list(cls, text: str, world: int | None = None, global_batch: int | None = None) -> list["Strategy"]:
        """Comma-separated text forms, each checked against ``world`` (and the batch split) if given."""
        return parse_list(cls, text, world, global_batch)

    def to_dict(self) -> dict:
        """The JSON object of ``summary.json["strategy"]`` (``tp_style`` is null without tensor parallel;
        ``cp`` and ``cp_style`` only with context parallel, ``ep`` only with expert parallel)."""
        d = dataclasses.asdict(self)
        d["tp_style"] = self.tp_style if self.tp > 1 else None
        if self.cp == 1:  # no context parallel: the object (and a snapshot's fingerprint) is as before it existed
            del d["cp"], d["cp_style"]
        for name, default in (("ep", 1), ("ep_dispatch", "all_to_all"), ("pp_virtual", 1), ("zero_impl", "tuned"),
                              ("dp_shard", 0)):
            if getattr(self, name) == default:  # likewise without expert parallel, interleaving or the plain ZeRO
                del d[name]
        if not self.components:  # and without registered components
            del d["components"]
        else:
            d["components"] = list(self.components)
        if not self.dims:
            del d["dims"]
        else:
            d["dims"] = dict(self.dims)
        if not self.compile:  # and without compiling
            del d["compile"]
        if self.compile_backend == "inductor":  # and with the default backend
            del d["compile_backend"]
        d["pp_schedule"] = self.pp_schedule if self.pp > 1 else None
        d["pp_balance"] = list(self.pp_balance) if self.pp_balance else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Strategy":
        """Read :meth:`to_dict` output (unknown keys ignored, missing ones default)."""
        return cls(**{k: v for k, v in d.items() if k in _FIELDS and v is not None})

    def replace(self, **changes) -> "Strategy":
        """A copy with ``changes``; a ``dp_sync`` or ``collective`` left at its default for this
        layout becomes the default of the new one (``Strategy().replace(zero=1)`` is ``zero=1``)."""
        before = Strategy(zero=self.zero)
        for name in ("dp_sync", "collective"):
            if name not in changes and getattr(self, name) == getattr(before, name):
                changes[name] = None
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name: f for f in fields(Strategy)}


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown `{name}` {value!r}; choose one of: {', '.join(str(a) for a in allowed)}")
