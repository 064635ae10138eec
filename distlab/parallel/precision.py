"""Mixed precision: autocast for compute, float32 for what is kept, loss scaling for float16.

``precision`` (a :class:`~distlab.parallel.Strategy` field):

* ``fp32`` -- everything in float32 (the default; what ``distlab verify`` checks to float32 rounding).
* ``bf16`` -- forward (and with it backward) under ``torch.autocast``: matrix products and
  convolutions run in bfloat16, reductions and the loss in float32. Parameters, gradients and
  optimizer state stay float32 (the "master weights"): autocast casts a weight for each product,
  and its gradient flows back through the cast into the float32 ``.grad``. bfloat16 has float32's
  exponent range, so gradients need no scaling. Works on CPU and on GPUs with bfloat16 units.
* ``fp16`` -- the same with float16, whose range (6e-5 .. 65504) loses small gradients to
  underflow, so the loss is multiplied by a scale ``S`` before backward and the gradients divided
  by ``S`` before the optimizer step (:class:`LossScaler`, dynamic: halve ``S`` and skip the step
  when any gradient on any rank is inf/NaN, double it after ``growth_interval`` clean steps).
  GPU only: CPU autocast's float16 kernels are few and slow.

Gradient communication has its own dtype (``reduce_dtype``, :mod:`distlab.parallel.compression`):
``bf16`` compute with ``fp32`` reduction is torch FSDP's usual policy.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from distlab.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_device(precision: str, device: torch.device) -> None:
    """Refuse a precision the device cannot run, saying what works there."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(f"`precision` fp16 needs a CUDA GPU (autocast's float16 and its loss scaling are for GPUs; "
                          f"this run is on {device.type}): use `precision` bf16 (bfloat16 autocast, which runs on "
                          f"CPU and needs no loss scaling) or fp32")


@torch.no_grad()
def scale_and_find_non_finite(grads: list[torch.Tensor], factor: float) -> torch.Tensor:
    """Multiply every gradient by ``factor`` in place and return a 1-element float32 tensor on their
    device that is nonzero where any entry is inf or NaN: one fused pass per dtype (torch's own
    ``_amp_foreach_non_finite_check_and_unscale_``, as GradScaler runs), nothing read back. With
    ``factor`` 1 it is an exact finiteness check that changes no bit."""
    device = grads[0].device if grads else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    inv = _ONE.get(device) if factor == 1.0 else None  # the plain check's factor, made once per device
    if inv is None:
        inv = torch.full((1,), factor, dtype=torch.float32, device=device)
        if factor == 1.0:
            _ONE[device] = inv
    dtype = grads[0].dtype if grads else None
    if all(g.dtype == dtype for g in grads):  # the usual case: one dtype, one call
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return found
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
    return found


_ONE: dict[torch.device, torch.Tensor] = {}  # never written to: the kernel reads its scale


class LossScaler:
    """Dynamic loss scaling (Micikevicius et al., ICLR 2018), agreed over a process group.

    ``scale(loss)`` before backward; after the gradients are reduced, ``unscale_(params)`` divides
    them by the scale and returns whether any is inf/NaN *on any rank* (ranks hold different
    shards under ZeRO, tensor parallel and pipelines, so the verdict is all-reduced: every rank
    must skip together); ``update(found_inf)`` halves the scale after an overflow and doubles it
    after ``growth_interval`` clean steps in a row.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group: dist.ProcessGroup | None = None):
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.group = group
        self.clean_steps = 0
        self.skipped = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, params) -> bool:
        """Divide every gradient by the scale and say whether any, on any rank, is inf/NaN. One fused
        pass per dtype (torch's own ``_amp_foreach_non_finite_check_and_unscale_``, as GradScaler),
        one all-reduce of the verdict and one read of it: not a kernel and a sync per parameter."""
        found = scale_and_find_non_finite([p.grad for p in params if p.grad is not None], 1.0 / self.scale_value)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.clean_steps = 0
            self.skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped = int(state.get("skipped", 0))


class Precision:
    """What a step needs from a ``precision`` setting: the autocast context and, for fp16, a loss scaler."""

    def __init__(self, precision: str = "fp32", device: torch.device | str = "cpu",
                 group: dist.ProcessGroup | None = None, scaler: LossScaler | None = None):
        if precision not in DTYPES:
            raise ConfigError(f"unknown `precision` {precision!r}; choose one of: {', '.join(DTYPES)}")
        self.name, self.device = precision, torch.device(device)
        self.dtype = DTYPES[precision]
        self.scaler = scaler if scaler is not None else (LossScaler(group=group) if precision == "fp16" else None)

    def autocast(self):
        """The context forward (and the loss) run in: autocast in ``dtype``, or nothing for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    # -- the Engine's precision component: fp16's loss scaling, a no-op for fp32 and bf16

    @property
    def scales_loss(self) -> bool:
        """Whether gradients are scaled (fp16): then an overflow skips the step instead of failing it."""
        return self.scaler is not None

    def unscale_(self, params) -> bool:
        """After the gradient sync: divide the gradients by the scale; whether any, on any rank, is
        inf/NaN (the step is then skipped everywhere). False where nothing is scaled."""
        return self.scaler.unscale_(params) if self.scaler is not None else False

    def update(self, found_inf: bool) -> None:
        """After the step (taken or skipped): the scale backs off or grows."""
        if self.scaler is not None:
            self.scaler.update(found_inf)

    def register_state(self, registry) -> None:
        """The loss scaler in a run-state registry (snapshots keep it: an fp16 resume is bitwise)."""
        if self.scaler is not None:
            registry.register_stateful("loss_scaler", self.scaler, optional=True)
