"""Whether a step's gradients were finite, decided on the device: a step that never waits for it.

Outside fp16's loss scaling, non-finite gradients stop a run. Checking them before each update means
reading a flag from the device every step: on a GPU a host synchronisation the plain loop does not
make (it waits for the whole step to finish before the next one may be queued). Instead, where the
optimizer can skip an update on the device -- torch's fused Adam, AdamW and SGD take a
``found_inf`` tensor, as :class:`torch.amp.GradScaler` uses them -- the verdict stays there:

* a **sticky flag**: once a step's gradients are not finite, that step and every later one is skipped
  by the optimizer's own kernel (parameters and moments unchanged, Adam's step count taken back), so
  the model keeps the state of the last good step however late the flag is read;
* a **counter** of the steps skipped since the first bad one: the trainer reads it (one read) where it
  must know -- before a log line, an evaluation, a snapshot and at the end -- and stops, naming the
  first bad step (the current step less the count, plus one).

Fused SGD with momentum makes its momentum buffers uninitialised on its first step (``empty_like``)
and a skipped first step leaves them so: :meth:`DeviceVerdict.decide` gives them zeros first, which
with no dampening changes no bit of the first update (``momentum * 0 + g`` is ``g``).
"""

from __future__ import annotations

import torch


def can_skip_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` reads a ``found_inf`` tensor and skips its update on the device
    (torch's fused kernels; what GradScaler checks), with nothing that would change the update's bits
    (SGD's dampening would: its first step differs from one over a zero buffer)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    return all(not g.get("dampening") for g in optimizer.param_groups)


class DeviceVerdict:
    """The sticky non-finite flag and the count of steps it skipped, on the device of the first verdict."""

    def __init__(self):
        self.bad: torch.Tensor | None = None  # made on the first step's device: fused Adam wants a 0-dim found_inf
        # float32 counts exactly to 2**24 steps between reads (the trainer reads at least every 256)
        self.count: torch.Tensor | None = None
        self._zeroed: set[int] = set()  # optimizers whose momentum buffers exist

    @torch.no_grad()
    def decide(self, found: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """This step's ``found`` (1 where a gradient is not finite, else 0: float32, as the unscale kernel
        writes it, or bool) joins the flag; ``optimizer``'s next ``step()`` skips its update while the flag
        is set. Two kernels, nothing read back."""
        if found.dtype != torch.float32:
            found = found.to(torch.float32)
        if self.bad is None:
            self.bad = torch.zeros((), dtype=torch.float32, device=found.device)
            self.count = torch.zeros((), dtype=torch.float32, device=found.device)
        torch.maximum(self.bad, found.reshape(()), out=self.bad)
        self.count.add_(self.bad)
        if id(optimizer) not in self._zeroed:
            _zero_momentum(optimizer)
            self._zeroed.add(id(optimizer))
        optimizer.found_inf = self.bad

    def skipped(self) -> int:
        """Steps skipped since the first non-finite one (0: every step was applied). One read."""
        return int(self.count.item()) if self.count is not None else 0


def _zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        if group.get("momentum"):
            for p in group["params"]:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
