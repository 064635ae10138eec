"""ZeRO stages 1-3 (Rajbhandari et al. 2020) over the data-parallel group, from collectives.

Plain data parallel keeps a full copy of parameters, gradients and optimizer state on each of
the ``N`` ranks. ZeRO shards them:

* **stage 1** -- optimizer state: gradients are reduce-scattered, each rank's optimizer updates
  only its ``1/N`` shard, and the updated shards are all-gathered back into the full parameters.
  Bytes sent per step: reduce-scatter + all-gather = exactly an all-reduce.
* **stage 2** -- plus gradients: the full gradients are freed as soon as their bucket is handed
  to the reduce-scatter, and one bucket is in flight at a time (a bucket's reduce-scatter overlaps
  the backward that fills the next): a rank holds ``1/N`` of the gradients plus one bucket.
* **stage 3** -- plus parameters: a rank keeps only its shard; a unit's full parameters are
  all-gathered just before its forward and freed after it, all-gathered again just before its
  backward (a pre-hook on the node that produced its output) and freed once its gradients are
  reduce-scattered. Bytes per step: two all-gathers + one reduce-scatter = 1.5x an all-reduce.

**Buckets (stages 1-2).** As the bucketed data parallel does for its all-reduce, parameters are
grouped in reverse registration order (about the order backward produces their gradients) into
buckets of at most ``bucket_mb``; a post-accumulate-grad hook counts each gradient in, and when a
bucket's last one arrives its gradients are copied rank-major into one flat buffer (row ``r`` =
rank ``r``'s slice of every parameter in the bucket) and one reduce-scatter starts
*asynchronously* -- ``async_op`` for the native collective, a communication thread for distlab's
algorithms -- while backward computes earlier layers. Buckets launch in index order on every
rank. After the optimizer step, one all-gather per bucket puts the updated shards back.

**Units and the flat partition.** Each parameter is a unit: flattened, zero-padded to a multiple
of ``N``, and rank ``r`` owns elements ``[r*S, (r+1)*S)`` with ``S = ceil(numel / N)``. The
parameter becomes a view of that padded buffer, so gathering into the buffer updates it in place;
when ``N`` divides its size (most weights) its gradient is reduce-scattered straight from
``.grad``, without a flat copy. Stage 3 gathers and frees the units of one module (a Linear, a
conv, a norm layer) together, around that module's forward and backward. The optimizer (any
element-wise torch optimizer: SGD with momentum, Adam, AdamW) is built over the shards, one flat
parameter per unit, so its state is sharded too; the zero padding has zero gradient and stays
zero under those updates.

Gradients are averaged over the group, so the step equals plain data parallel (and
single-process training on the global batch) up to float32 summation order. Parameters that get
no gradient in a step count as zero gradient (the partition needs every rank to reduce every
unit, in the same order).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from distlab import comm
from distlab.errors import ConfigError
from distlab.parallel.precision import DTYPES
from distlab.parallel.state_bytes import optimizer_tensors, storage_bytes
from distlab.runtime import broadcast_module, group_rank, group_size

STAGES = (0, 1, 2, 3)
COALESCE_BELOW = 1 << 16  # elements: smaller units share collectives


def goes_alone(numel: int) -> bool:
    """Whether a unit of ``numel`` elements gets collectives of its own (else it shares them)."""
    return numel >= COALESCE_BELOW


@dataclass(frozen=True)
class Shard:
    """Where one parameter's shard lives: ``shard`` holds elements ``[offset, offset + numel)`` of the
    flattened parameter (zero padding past the end: ``shard.numel()`` may exceed ``numel``)."""

    name: str
    param: nn.Parameter
    shard: nn.Parameter
    offset: int
    numel: int


class _Unit:
    """One parameter, flattened, zero-padded and split evenly over the group."""

    def __init__(self, name: str, module: nn.Module, param: nn.Parameter, n: int, rank: int):
        self.name, self.module, self.param, self.n, self.rank = name, module, param, n, rank
        self.numel = param.numel()
        self.shard_numel = math.ceil(self.numel / n)
        self.padded = self.shard_numel * n
        self.full = torch.zeros(self.padded, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            view = self.full[:self.numel].view_as(param)
            view.copy_(param.detach())
            param.data = view  # the parameter now lives in the padded buffer
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(self.full[lo:lo + self.shard_numel].detach().clone())
        self.gathered = True
        self.reduced = False

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def free(self) -> None:
        """Drop the full parameters (the views keep their shapes; their storage holds nothing)."""
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def materialize(self) -> None:
        """Give the full parameters their storage back (contents undefined until gathered)."""
        if not self.gathered:
            self.full.untyped_storage().resize_(self.full_bytes)
            self.gathered = True

    def flat_grad(self) -> torch.Tensor:
        """The gradient as one padded vector: ``.grad`` itself when no padding is needed."""
        g = self.param.grad
        if g is not None and self.padded == self.numel and g.is_contiguous():
            return g.view(-1)
        base = g._base if g is not None else None
        if base is not None and base.numel() == self.padded and base.data_ptr() == g.data_ptr() and base.dim() == 1:
            return base  # already written into a padded buffer (ZeRO-3's Linear)
        flat = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        if g is not None:
            flat[:self.numel].copy_(g.reshape(-1))
        return flat


class _Bucket:
    """Units whose gradients travel in one reduce-scatter (stages 1-2)."""

    def __init__(self, units: list[_Unit]):
        self.units = units
        self.shard_numel = sum(u.shard_numel for u in units)
        self.ready = 0  # gradients arrived this backward
        self.flat: torch.Tensor | None = None  # rank-major gradients, while the reduce-scatter runs
        self.out: torch.Tensor | None = None  # this rank's averaged slice of every unit
        self.work: comm.Handle | None = None  # its reduce-scatter under way


def _buckets(units: list[_Unit], cap_bytes: int) -> list[_Bucket]:
    """``units`` in reverse order, cut into buckets of at most ``cap_bytes`` (a larger unit alone) and one dtype."""
    out: list[_Bucket] = []
    current: list[_Unit] = []
    size = 0
    for u in reversed(units):
        if current and (size + u.full_bytes > cap_bytes or u.full.dtype != current[0].full.dtype):
            out.append(_Bucket(current))
            current, size = [], 0
        current.append(u)
        size += u.full_bytes
    if current:
        out.append(_Bucket(current))
    return out


class Zero(nn.Module):
    """ZeRO stage 1, 2 or 3 around ``module`` over ``group`` (default: the world).

    Use like the data-parallel wrapper: ``forward``, ``no_sync()`` for gradient accumulation,
    ``sync_gradients()`` after the last backward, then ``optimizer.step()`` on an optimizer built
    over :meth:`shard_parameters`, then :meth:`after_step`.
    """

    def __init__(self, module: nn.Module, stage: int, group: dist.ProcessGroup | None = None,
                 collective: str = "auto", bucket_mb: float = 25.0, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ConfigError(f"`zero` {stage}: choose a ZeRO stage of 1, 2 or 3 (0 is plain data parallel)")
        if not bucket_mb > 0:
            raise ConfigError(f"`bucket_mb` must be positive, not {bucket_mb}")
        self._module = module
        self.reduce_dtype = reduce_dtype  # gradients travel in this dtype (None: their own)
        self.stage, self.group, self.collective = stage, group, comm.check_algorithm(collective)
        n, rank = group_size(group), group_rank(group)
        self._rs = comm.resolve(collective, "reduce_scatter", group)  # what `auto` means here
        self._ag = comm.resolve(collective, "all_gather", group)
        broadcast_module(module, src=0, group=group)  # start from rank 0's weights, like data parallel
        self.units = [_Unit(f"{name}.{pname}" if name else pname, m, p, n, rank)
                      for name, m in module.named_modules() for pname, p in m.named_parameters(recurse=False)]
        if not self.units:
            raise ConfigError("`zero` needs a model with parameters")
        self._by_module: dict[nn.Module, list[_Unit]] = {}
        for unit in self.units:
            self._by_module.setdefault(unit.module, []).append(unit)
        self._pinned = False  # inside gathered(): stage-3 hooks leave the full parameters alone
        self._syncing = True
        self._optimizer: torch.optim.Optimizer | None = None
        self.peak_bytes = 0
        self._handles = []
        self._ready: dict[nn.Module, int] = {}  # per module: parameters whose gradient arrived this backward
        self.buckets: list[_Bucket] = []
        self._next_launch = 0
        if stage < 3:
            self.buckets = _buckets(self.units, int(bucket_mb * 2**20))
            for b, bucket in enumerate(self.buckets):
                for unit in bucket.units:
                    self._handles.append(unit.param.register_post_accumulate_grad_hook(
                        lambda p, b=b: self._on_bucket_grad(b)))
        self._order: list[nn.Module] = []  # stage 3: modules in the order the first forward gathers them
        self._bwd_order: list[nn.Module] = []  # ... and the first backward
        self._order_known = False
        self._position: dict[nn.Module, int] = {}
        self._bwd_position: dict[nn.Module, int] = {}
        self._prefetched: dict[nn.Module, list] = {}  # module -> collectives under way into its full parameters
        self.prefetch = True
        if stage == 3:
            for m, units in self._by_module.items():
                for unit in units:
                    unit.free()
                if sharded_linear(m, [u.param for u in units]):  # the weight's gradient never meets the full weight
                    m.forward = lambda x, m=m, units=units: self._linear(m, units, x)
                    continue
                for unit in units:
                    self._handles.append(unit.param.register_post_accumulate_grad_hook(
                        lambda p, unit=unit: self._on_grad_ready(unit)))
                self._handles.append(m.register_forward_pre_hook(
                    lambda m, args, units=units: self._before_forward(m, units)))
                self._handles.append(m.register_forward_hook(
                    lambda m, args, out, units=units: self._after_forward(units, m, out)))

    @classmethod
    def from_strategy(cls, module: nn.Module, strategy, group: dist.ProcessGroup | None = None) -> "Zero":
        """``module`` over ``group`` at the strategy's ZeRO stage, collective, bucket size and wire dtype."""
        wire = strategy.wire_dtype
        return cls(module, strategy.zero, group=group, collective=strategy.collective, bucket_mb=strategy.bucket_mb,
                   reduce_dtype=DTYPES[wire] if wire else None)

    # ------------------------------------------------------------------ the wrapped model

    @property
    def module(self) -> nn.Module:
        return self._module

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    sharded = True  # ranks hold different model states
    needs_priming = False  # its buckets are fixed at construction: a resumed run reduces in the same ones

    def shard_parameters(self) -> list[nn.Parameter]:
        """One flat parameter per unit: this rank's shard. Build the optimizer over these."""
        return [u.shard for u in self.units]

    optimizer_parameters = shard_parameters

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> where this rank's shard of it lives (the public parameter-to-shard map)."""
        return {u.name: Shard(u.name, u.param, u.shard, u.rank * u.shard_numel,
                              max(0, min(u.numel, (u.rank + 1) * u.shard_numel) - u.rank * u.shard_numel))
                for u in self.units}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the full averaged gradient, shaped like the parameter (collective: an
        all-gather of every shard's gradient). Valid between :meth:`sync_gradients` and the next
        ``zero_grad``; a shard without a gradient contributes zeros."""
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=u.full.dtype, device=u.full.device)
            grad = u.shard.grad if u.shard.grad is not None else torch.zeros_like(u.shard)
            comm.all_gather(full, grad, algorithm=self._ag, group=self.group)
            out[u.name] = full[:u.numel].view_as(u.param).clone()
        return out

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state in :attr:`peak_bytes`."""
        self._optimizer = optimizer

    def observe(self) -> int:
        """Update and return :attr:`peak_bytes` (the hooks also update it at every gather and reduce)."""
        self._observe()
        return self.peak_bytes

    def uncounted_bytes_per_sync(self) -> int:
        return 0  # every byte goes through distlab.comm, which counts it

    # ------------------------------------------------------------------ stage 3 hooks

    def _before_forward(self, module: nn.Module, units: list[_Unit]) -> None:
        if self._pinned:
            return
        self._fetch(module, units, forward=True)

    def _after_forward(self, units: list[_Unit], module: nn.Module, out) -> None:
        if self._pinned:
            return
        for unit in units:
            unit.free()
        if not torch.is_grad_enabled():
            return
        nodes = {t.grad_fn for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:  # backward reaches the module's own nodes only through its outputs' nodes
            node.register_prehook(lambda grads, module=module, units=units: self._before_backward(module, units))

    def _before_backward(self, module: nn.Module, units: list[_Unit]) -> None:
        if module in self._prefetched or not all(u.gathered for u in units):  # prefetched: still arriving
            self._fetch(module, units, forward=False)

    def _fetch(self, module: nn.Module, units: list[_Unit], forward: bool) -> None:
        """Make ``module``'s full parameters present (waiting for its prefetch, or gathering now),
        then start gathering the module that needs its parameters next: the following one in
        forward, and in backward the next one that needed them in the first step's backward (a
        first Linear, whose input needs no gradient, needs none)."""
        if module in self._prefetched:
            self._wait_prefetch(module)
        elif not all(u.gathered for u in units):
            self._gather(units)
        self._observe()
        order, position = (self._order, self._position) if forward else (self._bwd_order, self._bwd_position)
        if not self._order_known:
            if module not in position:
                position[module] = len(order)
                order.append(module)
            return
        i = position.get(module)
        if self.prefetch and i is not None and i + 1 < len(order):
            following = order[i + 1]
            ahead = self._by_module[following]
            if following not in self._prefetched and not all(u.gathered for u in ahead):
                self._prefetched[following] = self._gather(ahead, wait=False)
                self._observe()

    def _wait_prefetch(self, module: nn.Module) -> None:
        self._finish_gather(self._prefetched.pop(module))

    def _drain(self) -> None:
        """Wait for prefetches nobody used (every rank issued them) and drop their parameters."""
        for module in list(self._prefetched):
            self._wait_prefetch(module)
            for u in self._by_module[module]:
                u.free()

    def _linear(self, module: nn.Module, units: list[_Unit], x: torch.Tensor) -> torch.Tensor:
        if self._pinned:
            return nn.functional.linear(x, module.weight, module.bias)
        return _ShardedLinear.apply(x, self, module, units, *[u.shard for u in units])

    def _linear_grads(self, units: list[_Unit], g: torch.Tensor, x: torch.Tensor) -> None:
        """The weight's (and bias') gradient of a sharded Linear, written straight into a padded
        flat buffer (the full weight is already released), accumulated or reduce-scattered."""
        weight = units[0]
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        flat = (torch.empty if weight.padded == weight.numel else torch.zeros)(
            weight.padded, dtype=weight.full.dtype, device=weight.full.device)
        if g2.dtype == flat.dtype and x2.dtype == flat.dtype:
            torch.mm(g2.t(), x2, out=flat[:weight.numel].view_as(weight.param))
        else:  # under autocast: the product in the forward's dtype, kept in the parameters' dtype
            flat[:weight.numel].view_as(weight.param).copy_(torch.mm(g2.t(), x2.to(g2.dtype)))
        grads = [flat[:weight.numel].view_as(weight.param)] + [g2.sum(0).to(flat.dtype) for _ in units[1:]]
        for u, grad in zip(units, grads):
            u.param.grad = grad if u.param.grad is None else u.param.grad.add_(grad)
        if self._syncing:
            self._reduce(units)

    # ------------------------------------------------------------------ gradients, stages 1-2: buckets

    def _on_bucket_grad(self, b: int) -> None:
        if not self._syncing:
            return
        bucket = self.buckets[b]
        if b < self._next_launch:
            raise ConfigError("a second backward reached a bucket already being reduced: run every backward but a "
                              "step's last under `no_sync()` (gradient accumulation), then sync_gradients()")
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].ready >= len(self.buckets[self._next_launch].units)):
            self._launch(self._next_launch)
            self._next_launch += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients rank-major into one buffer (freeing each full gradient once
        copied) and start its reduce-scatter; stage 2 first completes the bucket before."""
        if self.stage == 2 and b >= 1:
            self._finish(b - 1)  # one bucket in flight: its reduce overlapped the backward that filled this one
        bucket = self.buckets[b]
        units, n = bucket.units, bucket.units[0].n
        wire = self.reduce_dtype
        if len(units) == 1:
            bucket.flat = self._narrow(units[0].flat_grad())
        else:
            bucket.flat = torch.empty(n * bucket.shard_numel, dtype=wire or units[0].full.dtype,
                                      device=units[0].full.device)
            rows, col = bucket.flat.view(n, bucket.shard_numel), 0
            for u in units:  # row r = rank r's slice of every unit, so one reduce-scatter serves them all
                rows[:, col:col + u.shard_numel].copy_(self._narrow(u.flat_grad()).view(n, u.shard_numel))
                col += u.shard_numel
                u.param.grad = None
        units[0].param.grad = None  # a lone unit's buffer may be its gradient: the bucket holds it now
        bucket.out = torch.empty(bucket.shard_numel, dtype=bucket.flat.dtype, device=bucket.flat.device)
        op = "sum" if wire is not None else "avg"  # a narrow dtype is pre-divided (no float16 overflow)
        self._observe()
        bucket.work = comm.reduce_scatter(bucket.out, bucket.flat, op, self._rs, self.group, scratch=True,
                                          async_op=True)  # the bucket is scratch once sent

    def _finish(self, b: int) -> None:
        """Wait for bucket ``b``'s reduce-scatter; its units' shard gradients become views of the result."""
        bucket = self.buckets[b]
        if bucket.out is None:
            return
        bucket.work.wait()
        out = bucket.out if self.reduce_dtype is None else bucket.out.to(bucket.units[0].full.dtype)
        offset = 0
        for u in bucket.units:
            u.shard.grad = out[offset:offset + u.shard_numel]
            offset += u.shard_numel
            u.reduced = True
        bucket.flat = bucket.out = bucket.work = None

    # ------------------------------------------------------------------ gradients, stage 3: per module

    def _on_grad_ready(self, unit: _Unit) -> None:
        """Once every parameter of a module has its gradient: reduce-scatter them (one collective)."""
        units = self._by_module[unit.module]
        count = self._ready.get(unit.module, 0) + 1
        if count < len(units):
            self._ready[unit.module] = count
            return
        self._ready[unit.module] = 0
        if self._syncing:
            self._reduce(units)
        if self.stage == 3:
            for u in units:
                u.free()

    @staticmethod
    def _groups(units: list[_Unit]) -> list[list[_Unit]]:
        """Collective batches: a large unit goes alone (without padding its gradient and its full
        buffer are used in place; with padding, one padded copy of its gradient); the small ones
        share one collective (a copy of small tensors is cheaper than a collective's latency)."""
        alone = [[u] for u in units if goes_alone(u.numel)]
        small = [u for u in units if not goes_alone(u.numel)]
        by_dtype: dict[torch.dtype, list[_Unit]] = {}
        for u in small:
            by_dtype.setdefault(u.full.dtype, []).append(u)
        return alone + list(by_dtype.values())

    def _gather(self, units: list[_Unit], wait: bool = True):
        """All-gather the shards of ``units`` into their full parameters. Every collective is
        started before the first is waited for (native: ``async_op``; distlab's algorithms: on the
        communication thread when there is one); ``wait=False`` returns them unfinished, for
        :meth:`_finish_gather`."""
        for u in units:
            u.materialize()
        pending = []
        for group in self._groups(units):
            n = group[0].n
            if len(group) == 1:
                out, mine = group[0].full, group[0].shard.detach()
            else:
                mine = torch.cat([u.shard.detach() for u in group])
                out = torch.empty((n, mine.numel()), dtype=mine.dtype, device=mine.device)
            # native: torch's async work; distlab's algorithms: the communication thread (all started before any wait)
            work = comm.all_gather(out, mine, algorithm=self._ag, group=self.group, async_op=True)
            pending.append((group, out, work))
        if not wait:
            return pending
        self._finish_gather(pending)
        return None

    @staticmethod
    def _finish_gather(pending) -> None:
        for group, out, work in pending:
            work.wait()
            if len(group) > 1:
                offset = 0
                for u in group:  # row r holds rank r's shards of every unit, one after another
                    u.full.view(u.n, u.shard_numel).copy_(out[:, offset:offset + u.shard_numel])
                    offset += u.shard_numel

    def _reduce(self, units: list[_Unit]) -> None:
        """Reduce-scatter (average) the gradients of ``units`` into their shards' gradients and drop
        the full gradients."""
        for group in self._groups(units):
            n = group[0].n
            flats = [self._narrow(u.flat_grad()) for u in group]
            # rank-major: row r = rank r's slice of every unit, so one reduce-scatter serves them all
            flat = flats[0] if len(group) == 1 else torch.cat(
                [f.view(n, u.shard_numel) for u, f in zip(group, flats)], dim=1).view(-1)
            self._observe(*flats, flat)
            out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
            op = "sum" if self.reduce_dtype is not None else "avg"
            comm.reduce_scatter(out, flat, op=op, algorithm=self._rs, group=self.group, scratch=True)
            if self.reduce_dtype is not None:
                out = out.to(group[0].full.dtype)
            offset = 0
            for u in group:
                u.shard.grad = out[offset:offset + u.shard_numel]
                offset += u.shard_numel
                u.reduced = True
                u.param.grad = None

    def _narrow(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as it travels: divided by the group size and cast when gradients travel in a
        narrower dtype (the sum of ``N`` pre-divided values is the mean, without float16 overflow)."""
        if self.reduce_dtype is None or flat.dtype == self.reduce_dtype:
            return flat
        return flat.div(self.group_size).to(self.reduce_dtype)

    @property
    def group_size(self) -> int:
        return self.units[0].n

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate full local gradients without communicating (the micro-batches of a step)."""
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = True

    def sync_gradients(self) -> None:
        """After the step's last backward: every unit's averaged gradient shard is in place."""
        if self.buckets:
            for bucket in self.buckets[self._next_launch:]:  # buckets with parameters that got no gradient
                bucket.ready = len(bucket.units)
            try:
                self._launch_ready()
                for b in range(len(self.buckets)):
                    self._finish(b)
            finally:
                for bucket in self.buckets:
                    bucket.ready, bucket.flat, bucket.out, bucket.work = 0, None, None, None
                self._next_launch = 0
        self._drain()
        if self.stage == 3 and self._order:
            self._order_known = True
        pending = [u for u in self.units if not u.reduced]  # stage 3: those whose backward never ran
        if pending:
            self._reduce(pending)
        self._ready.clear()
        for unit in self.units:
            unit.reduced = False
            if self.stage == 3:
                unit.free()

    def after_step(self) -> None:
        """After ``optimizer.step()``: stages 1-2 all-gather the updated shards into the parameters."""
        self._observe()
        if self.stage < 3:
            self._gather(self.units)

    # ------------------------------------------------------------------ state

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """The full parameters in place for the duration (collective under stage 3)."""
        if self.stage < 3 or self._pinned:
            yield self._module
            return
        self._drain()
        self._gather(self.units)
        self._pinned = True
        try:
            yield self._module
        finally:
            self._pinned = False
            for unit in self.units:
                unit.free()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict`` (collective under stage 3; every rank gets it)."""
        with self.gathered() as m:
            return {k: v.detach().clone() for k, v in m.state_dict().items()}

    def sync_state_dict(self) -> dict:
        """Nothing carries over between ZeRO's gradient syncs (its casts have no memory)."""
        return {}

    def load_sync_state_dict(self, state: dict) -> None:
        pass

    def sharded_state_dict(self) -> dict:
        """This rank's part: its shards and buffers (a snapshot writes one per rank)."""
        return {"zero_stage": self.stage, "world_size": group_size(self.group), "rank": group_rank(self.group),
                "units": [{"name": u.name, "numel": u.numel, "shard": u.shard.detach().clone()} for u in self.units],
                "buffers": {k: v.detach().clone() for k, v in self._module.named_buffers()}}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore :meth:`sharded_state_dict` output; a different layout is refused, naming it."""
        mine = self.sharded_state_dict()
        for key in ("zero_stage", "world_size", "rank"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"sharded snapshot was written with {key} {state.get(key)}, this run has "
                                  f"{mine[key]}: resume with the same `zero` and data-parallel size")
        theirs = [(u["name"], u["numel"]) for u in state["units"]]
        ours = [(u["name"], u["numel"]) for u in mine["units"]]
        if theirs != ours:
            if len(theirs) != len(ours):
                raise ConfigError(f"sharded snapshot is for another model: it has {len(theirs)} parameters, this "
                                  f"model {len(ours)}")
            (a, na), (b, nb) = next((x, y) for x, y in zip(theirs, ours) if x != y)
            raise ConfigError(f"sharded snapshot is for another model: its parameter {a} has {na} elements, this "
                              f"model's {b} has {nb}")
        with torch.no_grad():
            for unit, saved in zip(self.units, state["units"]):
                unit.shard.copy_(saved["shard"])
            buffers = dict(self._module.named_buffers())
            for k, v in state["buffers"].items():
                buffers[k].copy_(v)
        gathered = [u for u in self.units if u.gathered]
        if gathered:
            self._gather(gathered)

    def parameter_slots(self) -> list[tuple[str, nn.Parameter, tuple[int, int] | None]]:
        """(key, parameter, flat range) of each optimizer parameter: this rank's range of each unit."""
        return [(u.name, u.param, (u.rank * u.shard_numel,
                                   max(0, min(u.numel, (u.rank + 1) * u.shard_numel) - u.rank * u.shard_numel)))
                for u in self.units]

    @staticmethod
    def reads(state: dict) -> bool:
        """Whether ``state`` is a :meth:`sharded_state_dict` of ZeRO (of any stage and group size)."""
        return "zero_stage" in state

    @staticmethod
    def split_state(state: dict, keys: list[str]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """A :meth:`sharded_state_dict` as (the optimizer parameters' tensors: the shards, the buffers)."""
        return [u["shard"] for u in state["units"]], dict(state["buffers"])

    def state_from(self, params: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        """The :meth:`sharded_state_dict` holding shards ``params`` (in unit order) and ``buffers``."""
        return {"zero_stage": self.stage, "world_size": group_size(self.group), "rank": group_rank(self.group),
                "units": [{"name": u.name, "numel": u.numel, "shard": t} for u, t in zip(self.units, params)],
                "buffers": buffers}

    def held_bytes(self, *extra: torch.Tensor) -> int:
        """Bytes of parameters + gradients + optimizer state this rank holds right now."""
        tensors = [t for u in self.units for t in (u.full, u.shard, u.shard.grad, u.param.grad)]
        tensors += [t for b in self.buckets for t in (b.flat, b.out)]
        return storage_bytes(tensors + list(extra) + optimizer_tensors(self._optimizer))

    def _observe(self, *extra: torch.Tensor) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes(*extra))


def sharded_linear(module: nn.Module, params: list[nn.Parameter]) -> bool:
    """Whether ZeRO-3 runs ``module`` (owning ``params``) as :class:`_ShardedLinear`: an
    ``nn.Linear`` with torch's own forward whose parameters are exactly its weight and bias."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and params == [p for p in (module.weight, module.bias) if p is not None])


class _ShardedLinear(torch.autograd.Function):
    """ZeRO-3's Linear: the full weight exists only inside forward and inside the input-gradient
    product of backward; the weight gradient is computed after the weight is released, into the
    reduce-scatter's buffer. Gradients reach the shards through :meth:`Zero._reduce`, not autograd."""

    @staticmethod
    def forward(ctx, x, zero, module, units, *shards):
        zero._fetch(module, units, forward=True)
        out = nn.functional.linear(x, units[0].param, units[1].param if len(units) > 1 else None)
        for u in units:
            u.free()
        ctx.save_for_backward(x)
        ctx.zero, ctx.module, ctx.units = zero, module, units
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        zero, module, units = ctx.zero, ctx.module, ctx.units
        grad_x = None
        if ctx.needs_input_grad[0]:
            zero._fetch(module, units, forward=False)
            grad_x = g.matmul(units[0].param.to(g.dtype)).to(x.dtype)
            for u in units:
                u.free()
        zero._linear_grads(units, g, x)
        return (grad_x, None, None, None) + (None,) * len(units)


def _flatten(out) -> list:
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flatten(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _flatten(o)]
    return [out]
