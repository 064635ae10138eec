"""Data parallel: one wrapper over a gradient-sync method, the methods registered by name.

Every rank holds the whole model and runs forward and backward on its own slice of the global
batch; the sync method (``--dp-sync``: gather-scatter, allreduce, bucketed, ddp) then makes each
rank's ``.grad`` the mean over the whole global batch, so the optimizer step is the single-process
step on that batch (see ``distlab.data.sampler`` for why the slices make up the sequential
minibatch). :class:`DataParallel` is the gradient sync the Engine drives: construction broadcasts
rank 0's model, ``sync_gradients`` and ``no_sync`` hand over to the method, and it reports the
bytes, state and slots the Engine and snapshots ask for. The methods: :mod:`distlab.parallel.sync_methods`
(the interface, ``gather-scatter``, ``allreduce``) and :mod:`distlab.parallel.bucketed_sync`
(``bucketed``, ``ddp``); adding one is a class plus a line in :data:`SYNC_METHODS`.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn

from distlab.errors import ConfigError
from distlab.parallel.compression import build_codec
from distlab.parallel.state_bytes import model_state_bytes
from distlab.parallel.bucketed_plain import PlainBucketedSync
from distlab.parallel.bucketed_sync import BucketedSync, TorchDDPSync
from distlab.parallel.sync_methods import COLLECTIVES, AllReduceSync, GatherScatterSync, SyncMethod
from distlab.runtime import broadcast_module, user_code
from distlab.runtime.meta import adopt, on_meta


SYNC_METHODS: dict[str, type[SyncMethod]] = {
    "gather-scatter": GatherScatterSync,
    "allreduce": AllReduceSync,
    "bucketed": BucketedSync,
    "bucketed_plain": PlainBucketedSync,  # (the bucketed sync as the idea reads: its oracle)
    "ddp": TorchDDPSync,
}
BUILT_IN = tuple(SYNC_METHODS)  # (a user's own, once named, joins SYNC_METHODS too)
__all__ = ["COLLECTIVES", "SYNC_METHODS", "DataParallel", "sync_method"]


def sync_method(name: str) -> type[SyncMethod]:
    """The sync method ``name``: a registered one, or -- ``FILE.py:NAME`` or ``package.module:NAME`` -- the user's
    own :class:`~distlab.parallel.sync_methods.SyncMethod` subclass, loaded and registered under that name."""
    if name not in SYNC_METHODS and user_code.is_user_code(name):
        found = user_code.load(name, "--dp-sync", "a gradient sync")
        attr = name.rpartition(":")[2]
        if not (inspect.isclass(found) and issubclass(found, SyncMethod)):
            raise ConfigError(f"--dp-sync {name}: {attr} is no subclass of distlab.parallel.SyncMethod: subclass it "
                              f"and write its sync(module), which makes every rank's .grad the global mean")
        if found.sync is SyncMethod.sync:
            raise ConfigError(f"--dp-sync {name}: {attr} defines no sync(module): write it (every rank's .grad made "
                              f"the mean over the group, with distlab.comm's collectives so their bytes count)")
        SYNC_METHODS[name] = found
    if name not in SYNC_METHODS:
        raise ConfigError(f"unknown `dp_sync` {name!r}; choose one of: {', '.join(BUILT_IN)}, or your own "
                          f"SyncMethod subclass as path/to/file.py:NAME or package.module:NAME")
    return SYNC_METHODS[name]


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training with the sync method ``method``.

    Construction broadcasts rank 0's parameters and buffers, so replicas start equal. Call
    ``sync_gradients()`` after ``backward()`` and before ``optimizer.step()``; inside
    ``no_sync()`` backward accumulates locally and communicates nothing.
    """

    def __init__(self, module: nn.Module, method: str = "allreduce", group: dist.ProcessGroup | None = None,
                 broadcast: bool = True, **options):
        super().__init__()
        kind = sync_method(method)
        if broadcast:
            broadcast_module(module, src=0, group=group)
        self.method = kind(group, **options)
        self.wrapped = self.method.wrap(module)
        self._module = [module]  # not a submodule twice: state_dict keys stay those of `module`
        self._optimizer: torch.optim.Optimizer | None = None
        self.peak_bytes = 0

    @property
    def module(self) -> nn.Module:
        """The plain model (its ``state_dict`` has the single-process keys)."""
        return self._module[0]

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    @classmethod
    def from_strategy(cls, module: nn.Module, strategy, group: dist.ProcessGroup | None = None,
                      replicate=None) -> "DataParallel":
        """``module`` over ``group`` with the strategy's sync method, bucket size, collective and compression."""
        return cls(module, strategy.dp_sync, group=group, bucket_mb=strategy.bucket_mb, collective=strategy.collective,
                   find_unused=strategy.find_unused, codec=build_codec(strategy))

    def sync_gradients(self) -> None:
        try:
            self.method.sync(self.module)
        except NotImplementedError as exc:  # (a user's own sync not written yet: an exercise's)
            raise ConfigError(f"--dp-sync {type(self.method).__name__}.sync is not written yet: {exc}") from None

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Parameter name -> a copy of its averaged gradient (every replica holds the whole of it)."""
        return {k: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for k, p in self.module.named_parameters()}

    @property
    def needs_priming(self) -> bool:
        """Whether a resumed run must replay a first backward (:meth:`distlab.parallel.Engine.prime`)."""
        return getattr(self.method, "rebuilds_buckets", False) and self.method.world_size > 1

    def no_sync(self):
        return self.method.no_sync(self.wrapped)

    def after_step(self) -> None:
        """Nothing after the optimizer step: every replica updated its own full copy."""

    def sync_state_dict(self) -> dict:
        """The gradient sync's own state across steps (compression memory); {} when it has none."""
        return self.method.state_dict()

    def load_sync_state_dict(self, state: dict) -> None:
        self.method.load_state_dict(state)

    # -- the interface it shares with Zero (what distlab.parallel.Engine calls) ------------------

    sharded = False  # every rank holds the same model state

    def optimizer_parameters(self) -> list[nn.Parameter]:
        """Build the optimizer over these: the model's own parameters."""
        return list(self.module.parameters())

    def track(self, optimizer: torch.optim.Optimizer) -> None:
        """Count ``optimizer``'s state in :meth:`observe`."""
        self._optimizer = optimizer

    def observe(self) -> int:
        """Update and return :attr:`peak_bytes` with the parameters, gradients and optimizer state held now."""
        self.peak_bytes = max(self.peak_bytes, model_state_bytes(self.module, self._optimizer))
        return self.peak_bytes

    def uncounted_bytes_per_sync(self) -> int:
        return self.method.uncounted_bytes(self.module)

    def offload_shards(self, store) -> int:
        from distlab.parallel.offload import no_shards
        raise no_shards(self)

    def gathered(self, modules=None):
        """The full parameters are always in place."""
        return contextlib.nullcontext(self.module)

    def convert_frozen(self, module: nn.Module, name: str, make) -> None:
        """Every parameter is whole on every replica already: ``make`` it in place."""
        setattr(module, name, make(getattr(module, name)))

    def sharded_state_dict(self) -> dict:
        """This rank's model state: a copy of the (replicated) module's ``state_dict``."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_sharded_state_dict(self, state: dict) -> None:
        """Copy ``state`` in -- or, into a model built on the meta device, take its tensors as the model's own."""
        if not on_meta(self.module):
            self.module.load_state_dict(state)
            return
        tensors = {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}
        missing = sorted(set(tensors) - set(state))
        if missing:
            raise ConfigError(f"the state has no {missing[0]!r} ({len(missing)} missing)")
        for key, t in tensors.items():
            adopt(t, state[key])

    def parameter_slots(self) -> list[tuple[str, nn.Parameter, tuple[int, int] | None]]:
        """(key, parameter, flat range) of each optimizer parameter: the whole of every parameter."""
        return [(k, p, None) for k, p in self.module.named_parameters()]

    @staticmethod
    def reads(state: dict) -> bool:
        """Whether ``state`` is a :meth:`sharded_state_dict` of data parallel: a plain ``state_dict``."""
        return all(torch.is_tensor(v) for v in state.values())

    @staticmethod
    def split_state(state: dict, keys: list[str]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """A :meth:`sharded_state_dict` as (the optimizer parameters' tensors, the buffers)."""
        return [state[k] for k in keys], {k: v for k, v in state.items() if k not in set(keys)}

    def state_from(self, params: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        """The :meth:`sharded_state_dict` holding ``params`` (in :meth:`parameter_slots` order) and ``buffers``."""
        return {**{k: t for (k, _, _), t in zip(self.parameter_slots(), params)}, **buffers}
