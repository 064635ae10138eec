"""The offloaded optimizer step, overlapped with the next step's forward (``--offload-overlap``).

An offloaded step (:mod:`distlab.parallel.offload`) runs each parameter's update where its state lives -- on the
host, reading and writing the state's file -- and the device waits for all of it before the next forward: the
3-10x slower step ``pytorch#74588`` measured. Nothing in the next forward needs *every* parameter at once, though:
its first layer needs the first layer's parameters. So :class:`StepAhead` runs the step on a thread of its own,
parameter by parameter in the order the last forward first read them (not the optimizer's groups': AdamW's
undecayed group holds the embedding the forward starts with), and the next forward waits, module by module, only
for the parameters that module reads (a forward pre-hook on every module that holds parameters of its own:
:meth:`StepAhead.watch`; under ZeRO-3, whose forward reads a unit's shards when it gathers them -- its prefetch a
unit ahead -- the gather waits for them: :func:`ready`). The update is the same arithmetic on the same values in
the same order -- a run with the overlap is its run without, bit for bit -- only *when* the main thread waits for
it changes.

What must see the whole step first waits for all of it (:meth:`StepAhead.settle`): anything between steps that
reads the model or the optimizer -- an evaluation, a snapshot, a sample, a GRPO rollout, the end of the
run -- and the next step's launch. What the thread reads is fixed when the step is launched: each parameter's
gradient (the next step's ``zero_grad`` sets ``.grad`` to None; the tensor the thread holds is not touched) and
its group's hyperparameters (the scheduler changes the learning rate right after).

Where it cannot overlap, the run refuses it (``TrainConfig.validate``): ZeRO 1-2 all-gather the updated shards
right after the step (nothing is left to overlap), the plain ZeRO-3 gathers without asking, and Muon's step gathers
a matrix cut over ranks to its owner (a collective on another thread, out of step with the forward's).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.runtime import timeline


_ACTIVE: "StepAhead | None" = None  # the run's, while it watches a model: what ZeRO-3's gathers wait on (ready)


def ready(params: Iterable[torch.Tensor]) -> None:
    """Before reading ``params`` outside their module's forward (ZeRO-3's gather of a unit's shards): wait for the
    steps of those still running, where a :class:`StepAhead` is active (nothing otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.read(params)


def settled() -> None:
    """Before reading the whole model outside a forward (a rollout's copy of the policy): wait for every step still
    running, where a :class:`StepAhead` is active (nothing otherwise)."""
    if _ACTIVE is not None:
        _ACTIVE.settle()


def check_overlap(overlap: bool, offload: str, strategy, optimizer: str) -> None:
    """Where ``--offload-overlap`` can run (module docstring); one line where it cannot."""
    if not overlap:
        return
    zero = strategy.zero
    if offload == "none":
        raise ConfigError("--offload-overlap overlaps the offloaded optimizer step with the next forward: give "
                          "--offload optimizer too, or drop --offload-overlap")
    if zero in (1, 2):
        raise ConfigError(f"--offload-overlap with --zero {zero}: ZeRO-{zero} all-gathers the updated shards right "
                          f"after the step, so nothing is left to overlap it with; drop --offload-overlap")
    if zero == 3 and strategy.zero_impl != "tuned":
        raise ConfigError(f"--offload-overlap with --zero-impl {strategy.zero_impl}: only the tuned ZeRO-3's gathers "
                          f"wait for their shards' steps; use --zero-impl tuned or drop --offload-overlap")
    if optimizer == "muon":
        raise ConfigError("--offload-overlap with --optimizer muon: Muon's step gathers each matrix cut over ranks "
                          "to its owner, a collective that cannot run beside the forward's; drop --offload-overlap")


class StepAhead:
    """One rank's optimizer steps on a thread of their own: launched after the gradient sync, waited for per
    parameter by the forward that reads it, or all at once. ``model``: the one it watches (:meth:`watch`); None: it
    launches nothing (the optimizer steps as it always does) and every wait returns at once."""

    def __init__(self, model: nn.Module | None = None):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="distlab-step-ahead")  # (its thread: at the first step)
        self._pending: dict[int, Future] = {}  # id(parameter) -> its step, not yet waited for
        self._order: dict[int, int] = {}  # id(parameter) -> its place in the order the forward first read them
        self._hooks: list = []
        self.waited_s = 0.0  # seconds the main thread waited for steps: in forwards and at settles
        self.forward_waited_s = 0.0  # ... of them in forwards (what the overlap left unhidden there)
        self.active = False  # whether it watches a model: the optimizer launches its steps here
        if model is not None:
            self.watch(model)

    def launch(self, tasks: list[tuple[torch.Tensor, Callable[[], None]]]) -> None:
        """Run ``tasks`` (a parameter, and what steps it) on the step thread, after the last launch's have all
        finished: in the order the forward reads their parameters (the optimizer's groups need not be: AdamW's
        undecayed group holds the embedding the forward starts with), the rest after, in theirs."""
        self.settle()
        last = len(self._order)
        for param, run in sorted(tasks, key=lambda task: self._order.get(id(task[0]), last)):
            self._pending[id(param)] = self._pool.submit(_no_grad, run)

    def wait(self, params: Iterable[torch.Tensor]) -> None:
        """Until the steps of ``params`` (those launched and not waited for yet) are done; a step's exception
        is raised here."""
        futures = [f for f in (self._pending.pop(id(p), None) for p in params) if f is not None]
        if futures:
            self.forward_waited_s += self._wait(futures)

    def settle(self) -> None:
        """Until every launched step is done (the first exception of one raised)."""
        futures, self._pending = list(self._pending.values()), {}
        if futures:
            self._wait(futures)

    def _wait(self, futures: list[Future]) -> float:
        t0 = time.perf_counter()
        with timeline.span("wait for the optimizer step"):
            for f in futures:
                f.result()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        return waited

    def watch(self, model: nn.Module) -> None:
        """Every module of ``model`` holding parameters of its own waits for their steps before its forward."""
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own:  # (a compiled block calls the hook as it is, not traced)
                wait = torch.compiler.disable(lambda _module, _args, own=own: self.read(own))
                self._hooks.append(module.register_forward_pre_hook(wait, prepend=True))
        global _ACTIVE
        _ACTIVE, self.active = self, True

    def read(self, params: Iterable[torch.Tensor]) -> None:
        """The forward reads ``params`` now: their place in its order (the first time), and their steps waited for."""
        params = list(params)
        for p in params:
            self._order.setdefault(id(p), len(self._order))
        self.wait(params)

    def close(self) -> None:
        """Settle quietly (a run that failed says why itself), unhook, and end the thread."""
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - the run's own error is what it reports
            pass
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self.active = False
        self._pool.shutdown(wait=True)


def _no_grad(run: Callable[[], None]) -> None:
    with torch.no_grad():  # (grad mode is per thread)
        run()
