"""What a strategy costs per step and rank, on a model's sizes: the collectives it runs (:class:`Call`,
:class:`PlannedCalls`), the memory it holds, and -- for a model-sharding component -- its
:class:`Price`. The model's sizes are a :class:`~distlab.plan.trace.Trace` (``t`` below; traced on the
``meta`` device by ``distlab plan``): each strategy's cost sits beside the strategy, the tracing and
the folding of prices in :mod:`distlab.plan`.

Memory is the same quantity distlab measures (``model_state_bytes_per_rank`` in ``summary.json``)
and equals it *exactly* for plain data parallel and ZeRO 1-3:

* **data parallel** (stage 0): every rank holds the parameters, their gradients and the
  optimizer state -- ``P + G + O`` bytes, measured once both gradients and state exist
  (:class:`DataParallelCost`).
* **ZeRO** keeps the same tensors in the shapes :mod:`distlab.parallel.zero` gives them and
  measures the largest sum it ever holds at its observation points, inside backward: the peak
  depends on the *order* in which backward produces gradients, which the trace records, and
  :func:`distlab.parallel.zero.cost.zero_peak_bytes` replays ZeRO's bookkeeping over it for any
  world size.

Optimizer state per element: SGD with momentum 1 (the momentum buffer; none without momentum),
Adam/AdamW 2 (the two moments) plus a 4-byte ``step`` tensor per parameter tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from distlab.errors import ConfigError
from distlab.parallel.compression import PowerSGD, compressible, build_codec

DDP_FIRST_BUCKET = 1 << 20    # torch DDP caps its first bucket at 1 MiB
STEP_TENSOR_BYTES = 4  # Adam's per-parameter ``step`` (a float32 scalar tensor)


@dataclass(frozen=True)
class Optim:
    """What an optimizer keeps per parameter tensor: ``per_element`` tensors of the parameter's
    size and ``per_tensor`` extra bytes."""
    name: str
    per_element: int
    per_tensor: int
    state_size: int | None = None  # bytes per element of the state tensors (None: the parameter's)
    matrix: "Optim | None" = None  # what a matrix keeps where it differs (Muon's: its momentum alone)
    offload: str = "none"  # optimizer | params: the state tensors (and ZeRO-3's shards) off the device

    @classmethod
    def of(cls, name: str, momentum: float = 0.9, state: str = "fp32", offload: str = "none") -> "Optim":
        if name == "sgd":
            return cls("sgd", 1 if momentum else 0, 0, offload=offload)
        if name in ("adam", "adamw"):  # (bf16 moments: distlab.train.low_precision_optim)
            return cls(name, 2, STEP_TENSOR_BYTES, 2 if state == "bf16" else None, offload=offload)
        if name == "muon":  # AdamW beside the matrices' momentum buffers (distlab.train.muon)
            return cls(name, 2, STEP_TENSOR_BYTES, 2 if state == "bf16" else None, matrix=cls("muon", 1, 0,
                       offload=offload), offload=offload)
        raise ConfigError(f"unknown optimizer {name!r}; choose sgd, adam, adamw or muon")

    def unit(self, matrix: bool) -> "Optim":
        """What a unit keeps: a matrix's own (:attr:`matrix`) where there is one, else this."""
        return self.matrix if matrix and self.matrix is not None else self

    def bytes(self, numel: int, element_size: int) -> int:
        """What the device holds for a parameter of ``numel`` elements: its state tensors (none where they are
        offloaded: :meth:`offloaded_bytes`) and the per-tensor step count (a scalar, never offloaded)."""
        tensors = 0 if self.offload != "none" else self.state_bytes(numel, element_size)
        return tensors + (self.per_tensor if self.per_element else 0)

    def state_bytes(self, numel: int, element_size: int) -> int:
        return self.per_element * numel * (self.state_size or element_size)

    def offloaded_bytes(self, numel: int, element_size: int) -> int:
        """The bytes of a parameter's state tensors that ``--offload`` holds off the device."""
        return self.state_bytes(numel, element_size) if self.offload != "none" else 0


def data_parallel_bytes(t, optim: Optim, tp: int = 1) -> int:
    """Plain data parallel: parameters + gradients + optimizer state, all replicated."""
    if tp > 1:
        raise ConfigError("exact memory is predicted for data parallel and ZeRO; tensor parallel is estimated "
                          "by estimate_bytes()")
    e = t.element_size  # a frozen parameter (a base under adapters): no gradient, no optimizer state, held as
    # its base holds it (bf16, 4-bit: ``t.unit_bytes``)
    return sum((2 * n * e + optim.unit(t.matrix(u)).bytes(n, e)) if t.trains(u) else t.unit_bytes(u)
               for u, n in enumerate(t.numels))


def trained(t) -> tuple[list[int], list[tuple[int, ...]]]:
    """The numels and shapes of the units that get gradients (a frozen base's never do)."""
    units = [u for u in range(len(t.numels)) if t.trains(u)]
    return [t.numels[u] for u in units], [t.shapes[u] for u in units] if t.shapes else []


# ---------------------------------------------------------------------------------- what a step sends

def under(name: str, modules, strict: bool = False) -> bool:
    """Whether the module or parameter ``name`` is one of the set ``modules`` or inside one (``strict``:
    inside one only) -- each of its dotted prefixes looked up, not every module compared."""
    if strict:
        name = name.rpartition(".")[0]
    while name:
        if name in modules:
            return True
        name = name.rpartition(".")[0]
    return False


def blocks_of(name: str, index: dict[str, list[int]]) -> set[int]:
    """The blocks the module ``name`` is one of or inside, ``index`` mapping each block's member to its
    blocks (:func:`block_index`)."""
    found: set[int] = set()
    while name:
        found.update(index.get(name, ()))
        name = name.rpartition(".")[0]
    return found


def block_index(blocks: list[list[str]]) -> dict[str, list[int]]:
    """Each module a block lists -> the blocks (indices into ``blocks``) that list it."""
    index: dict[str, list[int]] = {}
    for b, block in enumerate(blocks):
        for name in block:
            index.setdefault(name, []).append(b)
    return index


def in_stage(name: str, t_rank, lay) -> bool:
    """Whether the module ``name`` is on the pipeline stage whose trace is ``t_rank`` (every module is
    without a pipeline): what a component prices is that stage's part of the model."""
    return lay.pp == 1 or under(name, {layer.name for layer in t_rank.layers})


@dataclass(frozen=True)
class ModuleIO:
    """What a module of the model's trace takes and gives, per sample: what a tensor-parallel style
    sends (:mod:`distlab.parallel.tensor_parallel.styles`) is priced from it."""
    input_bytes: float   # its first input
    output_bytes: float  # its output
    output_rows: float   # its output's rows: the tokens of a language model's logits, 1 for a classifier's
    input_grad: bool     # its input needs a gradient
    element_size: int    # of its parameters
    parameters: tuple[int, ...] = ()  # each parameter's elements, in registration order (its submodules' too)
    grads: tuple[tuple[str, int], ...] = ()  # (name, elements) of those that need a gradient, in that order


@dataclass
class Call:
    """One collective of a step, for the time model of ``distlab plan``."""
    algorithm: str
    kind: str           # all_reduce | reduce_scatter | all_gather | send (to a neighbour) | all_to_all
    nbytes: float       # the whole tensor (all-reduce) / the full, gathered size (RS, AG) / what one rank sends
    ready: float = 1.0  # fraction of backward done when it may start (1 = after backward)
    itemsize: int = 4   # bytes per element (the butterfly splits whole elements)
    ranks: int = 0      # the ranks it spans: 0, the gradient sync's group (hybrid sharding's are fewer)
    span: str = ""      # which of the sync's groups: "" all of it, "shard" or "replicate" (hybrid sharding)


@dataclass
class PlannedCalls:
    """A gradient sync's collectives in one step, by when they run."""
    before_layers: list[Call] = field(default_factory=list)  # exposed: a layer waits for them (ZeRO-3's gathers)
    during_backward: list[Call] = field(default_factory=list)  # may overlap backward, from ``ready`` on
    after_backward: list[Call] = field(default_factory=list)
    after_step: list[Call] = field(default_factory=list)


def resolved(algorithm: str, collective: str) -> str:
    """``auto`` as :func:`distlab.comm.resolve` picks it on gloo (the backend the plan is calibrated on)."""
    if algorithm != "auto":
        return algorithm
    return "ring" if collective in ("reduce_scatter", "all_gather") else "native"


def _buckets(sizes: list[int], cap: int, first_cap: int | None = None) -> list[tuple[int, int]]:
    """(bytes, bytes of gradients ready when it is full) of buckets over ``sizes`` in backward order."""
    out, cur, done, limit = [], 0, 0, first_cap or cap
    for s in sizes:
        cur += s
        done += s
        if cur >= limit:
            out.append((cur, done))
            cur, limit = 0, cap
    if cur:
        out.append((cur, done))
    return out


def _powersgd_parts(t, strategy) -> list[float]:
    """The shares of a PowerSGD buffer's bytes in its three all-reduces (vectors and small matrices
    as they are, then P, then Q); ``[1.0]`` (one all-reduce) for every other codec."""
    codec = build_codec(strategy)
    if not isinstance(codec, PowerSGD):
        return [1.0]
    rest = p = q = 0
    numels, shapes = trained(t)
    for shape in shapes or [(m,) for m in numels]:
        dims = compressible(torch.Size(shape), codec.rank)
        if dims:
            p, q = p + dims[2] * dims[0], q + dims[2] * dims[1]
        else:
            rest += math.prod(shape)
    total = rest + p + q
    return [x / total for x in (rest, p, q) if x]


def _wire_sizes(t, strategy) -> list[float]:
    """Bytes each gradient puts into the data-parallel all-reduce: its own, or as the strategy's
    codec sends it (``reduce_dtype``/fp16/bf16: 2 bytes an element; PowerSGD: R(n+m) numbers)."""
    codec = build_codec(strategy)
    numels, shapes = trained(t)
    if codec.exact:
        return [m * t.element_size for m in numels]
    shapes = shapes or [(m,) for m in numels]
    return [codec.wire_bytes([torch.Size(s)], t.element_size) for s in shapes]


class DataParallelCost:
    """What :class:`~distlab.parallel.DataParallel` sends and holds, on a model's sizes (the plan's
    model of it, beside :class:`~distlab.parallel.zero.cost.ZeroCost`)."""

    @staticmethod
    def planned_calls(t, strategy, n: int) -> PlannedCalls:
        """The data-parallel group's collectives of one step: one all-reduce per parameter
        (``allreduce``) or per bucket as backward fills it (``bucketed``, ``ddp`` with torch's 1 MiB
        first bucket), three in a row per buffer under PowerSGD, or the parameter server's round trip."""
        sizes = [m * t.element_size for m in trained(t)[0]]  # gradients: a frozen base sends none
        if n == 1 or not sizes:
            return PlannedCalls()
        total = sum(sizes)
        alg = resolved(strategy.collective, "all_reduce")
        if strategy.dp_sync == "gather-scatter":
            return PlannedCalls(after_backward=[Call("gather_scatter", "all_reduce", total)])
        wire = _wire_sizes(t, strategy)  # what each gradient puts on the wire (compressed or narrowed)
        parts = _powersgd_parts(t, strategy)  # PowerSGD: three all-reduces in a row (uncompressed rest, P, Q)
        if strategy.dp_sync == "allreduce":
            return PlannedCalls(after_backward=[Call(alg, "all_reduce", w * f) for w in wire for f in parts])
        cap = int(strategy.bucket_mb * 2**20)
        buckets = _buckets(list(reversed(sizes)), cap, DDP_FIRST_BUCKET if strategy.dp_sync == "ddp" else None)
        scale = sum(wire) / total  # buckets are cut by gradient bytes and send their compressed share
        return PlannedCalls(during_backward=[Call(alg, "all_reduce", b * scale * f, done / total)
                                             for b, done in buckets for f in parts])

    @staticmethod
    def planned_memory(t, optim: Optim, strategy, n: int) -> int:
        """Parameters + gradients + optimizer state, all replicated (exact: measured the same way)."""
        return data_parallel_bytes(t, optim)

    @staticmethod
    def planned_parts(numels: list[int], optim: Optim, element_size: int, strategy, n: int,
                      trainable: list[bool] | None = None, held: list | None = None,
                      matrices: list[bool] | None = None) -> dict[str, int]:
        """Parameters, gradients and optimizer state between steps, each whole on every rank."""
        return textbook_parts(numels, optim, element_size, 0, n, trainable, held, matrices)

    @staticmethod
    def planned_extra_state(t, strategy, n: int) -> int:
        """PowerSGD's per-rank state: the error feedback (one gradient per compressed matrix) and the
        warm-start Q (m x R each); 0 for every other codec."""
        codec = build_codec(strategy)
        if not isinstance(codec, PowerSGD) or n == 1:
            return 0
        total = 0
        for shape in trained(t)[1]:
            dims = compressible(torch.Size(shape), codec.rank)
            if dims:
                rows, cols, r = dims
                total += (rows * cols + cols * r) * t.element_size
        return total


def textbook_parts(numels: list[int], optim: Optim, element_size: int, stage: int, n: int,
                   trainable: list[bool] | None = None, held: list | None = None,
                   matrices: list[bool] | None = None) -> dict[str, int]:
    """What parameters, gradients and optimizer state come to per rank between steps when ZeRO ``stage``
    shards the first ``stage`` of (optimizer state, gradients, parameters) over ``n`` ranks -- the
    textbook split of the ZeRO paper's table 1 (each tensor ``ceil(numel / n)``, no padding). A frozen
    tensor (``trainable`` False) has parameters only; ``held``: per tensor, the (elements, bytes each) it is held
    as (a frozen base's bf16 or 4-bit parts, ZeRO-3 sharding each; default: itself in ``element_size``)."""
    shards, e = [math.ceil(m / n) for m in numels], element_size
    trains = trainable or [True] * len(numels)
    grads = [x for x, keep in zip(shards if stage >= 2 else numels, trains) if keep]
    state = [(x, m) for x, keep, m in zip(shards if stage >= 1 else numels, trains, matrices or [False] * len(numels))
             if keep]
    held = held or [[(m, e)] for m in numels]
    return {"parameter_bytes_per_rank": sum((math.ceil(k / n) if stage == 3 else k) * b
                                            for parts in held for k, b in parts),
            "gradient_bytes_per_rank": e * sum(grads),
            "optimizer_bytes_per_rank": sum(optim.unit(matrix).bytes(m, e) for m, matrix in state)}


@dataclass
class CallGroup:
    """Collectives a model-sharding component runs in every step, over ``ranks`` ranks: over the run's
    link, or (``local``) a node's own fast links. ``calls`` go ``hops`` times, one after another, each
    time beside ``hidden_flops`` of the rank's compute (a ring's next block in flight while it scores the
    one it holds): only what that compute does not hide is on the critical path (all of it without)."""
    calls: list[Call]
    ranks: int
    local: bool = False
    dim: str = ""  # the mesh dimension its ranks span (tp, cp, ep, pp): where a GPU cluster places it
    hops: int = 1
    hidden_flops: float = 0.0


@dataclass
class Price:
    """What one model-sharding component costs a rank per step, priced by the component itself on the
    model's trace (``kind.price``): ``distlab plan`` folds the prices of the components a layout turns
    on -- the same components that train -- into its memory and time."""
    calls: list[CallGroup] = field(default_factory=list)
    saved: dict[str, int] = field(default_factory=dict)  # memory kind -> bytes it keeps off this rank
    compute_split: int = 1      # a rank computes 1/compute_split of the model's FLOPs (tensor, context parallel)
    exact: bool = True          # whether the plan's memory stays exact with it
    report: dict = field(default_factory=dict)  # plan output key -> what it says about itself
    activation_note: str = ""   # how it changes what a rank saves for backward
    activation_extra: float = 0.0  # bytes a rank saves for backward per micro-batch beyond its split share
