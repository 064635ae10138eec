"""Activation checkpointing: keep a block's input, recompute its inside during backward.

Autograd keeps every tensor a backward formula needs until that backward runs, so a step's peak
activation memory grows with depth. Checkpointing a *block* (a VGG stage, a ResNet block, a
transformer block) keeps only the block's input; backward runs the block's forward again to get
the rest, one block at a time: about a third more compute for a peak of one block's activations
plus every block's input. distlab uses ``torch.utils.checkpoint`` (non-reentrant, RNG state
preserved, so dropout draws the same masks) and adds what it lacks:

* **BatchNorm's running statistics updated once.** The recomputed forward is a train-mode forward
  and would update ``running_mean`` / ``running_var`` / ``num_batches_tracked`` a second time;
  they are saved before the recomputation and put back after it. Gradients and statistics equal
  the un-checkpointed step's bit for bit (``tests/test_checkpointing.py``).
* **Blocks, not layers.** A model lists its blocks with ``checkpoint_blocks()``: ``[(container,
  [(start, end), ...])]``, ranges of an ``nn.Sequential``'s children. The container's class is
  swapped for a subclass whose forward runs each range under ``checkpoint`` -- its children,
  parameters and ``state_dict`` keys are untouched, so snapshots and the single-process model see
  no difference. A plain ``nn.Sequential`` model checkpoints each child.

Under evaluation (``no_grad`` or ``eval()``) nothing is recomputed: the blocks run plainly.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distlab.errors import ConfigError
from distlab.models.contract import contract


def checkpoint_blocks(model: nn.Module) -> list[tuple[nn.Sequential, list[tuple[int, int]]]]:
    """``model``'s blocks: its ``checkpoint_blocks()`` (:class:`~distlab.models.contract.ModelContract`: for
    an ``nn.Sequential`` each child; by default each child of every ``nn.Sequential`` the model holds
    directly -- a user's model with a ``self.blocks = nn.Sequential(...)`` checkpoints each block)."""
    return list(contract(model).checkpoint_blocks())


_RECOMPUTING: list[set[int]] = []  # the modules (ids) of each block being recomputed now, innermost last


def recomputing() -> set[int] | None:
    """The modules (their ``id``) of the block whose forward is being recomputed right now, in backward;
    None outside a recomputation. ZeRO-3 prefetches no module outside it (one backward will not use)."""
    return _RECOMPUTING[-1] if _RECOMPUTING else None


class _Recomputation:
    """The context of a block's recomputed forward: says which modules are being recomputed
    (:func:`recomputing`), and puts BatchNorm's running statistics back after it updated them again.
    Entered at every recomputation of its block (one per backward through it: zero bubble's weight
    pass recomputes a second time), so it saves on entry, not once."""

    def __init__(self, modules: list[nn.Module]):
        self.inside = {id(m) for mod in modules for m in mod.modules()}
        self.norms = [m for mod in modules for m in mod.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                      and m.track_running_stats and m.running_mean is not None]

    def __enter__(self):
        _RECOMPUTING.append(self.inside)
        self.saved = [(m.running_mean.clone(), m.running_var.clone(), m.num_batches_tracked.clone())
                      for m in self.norms]

    def __exit__(self, *exc):
        _RECOMPUTING.pop()
        with torch.no_grad():
            for m, (mean, var, count) in zip(self.norms, self.saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


class _Held(torch.autograd.Function):
    """Identity that saves its input for backward: the block input ``checkpoint`` keeps alive
    becomes visible to saved-tensor accounting (:class:`~distlab.parallel.pipeline.ActivationMeter`),
    which would otherwise miss it (checkpoint holds it outside autograd's saved tensors)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _run(modules: list[nn.Module], x):
    for m in modules:
        x = m(x)
    return x


POLICIES = ("block", "ops")  # what a checkpointed block keeps: its input alone, or also its chosen ops' outputs


def matmul_ops() -> set:
    """The matrix multiplications a linear layer runs as (with and without a bias)."""
    return {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def attention_ops() -> set:
    """The fused attention kernels (a GPU's flash and memory-efficient ones, a CPU's flash)."""
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


def ops_policy():
    """Selective checkpointing per op (torchtitan's ``op`` mode): inside a checkpointed block, the outputs of the
    attention kernels and of every other matrix multiplication (the first, third, ...) are kept; the rest --
    the other matrix multiplications, norms, activations, rotations -- are recomputed in backward. One counter
    for the forward and one for the recomputation, so both keep the same outputs."""
    from torch.utils.checkpoint import CheckpointPolicy
    counts = {False: 0, True: 0}
    mm, attention = matmul_ops(), attention_ops()

    def policy(ctx, op, *args, **kwargs):
        if op in attention:
            return CheckpointPolicy.MUST_SAVE
        if op in mm:
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Both:
    """Two contexts entered in turn, left in reverse."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        self.second.__enter__()

    def __exit__(self, *exc):
        self.second.__exit__(*exc)
        self.first.__exit__(*exc)


class KeptOps(torch.utils._python_dispatch.TorchDispatchMode):
    """A forward seen as :func:`ops_policy` sees it: the outputs it keeps go to :meth:`kept`, each matrix
    multiplication it would run again to :meth:`recomputed` (its ``(m, k)`` and ``(k, n)`` operands)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.mm, self.attention = matmul_ops(), attention_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        keep = func in self.attention
        if func in self.mm:
            self.count += 1
            keep = bool(self.count % 2)
            if not keep:
                self.recomputed(args[-2], args[-1])  # (after addmm's bias)
        if keep:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.kept(t)
        return out

    def kept(self, t: torch.Tensor) -> None:
        pass

    def recomputed(self, a: torch.Tensor, b: torch.Tensor) -> None:
        pass


class _Kept(KeptOps):
    """In a block's forward under :func:`ops_policy`: the outputs it keeps counted with the open
    :class:`~distlab.parallel.pipeline.ActivationMeter` (torch keeps them in its own cache, out of sight of
    autograd's saved-tensor hooks) until the block's recomputation has used them (:class:`_Released`)."""

    def __init__(self, held: list):
        super().__init__()
        self.held = held

    def kept(self, t: torch.Tensor) -> None:
        from distlab.parallel.pipeline.activation_meter import ActivationMeter
        meter = ActivationMeter.current()
        handle = meter.hold(t) if meter is not None else None
        if handle is not None:
            self.held.append(handle)


class _Released:
    """Leaving a block's recomputation: what :class:`_Kept` counted is used up (torch's cache popped)."""

    def __init__(self, held: list):
        self.held = held

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        self.held.clear()


def _contexts(modules: list[nn.Module], policy: str = "block"):
    if policy == "ops":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        forward, recompute = create_selective_checkpoint_contexts(ops_policy())
        held: list = []
        return _Both(forward, _Kept(held)), _Both(recompute, _Both(_Recomputation(modules), _Released(held)))
    return contextlib.nullcontext(), _Recomputation(modules)


def run_checkpointed(block: list[nn.Module], x, policy: str = "block"):
    """``block`` (modules applied in turn) on ``x``, keeping only ``x`` for backward (with ``policy`` "ops", also
    the outputs :func:`ops_policy` keeps) and recomputing the rest there; plainly where nothing will be
    differentiated (``no_grad``) or in eval mode."""
    if not (torch.is_grad_enabled() and any(m.training for m in block)):
        return _run(block, x)
    return checkpoint(_run, block, _Held.apply(x), use_reentrant=False,
                      context_fn=functools.partial(_contexts, block, policy))


def block_names(model: nn.Module, every: int = 1) -> list[list[str]]:
    """The names (in ``model.named_modules()``) of each block's modules, in order: what a pipeline
    stage, which runs the model's layers one by one rather than through their container, checkpoints
    (with ``every``: one block in every ``every``, as :meth:`~distlab.parallel.Strategy.checkpointed` picks)."""
    names = {id(m): name for name, m in model.named_modules()}
    return [[names[id(m)] for m in list(container)[start:end]] for container, ranges in checkpoint_blocks(model)
            for start, end in ranges][::every]


class _Checkpointed:
    """Mixed into an ``nn.Sequential``'s class: runs ``_checkpoint_ranges`` under ``checkpoint``."""

    _checkpoint_ranges: list[tuple[int, int]]
    _checkpoint_policy: str = "block"

    def forward(self, x):
        children = list(self)
        done = 0
        for start, end in self._checkpoint_ranges:
            x = _run(children[done:start], x)  # children outside every block run plainly
            x = run_checkpointed(children[start:end], x, self._checkpoint_policy)
            done = end
        return _run(children[done:], x)


def apply_activation_checkpointing(model: nn.Module, every: int = 1, policy: str = "block") -> int:
    """Make ``model``'s blocks -- one in every ``every``, counted over all its blocks in order -- recompute their
    activations in backward (``policy`` "ops": all but the outputs :func:`ops_policy` keeps); returns how many
    blocks."""
    count, seen = 0, 0
    for container, ranges in checkpoint_blocks(model):
        if not isinstance(container, nn.Sequential):
            raise ConfigError(f"checkpoint_blocks() must list ranges of nn.Sequential children, not of "
                              f"{type(container).__name__}")
        ranges = sorted(ranges)
        if any(a >= b or b > len(container) for a, b in ranges) or any(
                b > c for (_, b), (c, _) in zip(ranges, ranges[1:])):
            raise ConfigError(f"checkpoint_blocks(): ranges {ranges} must be non-empty, ordered, disjoint and "
                              f"within the {len(container)} children")
        kept = [r for k, r in enumerate(ranges, seen) if k % every == 0]  # (validated whole, then picked)
        seen += len(ranges)
        if not kept:
            continue
        ranges = kept
        cls = type(container)
        if not issubclass(cls, _Checkpointed):
            container.__class__ = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})
        container._checkpoint_ranges = ranges
        container._checkpoint_policy = policy
        count += len(ranges)
    return count
