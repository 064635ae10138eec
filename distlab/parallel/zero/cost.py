"""ZeRO's bookkeeping (:class:`~distlab.parallel.zero.Zero`) replayed over sizes instead of tensors:
the same units, buckets, gathers, frees and observation points, driven by a model's traced events
(:func:`distlab.parallel.cost.trace`). Its peak equals the measured one byte for byte
(``tests/test_zero.py``), so ``distlab plan`` predicts ZeRO's memory for any world size without running.
"""

from __future__ import annotations

import dataclasses
import math

from distlab.errors import ConfigError
from distlab.parallel.cost import (Call, Optim, PlannedCalls, block_index, blocks_of, data_parallel_bytes, resolved,
                                   textbook_parts, under)
from distlab.parallel.precision import DTYPES
from distlab.parallel.zero.hsdp import shard_ways
from distlab.parallel.zero.units import goes_alone


class _Flags(list):
    """A flag per unit and the total weight of those set, kept as they change: ZeroReplay.held reads it at every
    observation point, where adding up every unit made the replay, and a search's hundreds of them, quadratic."""

    def __init__(self, flags, weights: list[int]):
        super().__init__(bool(f) for f in flags)
        self.weights = weights
        self.total = sum(w for f, w in zip(self, weights) if f)

    def __setitem__(self, i: int, value) -> None:
        value = bool(value)
        if list.__getitem__(self, i) != value:
            self.total += self.weights[i] if value else -self.weights[i]
        list.__setitem__(self, i, value)


class ZeroReplay:
    """ZeRO's bookkeeping (distlab.parallel.zero.Zero) over sizes instead of tensors."""

    def __init__(self, t, stage: int, world: int, optim: Optim, bucket_mb: float = 25.0, wire_size: int | None = None,
                 recompute: bool = False, ep: int = 1):
        self.t, self.stage, self.n = t, stage, world
        e = t.element_size
        self.we = wire_size or e  # what a gradient travels in: a narrower dtype's copies are its size
        # a parameter replicated over a group of its own (an expert shard) is held whole, its gradient reduced by
        # its owner, never gathered or freed (Zero.whole)
        # and so is a 4-bit weight under stages 1-2 (which hold every parameter whole); stage 3 shards each of its
        # codes and scales as a unit (Zero.codes): a unit of several tensors here, each padded and cut
        self.whole = set(whole_units(t, ep)) | {u for u, kind in enumerate(t.base) if kind == "nf4" and stage < 3}
        self.shard = [n if u in self.whole else math.ceil(n / world) for u, n in enumerate(t.numels)]
        self.padded = [s * (1 if u in self.whole else world) for u, s in enumerate(self.shard)]
        self.e = e
        tensors = [t.tensors(u) for u in range(len(t.numels))]  # (a frozen base's: bf16, or 4-bit parts)
        cut = [sum((k if u in self.whole else math.ceil(k / world)) * b for k, b in parts)
               for u, parts in enumerate(tensors)]
        # every unit's shard, always held -- on the device, or (--offload params) the sharded ones in the store
        self.shard_bytes = sum(c for u, c in enumerate(cut) if u in self.whole or optim.offload != "params")
        self.offloaded = optim.offload == "params"
        self.train = [t.trains(u) for u in range(len(t.numels))]  # False: frozen -- gathered, never reduced
        self.optim_bytes = sum(optim.unit(t.matrix(u)).bytes(s, e) for u, (s, keep) in enumerate(zip(self.shard,
                                                                                                   self.train)) if keep)
        self.units_of: dict[int, list[int]] = {}  # (a module holding only whole units: none, so no hooks)
        for u, m in enumerate(t.module_of):
            if u not in self.whole:
                self.units_of.setdefault(m, []).append(u)
        shared = t.shared  # a module using another's parameter (a tied LM head): gathers it too
        for m, units in shared.items():
            self.units_of.setdefault(m, []).extend(units)
        self.gathered_bytes = [0 if u in self.whole else sum(math.ceil(k / world) * world * b for k, b in parts)
                               for u, parts in enumerate(tensors)]
        self.gathered = [stage < 3] * len(t.numels)
        self.reduced = [False] * len(t.numels)
        self.outs: list[int] = []  # reduce-scatter outputs held as shard gradients (bytes)
        self.ready: dict[int, int] = {}
        self.peak = 0
        # stage 3: sharded Linears (their weight gradient lands in a padded buffer) and prefetching
        self.linear = [bool(t.sharded_linear[m]) if m < len(t.sharded_linear) else False
                       for m in range(len(t.module_of) and max([*t.module_of, *shared]) + 1)]
        self.grad_bytes = [(self.padded[u] if self.linear[t.module_of[u]] and u not in self.whole
                            and self.first_of_module(u) else self.shard[u] if u in self.whole else n) * e
                           for u, n in enumerate(t.numels)]
        self.has_grad = [False] * len(t.numels)
        self.order: dict[bool, list[int]] = {True: [], False: []}  # forward / backward gather order of step 1
        self.order_known = False
        self.prefetched: set[int] = set()
        # activation checkpointing: each block's modules, and their forward events, run again in backward
        self.block_of: dict[int, int] = {}
        self.within: set[int] | None = None  # a recomputed block's modules: the only ones prefetched meanwhile
        blocks = t.blocks[::int(recompute)] if recompute else []  # (one in every `recompute`)
        index, inside = block_index(blocks), {}
        for m, units in self.units_of.items():
            if t.module_of[units[0]] == m and (found := blocks_of(t.names[units[0]].rsplit(".", 1)[0], index)):
                inside[m], self.block_of[m] = found, max(found)
        self.block_events: list[list[tuple[str, int]]] = [[] for _ in blocks]
        for kind, m in t.events:
            for b in inside.get(m, ()) if kind in ("fwd", "fwd_done") else ():
                self.block_events[b].append((kind, m))
        # stages 1-2: buckets of units in reverse order, as distlab.parallel.zero._buckets cuts them
        self.buckets: list[list[int]] = []
        cap, size = int(bucket_mb * 2**20), 0
        for u in (u for u in reversed(range(len(t.numels))) if self.train[u] and u not in self.whole):
            if self.buckets and self.buckets[-1] and size + self.padded[u] * e > cap:
                self.buckets.append([])
                size = 0
            if not self.buckets:
                self.buckets.append([])
            self.buckets[-1].append(u)
            size += self.padded[u] * e
        self.bucket_of = {u: b for b, units in enumerate(self.buckets) for u in units}
        self.flats: dict[int, int] = {}  # buckets in flight: bytes of their rank-major gradient buffer
        self.out_at: dict[int, int] = {}  # buckets in flight: where their reduce-scatter output sits in outs
        self.next_launch = 0
        self.bucket_ready = [0] * len(self.buckets)

    def first_of_module(self, u: int) -> bool:
        return self.units_of[self.t.module_of[u]][0] == u

    @property
    def gathered(self) -> _Flags:  # units whose whole parameter is present
        return self._gathered

    @gathered.setter
    def gathered(self, flags) -> None:
        self._gathered = _Flags(flags, self.gathered_bytes)

    @property
    def has_grad(self) -> _Flags:  # units whose gradient is held
        return self._has_grad

    @has_grad.setter
    def has_grad(self, flags) -> None:
        self._has_grad = _Flags(flags, self.grad_bytes)

    def held(self, extra: int = 0) -> int:
        return self.gathered.total + self.shard_bytes + self.optim_bytes + sum(self.outs) + extra + self.has_grad.total

    def fetch(self, m: int, forward: bool) -> None:
        """Zero._fetch: the module's parameters present, then the next module's gather started."""
        units = self.units_of[m]
        self.prefetched.discard(m)
        for u in units:
            self.gathered[u] = True
        self.observe()
        order = self.order[forward]
        if not self.order_known:
            if m not in order:
                order.append(m)
            return
        i = order.index(m) if m in order else None
        if i is not None and i + 1 < len(order):
            nxt = order[i + 1]
            if nxt not in self.prefetched and not all(self.gathered[u] for u in self.units_of[nxt]) and \
                    (self.within is None or nxt in self.within):
                self.prefetched.add(nxt)
                for u in self.units_of[nxt]:
                    self.gathered[u] = True
                self.observe()

    def free(self, m: int) -> None:
        for u in self.units_of[m]:
            self.gathered[u] = False

    def recompute(self, block: int, done: set[int]) -> None:
        """Activation checkpointing's forward of ``block`` again in backward: each module gathered (prefetching
        within the block only) and freed, as its first forward did."""
        done.add(block)
        self.within = {m for m, b in self.block_of.items() if b == block}
        for kind, m in self.block_events[block]:
            if kind == "fwd":
                self.fetch(m, forward=True)
            else:
                self.free(m)
        self.within = None

    def observe(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.held(extra))

    def groups(self, units: list[int]) -> list[list[int]]:
        alone = [u for u in units if goes_alone(self.t.numels[u])]
        small = [u for u in units if not goes_alone(self.t.numels[u])]
        return [[u] for u in alone] + ([small] if small else [])

    def reduce(self, units: list[int]) -> None:
        for group in self.groups(units):
            # a flat padded copy of each gradient that needs padding, then (several units) their concatenation
            if self.we != self.e:  # each gradient cast to the wire dtype: a copy of every one
                extra = sum(self.padded[u] * self.we for u in group)
            else:
                extra = sum(self.padded[u] * self.e for u in group if not self.has_grad[u]
                            or self.grad_bytes[u] != self.padded[u] * self.e)
            if len(group) > 1:
                extra += sum(self.padded[u] for u in group) * self.we
            self.observe(extra)
            # the shards' gradients: held on the device, or (--offload params) copied off it at once
            self.outs.append(0 if self.offloaded else sum(self.shard[u] for u in group) * self.e)
            for u in group:
                self.reduced[u] = True
                self.has_grad[u] = False

    def held_buckets(self) -> int:
        return sum(self.flats.values())

    def finish(self, b: int) -> None:
        """Zero._finish: the bucket's buffer gone, its output the shards' gradients (cast back from the wire)."""
        if self.flats.pop(b, None) is not None:
            self.outs[self.out_at.pop(b)] = sum(self.shard[u] for u in self.buckets[b]) * self.e

    def launch_ready(self) -> None:
        """Zero._launch_ready: buckets whose gradients are all in, in index order."""
        while (self.next_launch < len(self.buckets)
               and self.bucket_ready[self.next_launch] >= len(self.buckets[self.next_launch])):
            b = self.next_launch
            if self.stage == 2 and b >= 1:
                self.finish(b - 1)  # the bucket before completes first
            units = self.buckets[b]
            self.flats[b] = sum(self.padded[u] for u in units) * self.we
            for u in units:
                self.has_grad[u] = False
            self.out_at[b] = len(self.outs)
            self.outs.append(sum(self.shard[u] for u in units) * self.we)
            self.observe(self.held_buckets())
            self.next_launch += 1

    def step(self, micro_batches: int) -> None:
        """One optimizer step in steady state (optimizer state exists)."""
        self.outs = []  # zero_grad(set_to_none=True)
        for u in self.whole:
            self.has_grad[u] = False
        if self.stage < 3:
            self.bucket_step(micro_batches)
            return
        for i in range(micro_batches):
            syncing = i == micro_batches - 1
            recomputed: set[int] = set()
            for kind, k in self.t.events:
                if kind == "grad" and k in self.whole:  # reduced by its owner after the sync
                    self.has_grad[k] = True
                    continue
                if kind != "grad" and k not in self.units_of:  # a module ZeRO does not hook
                    continue
                block = self.block_of.get(k) if kind == "bwd" else None
                if block is not None and block not in recomputed:
                    self.recompute(block, recomputed)  # backward entering the block recomputes its forward
                if kind == "fwd":
                    self.fetch(k, forward=True)
                elif kind == "fwd_done":
                    self.free(k)
                elif kind == "bwd" and self.linear[k]:  # _ShardedLinear.backward
                    if self.t.input_grad[k]:
                        self.fetch(k, forward=False)
                        self.free(k)
                    units = self.units_of[k]
                    for u in units:
                        self.has_grad[u] = True
                    if syncing:
                        self.reduce(units)
                elif kind == "bwd":
                    if k in self.prefetched or not all(self.gathered[u] for u in self.units_of[k]):
                        self.fetch(k, forward=False)
                elif kind == "grad" and not self.linear[self.t.module_of[k]]:
                    self.has_grad[k] = True
                    m = self.t.module_of[k]
                    owned = [u for u in self.units_of[m] if self.t.module_of[u] == m and self.train[u]]
                    count = self.ready.get(m, 0) + 1
                    if count < len(owned):
                        self.ready[m] = count
                        continue
                    self.ready[m] = 0
                    if syncing:
                        self.reduce(owned)
                    for u in owned:
                        self.gathered[u] = False
                elif kind == "release":  # a module's frozen parameters, once its inputs have their gradients
                    for u in self.units_of[k]:
                        if self.t.module_of[u] == k and not self.train[u]:
                            self.gathered[u] = False
        for m in list(self.prefetched):  # Zero._drain
            self.prefetched.discard(m)
            self.free(m)
        self.order_known = self.order_known or bool(self.order[True])
        pending = [u for u in range(len(self.reduced)) if not self.reduced[u] and self.train[u] and u not in self.whole]
        if pending:
            self.reduce(pending)
        self.ready.clear()
        self.reduced = [False] * len(self.reduced)
        if self.stage == 3:
            self.gathered = [False] * len(self.gathered)
        self.observe()  # after_step
        if self.stage < 3:
            self.gathered = [True] * len(self.gathered)

    def bucket_step(self, micro_batches: int) -> None:
        """Stages 1-2: gradients reduce-scattered in buckets as backward fills them."""
        for i in range(micro_batches):
            syncing = i == micro_batches - 1
            for kind, k in self.t.events:
                if kind == "grad":
                    self.has_grad[k] = True
                    if syncing and k not in self.whole:
                        self.bucket_ready[self.bucket_of[k]] += 1
                        self.launch_ready()
        self.bucket_ready = [len(units) for units in self.buckets]  # sync_gradients: the rest count as zero
        self.launch_ready()
        for b in list(self.flats):
            self.finish(b)
        self.next_launch = 0
        self.bucket_ready = [0] * len(self.buckets)
        self.observe()  # after_step



def whole_units(t, ep: int) -> list[int]:
    """The units ZeRO holds whole beside ``ep``-way expert parallel: the expert shards (their own group's)."""
    experts = set(t.expert_names) if ep > 1 else set()
    return [u for u, name in enumerate(t.names) if name in experts]


def zero_peak_bytes(t, stage: int, world: int, optim: Optim, grad_accum: int = 1,
                    bucket_mb: float = 25.0, wire_size: int | None = None, recompute: bool = False,
                    ep: int = 1) -> int:
    """The peak of parameters + gradients + optimizer state one rank holds under ZeRO ``stage``
    (stages 1-2 reduce in buckets of ``bucket_mb``; gradients travel in ``wire_size``-byte elements,
    default their own; ``recompute``: activation checkpointing runs each block's forward -- one block in every
    ``recompute`` -- again in backward; ``ep``: expert parallel's shards held whole, :func:`whole_units`)."""
    if stage == 0:
        return data_parallel_bytes(t, optim)
    if stage not in (1, 2, 3):
        raise ConfigError(f"ZeRO stage {stage}: choose 0, 1, 2 or 3")
    if world < 1:
        raise ConfigError(f"world size {world}: must be at least 1")
    key = ("zero", stage, world, optim, grad_accum, bucket_mb, wire_size, recompute, ep)
    if key not in t.memo:  # the trace keeps what was replayed on it (a search asks again and again)
        sim = ZeroReplay(t, stage, world, optim, bucket_mb, wire_size, recompute, ep)
        sim.step(grad_accum)
        sim.step(grad_accum)  # the second step starts from the first one's leftovers: steady state
        t.memo[key] = sim.peak
    return t.memo[key]


def _zero_buckets(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """ZeRO's buckets (:func:`distlab.parallel.zero.units._buckets`: a bucket closes *before* the
    unit that would overflow it) as (bytes, bytes of gradients ready when it is launched)."""
    out, cur, done = [], 0, 0
    for s in sizes:
        if cur and cur + s > cap:
            out.append((cur, done))
            cur = 0
        cur += s
        done += s
    if cur:
        out.append((cur, done))
    return out


class ZeroCost:
    """What :class:`~distlab.parallel.zero.Zero` sends and holds, on a model's sizes (the plan's model of it)."""

    @staticmethod
    def planned_calls(t, strategy, n: int) -> PlannedCalls:
        """Stages 1-2: bucketed reduce-scatters overlapped with backward, then one all-gather per
        collective batch after the optimizer step; stage 3: each module's reduce-scatter as its
        gradients arrive, and its all-gathers before forward and before backward (exposed). Hybrid sharding
        (:mod:`~distlab.parallel.zero.hsdp`): those inside a shard group, each reduce-scatter's shard then
        all-reduced across the groups."""
        s = shard_ways(strategy, n)
        if n == 1:
            return PlannedCalls()
        calls = ZeroCost._calls(t, strategy, s)  # (a shard group of one rank: calls that send nothing)
        if s == n:
            return calls
        mark = lambda cs: [dataclasses.replace(c, ranks=s, span="shard") for c in cs]  # noqa: E731
        ar = resolved(strategy.collective, "all_reduce")
        across = [Call(ar, "all_reduce", c.nbytes / s, c.ready, c.itemsize, ranks=n // s, span="replicate")
                  for c in calls.during_backward]
        return PlannedCalls(mark(calls.before_layers), [*mark(calls.during_backward), *across],
                            mark(calls.after_backward), mark(calls.after_step))

    @staticmethod
    def _calls(t, strategy, n: int) -> PlannedCalls:
        padded = [sum(math.ceil(k / n) * n * b for k, b in t.tensors(u)) for u in range(len(t.numels))]
        e = t.element_size
        modules: dict[int, list[int]] = {}
        for u, m in enumerate(t.module_of):
            modules.setdefault(m, []).append(u)

        def groups(units):  # the collective batches of Zero._groups
            alone = [[u] for u in units if goes_alone(t.numels[u])]
            small = [u for u in units if not goes_alone(t.numels[u])]
            return alone + ([small] if small else [])

        trains = [u for u in range(len(padded)) if t.trains(u)]  # a frozen base is gathered, never reduced
        per_module = [sum(padded[u] for u in g) for m in modules.values()
                      for g in groups([u for u in m if t.trains(u)])]
        everything = [sum(padded[u] for u in g) for g in groups(trains)]
        rs, ag = resolved(strategy.collective, "reduce_scatter"), resolved(strategy.collective, "all_gather")
        wire = strategy.wire_dtype  # gradients reduce-scattered in a narrower dtype
        narrow = DTYPES[wire].itemsize / e if wire else 1.0
        if strategy.zero < 3:
            sizes = [padded[u] for u in reversed(trains)]
            buckets = _zero_buckets(sizes, int(strategy.bucket_mb * 2**20))
            return PlannedCalls(during_backward=[Call(rs, "reduce_scatter", b * narrow, done / sum(sizes))
                                                 for b, done in buckets],
                                after_step=[Call(ag, "all_gather", b) for b in everything])
        done, overlapped = 0, []
        for b in reversed(per_module):  # backward reaches the last layers first
            done += b
            overlapped.append(Call(rs, "reduce_scatter", b * narrow, done / sum(per_module)))
        # gathered before each forward (again where checkpointing recomputes it) and before its backward
        # where backward needs the weights: a Linear's where its input needs a gradient, any other module's
        # where backward reaches it (zero.gather)
        backward = {m for kind, m in t.events if kind == "bwd"}
        recomputed = {name for block in strategy.checkpointed(t.blocks) for name in block}
        gathers = []
        for m, units in modules.items():
            times = 1 + under(t.names[units[0]].rsplit(".", 1)[0], recomputed)
            times += (t.input_grad[m] if t.sharded_linear[m] else m in backward) if t.sharded_linear else 1
            gathers += [Call(ag, "all_gather", sum(padded[u] for u in g), 0.0) for g in groups(units)] * times
        # a module using another's parameter (a tied LM head, outside the checkpointed blocks) gathers it before
        # its forward; in backward the parameter stays gathered from the first module that needs it until its
        # gradient is complete, so the holder's backward gather is the one
        for m, units in t.shared.items():
            gathers += [Call(ag, "all_gather", sum(padded[u] for u in g), 0.0) for g in groups(units)]
        # every micro-batch of the step gathers again (the reduce-scatters: the last one's backward only)
        return PlannedCalls(before_layers=gathers * strategy.micro_steps, during_backward=overlapped)

    @staticmethod
    def planned_parts(numels: list[int], optim: Optim, element_size: int, strategy, n: int,
                      trainable: list[bool] | None = None, held: list | None = None,
                      matrices: list[bool] | None = None) -> dict[str, int]:
        """The textbook split of what stage ``strategy.zero`` shards (ZeRO paper, table 1)."""
        return textbook_parts(numels, optim, element_size, strategy.zero, shard_ways(strategy, n), trainable, held,
                              matrices)

    @staticmethod
    def planned_memory(t, optim: Optim, strategy, n: int) -> int:
        """The exact peak (:func:`zero_peak_bytes`)."""
        wire = strategy.wire_dtype
        return zero_peak_bytes(t, strategy.zero, shard_ways(strategy, n), optim, strategy.grad_accum,
                               strategy.bucket_mb, DTYPES[wire].itemsize if wire else None,
                               strategy.ac_every if strategy.activation_checkpointing else 0, strategy.ep)

    @staticmethod
    def planned_extra_state(t, strategy, n: int) -> int:
        return 0  # its casts have no memory (PowerSGD is refused with ZeRO)
