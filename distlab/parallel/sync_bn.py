"""Synchronized batch normalization with a hand-written backward, for CPU/gloo and CUDA/NCCL.

Data parallel with plain BatchNorm normalises each rank's slice of the batch by that slice's own
statistics: with small per-rank batches the model trains on noisier statistics than the single
process would, and the replicas' running statistics drift apart. SyncBatchNorm computes the
statistics of the *global* batch. ``torch.nn.SyncBatchNorm`` only runs on GPUs; this one runs on
any device and backend.

Per channel ``c``, over the ``N`` values of the global batch (samples x spatial positions):

forward
    Each rank sums ``d = x - p`` and ``d^2`` over its values, where the pivot ``p`` is the
    running mean (identical on every rank; it keeps ``E[d^2] - E[d]^2`` from cancelling when
    ``|mean| >> std``). **One all-reduce** of ``[sum d, sum d^2, count]`` (float64, ``2C+1``
    numbers) gives ``mean = p + S1/N``, ``var = S2/N - (S1/N)^2`` (biased, used to normalise),
    ``xhat = (d - S1/N) / sqrt(var + eps)``, ``y = weight * xhat + bias``. Running statistics are
    updated like torch's: ``running_var`` with the unbiased ``var * N/(N-1)``; ``momentum=None``
    is a cumulative average.
backward
    With ``g = dL/dy``: ``dL/dweight = sum(g * xhat)`` and ``dL/dbias = sum(g)`` over this rank's
    values (data parallel then sums the ranks' parameter gradients like any other). The input
    gradient needs the global sums, so **one all-reduce** of ``[sum g, sum g*xhat]``::

        dL/dx = weight / sqrt(var + eps) * (g - mean_N(g) - xhat * mean_N(g * xhat))

    (the derivative of ``xhat`` through the batch mean and variance, which depend on every
    rank's values). No batch-norm kernels of torch are used, forward or backward.

Ranks may hold different numbers of samples, including none (their sums are zero but they take
part in both all-reduces). In eval mode the running statistics are used and nothing is sent.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab import comm
from distlab.errors import ConfigError, first_line
from distlab.parallel.cost import Call
from distlab.runtime import user_code
from distlab.runtime.eager import eager

MODES = ("off", "distlab", "torch")  # what `Strategy.sync_bn` may be: see apply_sync_bn


def planned_calls(t, strategy) -> list[Call]:
    """What distlab's SyncBatchNorm sends in one step, on the model's trace: per BatchNorm layer and
    micro-batch one all-reduce of ``2 C + 1`` float64 statistics in forward (again where activation
    checkpointing recomputes the layer's block) and, where its input needs a gradient, one of ``2 C``
    gradient sums in backward. Torch's ``nn.SyncBatchNorm`` (``sync_bn`` torch) is not priced."""
    if strategy.sync_bn != "distlab":
        return []
    algorithm = "butterfly"  # apply_sync_bn's layers take "auto": the butterfly on gloo (_reduce)
    recomputed = [b for block in strategy.checkpointed(t.blocks) for b in block]
    calls = []
    for name, channels, input_grad in t.batch_norms:
        forwards = 1 + any(name == b or name.startswith(b + ".") for b in recomputed)
        calls += [Call(algorithm, "all_reduce", 8 * (2 * channels + 1), itemsize=8)] * forwards
        if input_grad:
            calls.append(Call(algorithm, "all_reduce", t.element_size * 2 * channels, itemsize=t.element_size))
    return calls * strategy.micro_steps


def _reduce(packed: torch.Tensor, group, collective: str) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        if collective == "auto":
            collective = "native" if dist.get_backend(group) == "nccl" else "butterfly"
        comm.all_reduce(packed, op="sum", algorithm=collective, group=group)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, group, collective,
                gradient, spec):
        C = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, C] + [1] * (x.dim() - 2)
        pivot = running_mean if running_mean is not None else torch.zeros(C, dtype=x.dtype, device=x.device)
        d = x - pivot.to(x.dtype).view(shape)
        count = x.numel() // C if C else 0
        packed = torch.empty(2 * C + 1, dtype=torch.float64, device=x.device)
        packed[:C] = d.sum(dims)
        packed[C:2 * C] = d.square().sum(dims)
        packed[2 * C] = count
        _reduce(packed, group, collective)  # the forward's one collective
        n = packed[2 * C]  # a tensor: reading it as a number would stall a GPU's queue
        if x.device.type == "cpu" and n.item() <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over the global batch "
                             f"when training, got {int(n.item())} (input shape {tuple(x.shape)} on this rank)")
        shift = packed[:C] / n  # mean - pivot
        var = (packed[C:2 * C] / n - shift.square()).clamp_(min=0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            if num_batches_tracked is not None:
                num_batches_tracked.add_(1)
            factor = momentum if momentum is not None else 1.0 / num_batches_tracked.double()  # None: cumulative
            mean = pivot.double() + shift
            running_mean.mul_(1 - factor).add_((factor * mean).to(running_mean.dtype))
            running_var.mul_(1 - factor).add_((factor * var * n / (n - 1)).to(running_var.dtype))
        xhat = (d - shift.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.n, ctx.group, ctx.collective, ctx.has_bias = n, group, collective, bias is not None
        ctx.input_gradient, ctx.spec = gradient, spec
        return y

    @staticmethod
    def backward(ctx, g):
        xhat, weight, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, xhat.dim()))
        g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight
            try:
                grad_x = ctx.input_gradient(g, xhat, scale, ctx.n.to(g.dtype),
                                            lambda t: _reduce(t, ctx.group, ctx.collective))  # its one collective
            except NotImplementedError as exc:  # (a user's own, an exercise not written yet)
                raise ConfigError(f"--sync-bn {ctx.spec} is not written yet: {first_line(exc)}") from None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (g * xhat).sum(dims)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(dims)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def input_gradient(g: torch.Tensor, xhat: torch.Tensor, scale: torch.Tensor, n: torch.Tensor,
                   all_reduce: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Batch norm's input gradient over the global batch (the module docstring's formula). ``g`` = dL/dy and
    ``xhat`` (the normalised input) are this rank's ``(N, C, ...)``; ``scale`` ``(C,)`` = weight / sqrt(var + eps);
    ``n`` the values per channel over every rank; ``all_reduce(t)`` sums ``t`` over the ranks in place. The signature
    a user's own has (``--sync-bn FILE.py:NAME``)."""
    C = xhat.shape[1]
    dims, shape = [0] + list(range(2, xhat.dim())), [1, C] + [1] * (xhat.dim() - 2)
    packed = torch.cat([g.sum(dims), (g * xhat).sum(dims)])
    all_reduce(packed)
    mean_g, mean_gx = packed[:C] / n, packed[C:] / n
    return (g - mean_g.view(shape) - xhat * mean_gx.view(shape)) * scale.view(shape)


def user_input_gradient(spec: str) -> Callable:
    """The user's own :func:`input_gradient` named ``spec`` (FILE.py:NAME or package.module:NAME), its signature
    checked before launch."""
    fn = user_code.load(spec, "--sync-bn", "a SyncBatchNorm input gradient")
    names = tuple(inspect.signature(input_gradient).parameters)
    try:
        inspect.signature(fn).bind(*names)
    except (TypeError, ValueError):
        raise ConfigError(f"--sync-bn {spec}: {spec.rpartition(':')[2]} must take ({', '.join(names)}) and return "
                          f"dL/dx (see distlab.parallel.sync_bn.input_gradient)") from None
    return fn


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Drop-in for ``BatchNorm1d/2d/3d`` (inputs ``(N, C, ...)``) whose statistics span the group.

    ``group``: the process group whose ranks share statistics (default: all ranks); on one
    process, or without ``torch.distributed`` initialised, it is an ordinary batch norm.
    ``collective``: the all-reduce algorithm (:mod:`distlab.comm`). ``auto`` = NCCL's own on
    NCCL groups, else ``butterfly``: the reductions are tiny (``2C+1`` numbers), so latency is
    everything, and on gloo the butterfly took 0.6 ms where gloo's own all-reduce took 3 ms
    (1e3 elements, 2 ranks; see docs/RESULTS.md's collectives table).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, group: dist.ProcessGroup | None = None,
                 collective: str = "auto", device=None, dtype=None, gradient: str = "distlab"):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.group, self.gradient = group, gradient  # distlab (input_gradient) or the user's own FILE.py:NAME
        self._input_gradient = input_gradient if gradient == "distlab" else user_input_gradient(gradient)
        self.collective = collective if collective == "auto" else comm.check_algorithm(collective)

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects (N, C, ...) input with at least 2 dimensions, got {x.dim()}")

    @eager  # a collective: run as it is under --compile (a graph break), never traced
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}) got an input with {x.shape[1]} channels")
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:  # eval: running statistics, no communication
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        track = self.training and self.track_running_stats
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, self.running_mean if track else None, self.running_var if track else None,
            self.num_batches_tracked if track else None, self.momentum, self.eps, self.group, self.collective,
            self._input_gradient, self.gradient)


def convert_sync_batchnorm(module: nn.Module, group: dist.ProcessGroup | None = None,
                           collective: str = "auto", gradient: str = "distlab") -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a :class:`SyncBatchNorm` with the same
    parameters, buffers and mode; returns the (possibly new) module."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, group, collective, gradient=gradient)
        with torch.no_grad():
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            if module.track_running_stats:
                out.running_mean = module.running_mean
                out.running_var = module.running_var
                out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, group, collective, gradient))
    return out


def apply_sync_bn(module: nn.Module, mode: str, group: dist.ProcessGroup | None = None) -> nn.Module:
    """``mode`` off (each rank normalises by its own batch), ``distlab`` (:class:`SyncBatchNorm`, any
    device) or ``torch`` (``nn.SyncBatchNorm``, CUDA only), with statistics over ``group`` -- under
    tensor parallel that must be the data-parallel group, or every sample would count tp times."""
    if mode == "distlab" or user_code.is_user_code(mode):  # (FILE.py:NAME: the user's own input gradient)
        return convert_sync_batchnorm(module, group, gradient="distlab" if mode == "distlab" else mode)
    if mode == "torch":
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        if device.type != "cuda":
            raise ConfigError(f"`sync_bn` torch uses torch.nn.SyncBatchNorm, which only runs on GPUs (this model is on "
                              f"{device.type}); use `sync_bn` distlab, which works on any device")
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group=group)
    if mode != "off":
        raise ConfigError(f"unknown `sync_bn` {mode!r}; choose one of: {', '.join(MODES)}")
    return module
