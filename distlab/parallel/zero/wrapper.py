"""The ZeRO wrapper: units and hooks set up, the step's sync and after-step, the Engine's interface
(:class:`~distlab.parallel.protocols.GradSync`). The work is in its parts: reduce, gather, state."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from distlab import comm
from distlab.errors import ConfigError
from distlab.parallel.precision import DTYPES
from distlab.parallel.zero.gather import GatherOnDemand
from distlab.parallel.zero.reduce import BucketedReduce
from distlab.parallel.zero.state import ShardedState
from distlab.parallel.zero.units import Shard, Bucket, cut_buckets, Unit, sharded_linear
from distlab.runtime import broadcast_module, group_rank, group_size

STAGES = (0, 1, 2, 3)


class Zero(BucketedReduce, GatherOnDemand, ShardedState, nn.Module):
    """ZeRO stage 1, 2 or 3 around ``module`` over ``group`` (default: the world).

    Use like the data-parallel wrapper: ``forward``, ``no_sync()`` for gradient accumulation,
    ``sync_gradients()`` after the last backward, then ``optimizer.step()`` on an optimizer built
    over :meth:`shard_parameters`, then :meth:`after_step`.
    """

    def __init__(self, module: nn.Module, stage: int, group: dist.ProcessGroup | None = None,
                 collective: str = "auto", bucket_mb: float = 25.0, reduce_dtype: torch.dtype | None = None,
                 replicate: dist.ProcessGroup | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ConfigError(f"`zero` {stage}: choose a ZeRO stage of 1, 2 or 3 (0 is plain data parallel)")
        if not bucket_mb > 0:
            raise ConfigError(f"`bucket_mb` must be positive, not {bucket_mb}")
        self._module = module
        self.reduce_dtype = reduce_dtype  # gradients travel in this dtype (None: their own)
        self.stage, self.group, self.collective = stage, group, comm.check_algorithm(collective)
        # hybrid sharding (zero.hsdp): the ranks holding the same shards, each reduced shard averaged over them
        self.replicate = replicate if replicate is not None and group_size(replicate) > 1 else None
        n, rank = group_size(group), group_rank(group)
        self.replicas = n * (group_size(self.replicate) if self.replicate is not None else 1)  # averaged over
        self._rs = comm.resolve(collective, "reduce_scatter", group)  # what `auto` means here
        self._ag = comm.resolve(collective, "all_gather", group)
        self._ar = comm.resolve(collective, "all_reduce", self.replicate)
        for g in (group, self.replicate)[:2 if self.replicate is not None else 1]:  # start from rank 0's weights,
            broadcast_module(module, src=0, group=g)  # as data parallel does (HSDP: then the first group's, across)
        owned = {id(p): (name, m, pname) for name, m in reversed(list(module.named_modules()))
                 for pname, p in m.named_parameters(recurse=False)}  # a shared parameter: its first module's
        # a parameter replicated over a group of its own (an expert shard: `sync_group`) is held whole and left
        # to that group's owner to reduce, as data parallel leaves it; the optimizer steps it as it is
        self.whole = [(name, p) for name, p in module.named_parameters() if hasattr(p, "sync_group")]
        self.units = [Unit(f"{name}.{pname}" if name else pname, m, p, n, rank)
                      for name, m in module.named_modules() for pname, p in m.named_parameters(recurse=False)
                      if owned[id(p)][1] is m and not hasattr(p, "sync_group")]
        if not self.units:
            raise ConfigError("`zero` needs a model with parameters")
        self.codes: list[Unit] = []  # stage 3: the parts of a weight held by its name (:meth:`convert_frozen`)
        self._by_module: dict[nn.Module, list[Unit]] = {}
        for unit in self.units:
            self._by_module.setdefault(unit.module, []).append(unit)
        # a module using a parameter another owns (a tied LM head): stage 3 gathers it there too
        unit_of = {id(u.param): u for u in self.units}
        shared = [(m, unit_of[id(p)]) for _, m in module.named_modules() for _, p in m.named_parameters(recurse=False)
                  if id(p) in unit_of and unit_of[id(p)].module is not m]
        for m, unit in shared:
            self._by_module.setdefault(m, []).append(unit)
        self._shared = {id(unit) for _, unit in shared}
        self._pinned = False  # inside gathered(): stage-3 hooks leave the full parameters alone
        self._syncing = True
        self._optimizer: torch.optim.Optimizer | None = None
        self.peak_bytes = 0
        self._handles = []
        self._crossing: list = []  # hybrid sharding: the reduced shards' all-reduces across the groups, under way
        self._ready: dict[nn.Module, int] = {}  # per module: parameters whose gradient arrived this backward
        self.buckets: list[Bucket] = []
        self._next_launch = 0
        if stage < 3:
            self.buckets = cut_buckets([u for u in self.units if u.trainable], int(bucket_mb * 2**20))
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
                if sharded_linear(m, [u.param for u in units]) and not any(id(u) in self._shared for u in units) \
                        and all(u.trainable for u in units):
                    m.forward = lambda x, m=m, units=units: self._linear(m, units, x)  # the weight's gradient
                    continue  # never meets the full weight (not a shared one's: its gradient has two sources)
                for unit in units:
                    if unit.module is m and unit.trainable:  # its gradient arrives once, both uses summed
                        self._handles.append(unit.param.register_post_accumulate_grad_hook(
                            lambda p, unit=unit: self._on_grad_ready(unit)))
                self._handles.append(m.register_forward_pre_hook(
                    lambda m, args, units=units: self._before_forward(m, units)))
                self._handles.append(m.register_forward_hook(
                    lambda m, args, out, units=units: self._after_forward(units, m, out, args)))

    @classmethod
    def from_strategy(cls, module: nn.Module, strategy, group: dist.ProcessGroup | None = None,
                      replicate: dist.ProcessGroup | None = None) -> "Zero":
        """``module`` over ``group`` at the strategy's ZeRO stage, collective, bucket size and wire dtype (its
        shards replicated over ``replicate``: hybrid sharding)."""
        wire = strategy.wire_dtype
        return cls(module, strategy.zero, group=group, collective=strategy.collective, bucket_mb=strategy.bucket_mb,
                   reduce_dtype=DTYPES[wire] if wire else None, replicate=replicate)

    # ------------------------------------------------------------------ the wrapped model

    @property
    def module(self) -> nn.Module:
        return self._module

    def forward(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    sharded = True  # ranks hold different model states
    needs_priming = False  # its buckets are fixed at construction: a resumed run reduces in the same ones

    def shard_parameters(self) -> list[nn.Parameter]:
        """One flat parameter per unit: this rank's shard, then each parameter held whole (an expert shard).
        Build the optimizer over these."""
        return [u.shard for u in self.units] + [p for _, p in self.whole]

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
        for name, p in self.whole:  # (reduced by their owner)
            out[name] = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
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

    # ------------------------------------------------------------------ the step

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
                self._crossed()
            finally:
                for bucket in self.buckets:
                    bucket.ready, bucket.flat, bucket.out, bucket.work = 0, None, None, None
                self._next_launch = 0
        self._drain()
        if self.stage == 3 and self._order:
            self._order_known = True
        pending = [u for u in self.units if not u.reduced and u.trainable]  # stage 3: whose backward never ran
        if pending:
            self._reduce(pending)
        self._crossed()
        self._ready.clear()
        for unit in self.units + self.codes:
            unit.reduced = False
            if self.stage == 3:
                unit.free()

    def after_step(self) -> None:
        """After ``optimizer.step()``: stages 1-2 all-gather the updated shards into the parameters."""
        self._observe()
        if self.stage < 3:  # (a frozen parameter never changes: its full copy stays)
            self._gather([u for u in self.units if u.trainable])

    # ------------------------------------------------------------------ state

    @contextlib.contextmanager
    def gathered(self, modules=None) -> Iterator[nn.Module]:
        """The full parameters (``modules``: only their own units, a shared parameter's and a weight's parts
        included) in place for the duration (collective under stage 3)."""
        if self.stage < 3 or self._pinned:
            yield self._module
            return
        units = self.units + self.codes
        if modules is not None:
            owners, params = {id(m) for m in modules}, {id(p) for m in modules for p in m.parameters(recurse=False)}
            units = [u for u in units if id(u.module) in owners or id(u.param) in params]
        self._drain()
        self._gather(units)
        self._pinned = modules is None  # (the whole model: what runs inside gathers nothing more)
        try:
            yield self._module
        finally:
            self._pinned = False
            for unit in units:
                unit.free()

    def offload_shards(self, store) -> int:
        """``--offload params``: every shard (and, as it is reduced, its gradient) held in ``store``; each gather
        reads it from there and lets its pages go. Returns how many."""
        if self.stage != 3:
            from distlab.parallel.offload import no_shards
            raise no_shards(self)
        with torch.no_grad():
            for u in self.units + self.codes:
                u.shard.data = store.holding(u.shard.detach())
                u.store = store
        return len(self.units)

    def _observe(self, *extra: torch.Tensor) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes(*extra))
