"""Adam and AdamW with their moments held in bfloat16 (``--optimizer-state bf16``): 4 bytes of state per
parameter instead of 8, the parameters (the float32 master weights) kept as they are.

Each step is torch's own (``torch.optim.Adam``'s single-tensor loop, line for line): the moments widened to
float32, updated with the gradient, the parameter moved by them, and only then stored back, rounded to the
nearest bfloat16 (8 bits of mantissa: a relative error of at most 2^-9 a step). So a step from the same state
moves the parameter exactly as torch's does; the rounding enters through the state the next step starts from
(``tests/test_low_precision_optim.py`` holds it to torch's AdamW with its state rounded after each step, bit for
bit).

The lesson the rounding teaches is the second moment's: ``v <- 0.999 v + 0.001 g^2`` adds less than half a
bfloat16 unit whenever ``0.001 g^2 < 2^-9 v``, so a steady ``v`` stops following gradients that shrink: it stays
as large as they were, and the steps come out smaller than float32's. It acts element by element, so it composes
with every layout as torch's optimizer does: ZeRO's flat shards, tensor parallel's slices, a pipeline stage's
parameters, the experts.
"""

from __future__ import annotations

import functools

import torch

from distlab.parallel.offload import stepped_off_device

STATE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


class Adam16(torch.optim.Optimizer):
    """Adam (``decoupled=False``: the weight decay an L2 term) or AdamW with moments stored in ``state_dtype``."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled: bool = True, state_dtype: torch.dtype = torch.bfloat16, offload=None, ahead=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled))
        self.state_dtype = state_dtype
        self.offload = offload  # an OffloadStore: the state held there, each step on the host (parallel.offload)
        self.ahead = ahead  # a StepAhead: step() launches the steps on its thread (parallel.step_ahead)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which casts floating-point state to its parameter's dtype and device -- then the moments back
        to ``state_dtype`` (exactly: they were stored in it), and offloaded state back into its store."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key, value in state.items():
                if key in ("exp_avg", "exp_avg_sq") and self.state_dtype is not None:
                    state[key] = value = value.to(self.state_dtype)
                if self.offload is not None and key != "step" and isinstance(value, torch.Tensor):
                    state[key] = self.offload.holding(value)

    def _zeros(self, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A state tensor shaped like ``like``: beside it, or in the offload store."""
        if self.offload is not None:
            return self.offload.zeros(like.shape, dtype or like.dtype)
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.ahead is not None and self.ahead.active:  # each parameter's step on the step thread; the forward
            # waits for it
            self.ahead.launch([task for group in self.param_groups for task in self._tasks(group)])
            return loss
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        for _, run in self._tasks(group):
            run()

    def _tasks(self, group: dict) -> list:
        """``(parameter, what steps it)`` for each parameter of ``group`` with a gradient (one without is left
        alone): the gradient and the group's hyperparameters as they are now."""
        hyper = {k: v for k, v in group.items() if k != "params"}
        return [(param, functools.partial(self._stepped, param, param.grad, self.state[param], hyper))
                for param in group["params"] if param.grad is not None]

    def _stepped(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        with stepped_off_device(self.offload, param, state, grad) as (p, g):
            self._param_step(p, g, state, group)

    def _param_step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        """One parameter's step (torch's single-tensor Adam) with its gradient and its state."""
        (beta1, beta2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = self._zeros(param, self.state_dtype)
        state["step"] += 1
        if wd != 0:
            if group["decoupled"]:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param, alpha=wd)
        exp_avg = state["exp_avg"].to(param.dtype).lerp_(grad, 1 - beta1)  # (widened: a copy)
        exp_avg_sq = state["exp_avg_sq"].to(param.dtype).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction1, bias_correction2 = 1 - beta1 ** step, 1 - beta2 ** step
        denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        state["exp_avg"].copy_(exp_avg)  # stored rounded to the nearest
        state["exp_avg_sq"].copy_(exp_avg_sq)


class OffloadedSGD(Adam16):
    """torch's SGD (its single-tensor loop, line for line: no dampening, no Nesterov) with the momentum buffer held
    in an offload store (``--offload`` with ``--optimizer sgd``), each parameter stepped on the host."""

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, offload=None,
                 ahead=None):
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.state_dtype, self.offload, self.ahead = None, offload, ahead

    def _param_step(self, param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        if group["weight_decay"]:
            grad = grad.add(param, alpha=group["weight_decay"])
        if group["momentum"]:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = self._zeros(param).copy_(grad)
            else:
                buf.mul_(group["momentum"]).add_(grad)
            grad = buf
        param.add_(grad, alpha=-group["lr"])
