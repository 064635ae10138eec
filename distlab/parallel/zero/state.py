"""ZeRO's state: this rank's shards and buffers for snapshots, where they sit in the whole model
(placement), and the bytes of model state it holds (the peak ``plan`` predicts exactly)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from distlab.errors import ConfigError
from distlab.parallel.placement import value_copy
from distlab.parallel.state_bytes import optimizer_tensors, storage_bytes
from distlab.parallel.zero.units import Unit
from distlab.runtime import group_rank, group_size
from distlab.runtime.meta import adopt


class ShardedState:
    """The state half of :class:`~distlab.parallel.zero.Zero` (attributes set by its constructor)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict`` (collective under stage 3; every rank gets it)."""
        with self.gathered() as m:
            return {k: v.detach().clone() for k, v in m.state_dict().items()}

    def sync_state_dict(self) -> dict:
        """Nothing carries over between ZeRO's gradient syncs (its casts have no memory)."""
        return {}

    def load_sync_state_dict(self, state: dict) -> None:
        pass

    def convert_frozen(self, module: nn.Module, name: str, make) -> None:
        """The unit of ``module``'s frozen parameter ``name`` leaves ZeRO: gathered (stage 3), made into
        ``make(whole values)``, held by its name like an expert shard (:attr:`whole`: whole in state dicts) -- its
        buffer and shard freed. Under stage 3 a made tensor of tensors (a 4-bit weight: its codes and scales, as
        ``__tensor_flatten__`` names them) is sharded by its parts, each a unit of :attr:`codes` gathered and freed
        with ``module``'s other units; stages 1-2 hold every parameter whole anyway."""
        param = getattr(module, name)
        unit = next((u for u in self.units if u.module is module and u.param is param), None)
        if unit is None or unit.trainable:
            raise ValueError(f"ZeRO converts a frozen parameter it shards; {type(module).__name__}.{name} is not one")
        if not unit.gathered:
            self._gather([unit])
        made = make(param)
        self.units.remove(unit)
        for units in self._by_module.values():  # (the stage-3 hooks read these lists)
            if unit in units:
                units.remove(unit)
        unit.free()
        unit.shard = None
        setattr(module, name, made)
        self.whole.append((unit.name, made))
        if self.stage == 3 and hasattr(made, "__tensor_flatten__"):
            for part in made.__tensor_flatten__()[0]:
                held = nn.Parameter(getattr(made, part), requires_grad=False)
                code = Unit(f"{unit.name}.{part}", module, held, unit.n, unit.rank)  # (its values now in the unit)
                setattr(made, part, held)
                code.free()
                self.codes.append(code)
                self._by_module[module].append(code)

    @contextlib.contextmanager
    def _codes_present(self):
        """Stage 3: the parts of the weights held by their name (:attr:`codes`) gathered for the duration
        (collective); written to, each rank's shard taken back from them at the end."""
        if not self.codes or self._pinned:
            yield
            return
        self._gather(self.codes)
        try:
            yield
            with torch.no_grad():
                for u in self.codes:
                    u.shard.copy_(u.full[u.rank * u.shard_numel:(u.rank + 1) * u.shard_numel])
        finally:
            for u in self.codes:
                u.free()

    def sharded_state_dict(self) -> dict:
        """This rank's part: its shards and buffers (a snapshot writes one per rank)."""
        with self._codes_present():
            whole = [value_copy(p) for _, p in self.whole]
        return self.state_from([u.shard.detach().clone() for u in self.units] + whole,
                               {k: v.detach().clone() for k, v in self._module.named_buffers()})

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore :meth:`sharded_state_dict` output; a different layout is refused, naming it. Every
        rank of the group says whether its part loaded (one all-reduce) before the full parameters are
        gathered, so one rank's unusable part fails every rank here, none waiting in the gather."""
        problem = None
        try:
            self._copy_in(state)
        except (ConfigError, KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            problem = exc
        verdict = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=self.units[0].shard.device)
        for group in [self.group] + ([self.replicate] if self.replicate is not None else []):  # (HSDP: and across)
            if group_size(group) > 1:
                dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
        if problem is not None:
            raise problem if isinstance(problem, ConfigError) else \
                ConfigError(f"sharded snapshot does not fit this model: {type(problem).__name__}: {problem}")
        if verdict.item():
            raise ConfigError("sharded snapshot: another rank's part of it does not fit this model")
        gathered = [u for u in self.units if u.gathered]
        if gathered:
            self._gather(gathered)

    def _copy_in(self, state: dict) -> None:
        """This rank's shards and buffers from ``state`` (local: no communication)."""
        mine = self.sharded_state_dict()
        for key in ("zero_stage", "world_size", "rank"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"sharded snapshot was written with {key} {state.get(key)}, this run has "
                                  f"{mine[key]}: resume with the same `zero` and data-parallel size")
        theirs = [(u["name"], u["numel"]) for u in state["units"] + state.get("whole", [])]
        ours = [(u["name"], u["numel"]) for u in mine["units"] + mine["whole"]]
        if theirs != ours:
            if len(theirs) != len(ours):
                raise ConfigError(f"sharded snapshot is for another model: it has {len(theirs)} parameters, this "
                                  f"model {len(ours)}")
            (a, na), (b, nb) = next((x, y) for x, y in zip(theirs, ours) if x != y)
            raise ConfigError(f"sharded snapshot is for another model: its parameter {a} has {na} elements, this "
                              f"model's {b} has {nb}")
        if self.units[0].shard.is_meta:  # built on the meta device: the state's tensors become the model's
            for unit, saved in zip(self.units, state["units"]):
                unit.adopt(saved["shard"])
            for (_, p), saved in zip(self.whole, state["whole"]):
                adopt(p, saved["shard"].view(p.shape))
            for k, t in self._module.named_buffers():
                adopt(t, state["buffers"][k])
            return
        with torch.no_grad(), self._codes_present():
            for unit, saved in zip(self.units, state["units"]):
                unit.shard.copy_(saved["shard"])
            for (_, p), saved in zip(self.whole, state["whole"]):
                values = saved["shard"].view(p.shape)  # (a 4-bit weight: quantized again, into its parts)
                p.copy_(p.from_values(values) if hasattr(p, "from_values") else values)
            for k, t in self._module.named_buffers():  # (a tied parameter's second name is no buffer of its own)
                t.copy_(state["buffers"][k])

    def parameter_slots(self) -> list[tuple[str, nn.Parameter, tuple[int, int] | None]]:
        """(key, parameter, flat range) of each optimizer parameter: this rank's range of each unit, then each
        parameter held whole (no range)."""
        return [(u.name, u.param, (u.rank * u.shard_numel,
                                   max(0, min(u.numel, (u.rank + 1) * u.shard_numel) - u.rank * u.shard_numel)))
                for u in self.units] + [(name, p, None) for name, p in self.whole]

    @staticmethod
    def reads(state: dict) -> bool:
        """Whether ``state`` is a :meth:`sharded_state_dict` of ZeRO (of any stage and group size)."""
        return "zero_stage" in state

    @staticmethod
    def split_state(state: dict, keys: list[str]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """A :meth:`sharded_state_dict` as (the optimizer parameters' tensors: the shards and the parameters held
        whole, the buffers)."""
        return [u["shard"] for u in state["units"] + state.get("whole", [])], dict(state["buffers"])

    def state_from(self, params: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        """The :meth:`sharded_state_dict` holding ``params`` (the shards in unit order, then the parameters held
        whole) and ``buffers``."""
        cut = len(self.units)
        return {"zero_stage": self.stage, "world_size": group_size(self.group), "rank": group_rank(self.group),
                "units": [{"name": u.name, "numel": u.numel, "shard": t} for u, t in zip(self.units, params[:cut])],
                "whole": [{"name": name, "numel": p.numel(), "shard": t} for (name, p), t in zip(self.whole,
                                                                                                 params[cut:])],
                "buffers": buffers}

    def held_bytes(self, *extra: torch.Tensor) -> int:
        """Bytes of parameters + gradients + optimizer state this rank holds right now."""
        tensors = [t for u in self.units for t in (u.full, u.shard, u.shard.grad, u.param.grad)]
        tensors += [t for u in self.codes for t in (u.full, u.shard)]
        tensors += [t for _, p in self.whole for t in (p, p.grad)]
        tensors += [t for b in self.buckets for t in (b.flat, b.out)]
        return storage_bytes(tensors + list(extra) + optimizer_tensors(self._optimizer))

    def _observe(self, *extra: torch.Tensor) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes(*extra))
