"""What the Engine asks of the plain ZeRO (:class:`~distlab.parallel.zero.plain.PlainZero`) beside the algorithm:
its shards as the optimizer's parameters, snapshots, placement and the bytes it holds. Its snapshot is the tuned
ZeRO's format (:meth:`~distlab.parallel.zero.state.ShardedState.state_from`: a shard per trainable parameter, the
frozen ones whole), so either reads the other's placement, and resharding works between them."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from distlab import comm
from distlab.errors import ConfigError, first_line
from distlab.parallel.placement import value_copy
from distlab.parallel.state_bytes import optimizer_tensors, storage_bytes
from distlab.parallel.zero.state import ShardedState as TunedState
from distlab.runtime import user_code
from distlab.runtime.meta import adopt


def implementation(spec: str, base: type) -> type:
    """The user's own ZeRO named ``spec`` (FILE.py:NAME or package.module:NAME): a subclass of ``base``
    (:class:`~distlab.parallel.zero.plain.PlainZero`, its steps rewritten), checked before launch."""
    found = user_code.load(spec, "--zero-impl", "a ZeRO")
    if not (inspect.isclass(found) and issubclass(found, base)):
        raise ConfigError(f"--zero-impl {spec}: {spec.rpartition(':')[2]} is no subclass of "
                          f"distlab.parallel.zero.plain.PlainZero: subclass it and write its sync_gradients "
                          f"(and after_step)")
    return found


def _written(step, spec: str):
    def run():
        try:
            return step()
        except NotImplementedError as exc:
            raise ConfigError(f"--zero-impl {spec}: {step.__name__} is not written yet: {first_line(exc)}") from None
    return run


class PlainZeroState:
    """The Engine's half of :class:`~distlab.parallel.zero.plain.PlainZero` (attributes set by its constructor)."""

    sharded = True
    needs_priming = False
    peak_bytes = 0
    _optimizer = None
    reads = staticmethod(TunedState.reads)
    split_state = staticmethod(TunedState.split_state)

    @classmethod
    def from_strategy(cls, module: nn.Module, strategy, group=None, replicate=None):
        """``module`` over ``group``: the plain ZeRO, or -- ``zero_impl`` FILE.py:NAME -- the user's own subclass."""
        kind = implementation(strategy.zero_impl, cls) if strategy.zero_impl != "plain" else cls
        made = kind(module, strategy.zero, group=group, collective=strategy.collective)
        for name in ("sync_gradients", "after_step"):  # (an exercise not written yet: said in one line)
            setattr(made, name, _written(getattr(made, name), strategy.zero_impl))
        return made

    @property
    def module(self) -> nn.Module:
        return self._module

    def optimizer_parameters(self) -> list[nn.Parameter]:
        return list(self.shards) + [p for _, p in self.whole]

    def _ranges(self) -> list[tuple[int, int]]:
        return [(self.rank * s, max(0, min(p.numel(), (self.rank + 1) * s) - self.rank * s))
                for (_, p), s in zip(self.params, self.size)]

    def parameter_slots(self) -> list:
        return [(name, p, r) for (name, p), r in zip(self.params, self._ranges())] + \
            [(name, p, None) for name, p in self.whole]

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        out = {}
        for (name, p), s, shard in zip(self.params, self.size, self.shards):
            full = torch.empty(s * self.n, dtype=shard.dtype, device=shard.device)
            grad = shard.grad if shard.grad is not None else torch.zeros_like(shard)
            comm.all_gather(full, grad, algorithm=self.collective, group=self.group)
            out[name] = full[:self.numel(p)].view(self.shapes[id(p)]).clone()
        return out

    def numel(self, p: nn.Parameter) -> int:
        return self.shapes[id(p)].numel()

    def offload_shards(self, store) -> int:
        from distlab.parallel.offload import no_shards
        raise no_shards(self)

    @contextlib.contextmanager
    def gathered(self, modules=None):
        """The full parameters (``modules``: only theirs) in place for the duration (stage 3: gathered and dropped
        again)."""
        if self.present:
            yield self._module
            return
        only = None if modules is None else {id(p) for m in modules for p in m.parameters(recurse=False)}
        self._gather_parameters(only)
        try:
            yield self._module
        finally:
            self._drop_parameters(only)

    def convert_frozen(self, module: nn.Module, name: str, make) -> None:
        """A frozen parameter is held whole: made in place, and held by its name."""
        old = getattr(module, name)
        setattr(module, name, make(old))
        self.whole = [(n, getattr(module, name) if p is old else p) for n, p in self.whole]

    def track(self, optimizer) -> None:
        self._optimizer = optimizer

    def observe(self, *extra: torch.Tensor) -> int:
        """The most parameter, gradient and optimizer-state bytes held so far (and ``extra``, held now)."""
        tensors = [t for (_, p), s in zip(self.params, self.shards) for t in (p, p.grad, s, s.grad)] + list(extra)
        tensors += [p for _, p in self.whole]
        self.peak_bytes = max(self.peak_bytes, storage_bytes(tensors + optimizer_tensors(self._optimizer)))
        return self.peak_bytes

    def uncounted_bytes_per_sync(self) -> int:
        return 0  # every byte goes through distlab.comm

    def sync_state_dict(self) -> dict:
        return {}

    def load_sync_state_dict(self, state: dict) -> None:
        pass

    def state_from(self, params: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        cut = len(self.params)
        return {"zero_stage": self.stage, "world_size": self.n, "rank": self.rank,
                "units": [{"name": name, "numel": self.numel(p), "shard": t}
                          for (name, p), t in zip(self.params, params[:cut])],
                "whole": [{"name": name, "numel": p.numel(), "shard": t} for (name, p), t in zip(self.whole,
                                                                                                 params[cut:])],
                "buffers": buffers}

    def sharded_state_dict(self) -> dict:
        return self.state_from([s.detach().clone() for s in self.shards] + [value_copy(p) for _, p in self.whole],
                               {k: v.detach().clone() for k, v in self._module.named_buffers()})

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore :meth:`sharded_state_dict` output of the same group size and model (its shards, frozen
        parameters and buffers), the full parameters gathered again where the stage holds them."""
        mine = self.sharded_state_dict()
        for key in ("world_size", "rank"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"sharded snapshot was written with {key} {state.get(key)}, this run has "
                                  f"{mine[key]}: resume on the same data-parallel size")
        if [(u["name"], u["numel"]) for u in state["units"]] != [(u["name"], u["numel"]) for u in mine["units"]]:
            raise ConfigError("sharded snapshot is for another model (its shards are of other parameters)")
        for (_, p), shard, saved in zip(self.params, self.shards, state["units"]):
            if shard.is_meta:  # built on the meta device: the state's tensors become the model's
                adopt(shard, saved["shard"].clone())
                adopt(p, torch.zeros((), dtype=shard.dtype, device=shard.device).expand(p.shape))
            else:
                shard.copy_(saved["shard"])
        for (_, p), saved in zip(self.whole, state.get("whole", [])):
            values = saved["shard"].view(p.shape)
            adopt(p, values.clone()) if p.is_meta else p.copy_(p.from_values(values) if hasattr(p, "from_values")
                                                               else values)
        for k, t in self._module.named_buffers():
            adopt(t, state["buffers"][k].clone()) if t.is_meta else t.copy_(state["buffers"][k])
        if self.present:
            self._gather_parameters()
