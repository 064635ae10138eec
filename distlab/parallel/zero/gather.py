"""ZeRO stage 3's parameters on demand: a module's units are all-gathered before its forward and its
backward and freed after; from the second step the next module's gather (by the first step's
orders) is started while the current one computes; a plain ``nn.Linear`` runs as
:class:`_ShardedLinear`, whose weight gradient never meets the full weight. Stages 1-2 use
:meth:`GatherOnDemand._gather` after the optimizer step."""

from __future__ import annotations

import torch
from torch import nn

from distlab import comm
from distlab.parallel import step_ahead
from distlab.parallel.checkpointing import recomputing
from distlab.parallel.zero.units import Unit, describe
from distlab.runtime import timeline
from distlab.runtime.eager import eager


class GatherOnDemand:
    """The gather half of :class:`~distlab.parallel.zero.Zero` (attributes set by its constructor)."""

    @eager  # run as it is under --compile: a graph break, never traced
    def _before_forward(self, module: nn.Module, units: list[Unit]) -> None:
        if self._pinned:
            return
        self._fetch(module, units, forward=True)

    @eager  # run as it is under --compile: a graph break, never traced
    def _after_forward(self, units: list[Unit], module: nn.Module, out, args=()) -> None:
        if self._pinned:
            return
        for unit in units:
            unit.free()
        if not torch.is_grad_enabled():
            return
        nodes = {t.grad_fn for t in _flatten(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        for node in nodes:  # backward reaches the module's own nodes only through its outputs' nodes
            node.register_prehook(lambda grads, module=module, units=units: self._before_backward(module, units))
        frozen = [u for u in units if not u.trainable and u.module is module]
        if nodes and frozen:  # frozen parameters (a base under adapters): no gradient of theirs says when the
            # module's backward ends; its inputs' gradients do (where its input needs none: the step's end)
            inputs = [t for t in _flatten(args) if isinstance(t, torch.Tensor) and t.requires_grad]
            if inputs:
                torch.autograd.graph.register_multi_grad_hook(inputs, lambda grads, units=frozen: self._release(units))

    def _release(self, units: list[Unit]) -> None:
        if not self._pinned:
            for unit in units:
                unit.free()

    def _before_backward(self, module: nn.Module, units: list[Unit]) -> None:
        if module in self._prefetched or not all(u.gathered for u in units):  # prefetched: still arriving
            self._fetch(module, units, forward=False)

    def _fetch(self, module: nn.Module, units: list[Unit], forward: bool) -> None:
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
            block = recomputing() if forward else None  # a recomputed block's forward: its own modules only
            if following not in self._prefetched and not all(u.gathered for u in ahead) and \
                    (block is None or id(following) in block):
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

    @eager  # run as it is under --compile: a graph break, never traced
    def _linear(self, module: nn.Module, units: list[Unit], x: torch.Tensor) -> torch.Tensor:
        if self._pinned:
            return nn.functional.linear(x, module.weight, module.bias)
        return _ShardedLinear.apply(x, self, module, units, *[u.shard for u in units])

    def _linear_grads(self, units: list[Unit], g: torch.Tensor, x: torch.Tensor) -> None:
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

    def _on_grad_ready(self, unit: Unit) -> None:
        """Once every parameter of a module has its gradient: reduce-scatter them (one collective)."""
        units = [u for u in self._by_module[unit.module] if u.module is unit.module and u.trainable]
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

    def _gather(self, units: list[Unit], wait: bool = True):
        """All-gather the shards of ``units`` into their full parameters. Every collective is
        started before the first is waited for (native: ``async_op``; distlab's algorithms: on the
        communication thread when there is one); ``wait=False`` returns them unfinished, for
        :meth:`_finish_gather`. (``--offload-overlap``: the shards' steps, still running beside the forward, are
        waited for first.)"""
        step_ahead.ready(u.shard for u in units if u.trainable)
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
            if timeline.active():
                size = out.numel() * out.element_size()
                timeline.async_span(f"{'all-gather' if wait else 'prefetch'} {describe(group)} {timeline.size_text(size)}",
                                    work, bytes=size)
            pending.append((group, out, work))
        if not wait:
            return pending
        self._finish_gather(pending)
        return None

    @staticmethod
    def _finish_gather(pending) -> None:
        for group, out, work in pending:
            with timeline.span("wait for all-gather"):
                work.wait()
            for u in group:  # (an offloaded shard: read, let go)
                u.release()
            if len(group) > 1:
                offset = 0
                for u in group:  # row r holds rank r's shards of every unit, one after another
                    u.full.view(u.n, u.shard_numel).copy_(out[:, offset:offset + u.shard_numel])
                    offset += u.shard_numel


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
