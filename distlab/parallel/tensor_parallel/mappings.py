"""Tensor parallel's communication as autograd functions (``f`` and ``g`` in the Megatron paper):
what each does forward and backward is the table in :mod:`distlab.parallel.tensor_parallel`."""


from __future__ import annotations

import torch

from distlab import comm
from distlab.errors import ConfigError
from distlab.runtime import group_rank, group_size, timeline
from distlab.runtime.eager import eager

def all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return t
    with timeline.span(f"tensor-parallel all-reduce {timeline.size_text(t.numel() * t.element_size())}", "communication"):
        return comm.all_reduce(t.contiguous(), op="sum", algorithm="native", group=group)


def all_gather_along(t: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` (in group-rank order)."""
    n = group_size(group)
    if n == 1:
        return t
    flat = t.movedim(dim, 0).contiguous()  # gather along dim 0, then move it back
    out = torch.empty((n * flat.shape[0], *flat.shape[1:]), dtype=t.dtype, device=t.device)
    with timeline.span(f"tensor-parallel all-gather {timeline.size_text(out.numel() * out.element_size())}", "communication"):
        comm.all_gather(out, flat, algorithm="native", group=group)
    return out.movedim(0, dim).contiguous()


def chunk_sizes(n: int, parts: int, what: str) -> list[int]:
    """The sizes ``torch.chunk`` cuts ``n`` into, ``parts`` of them: ``ceil(n / parts)`` each, the last the rest
    (1,001 over 4: 251, 251, 251, 248); one line where that leaves a part empty."""
    size = -(-n // parts)
    sizes = [max(0, min(size, n - i * size)) for i in range(parts)]
    if not all(sizes):
        raise ConfigError(f"tensor parallel: {what} of {n} cannot be cut into `tp` {parts} parts of {size} (the last "
                          f"would be empty): choose a smaller `tp`")
    return sizes


def all_gather_chunks(t: torch.Tensor, group, dim: int, sizes: list[int]) -> torch.Tensor:
    """:func:`all_gather_along` of parts whose lengths along ``dim`` are ``sizes`` (rank order; each rank's
    ``t`` its own): every part padded to the longest, gathered, cut back and joined."""
    n, longest = group_size(group), max(sizes)
    if n == 1:
        return t
    pad = list(t.movedim(dim, 0).shape)
    pad[0] = longest - t.shape[dim]
    padded = torch.cat([t.movedim(dim, 0), t.new_zeros(pad)]).movedim(0, dim) if pad[0] else t
    whole = all_gather_along(padded, group, dim)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(whole.split(longest, dim), sizes)], dim)


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    return all_gather_along(t, group, -1)


def _reduce_scatter(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Sum ``t`` over the group and keep this rank's ``1/n`` slice along ``dim``."""
    n = group_size(group)
    if n == 1:
        return t
    if t.shape[dim] % n:
        raise ConfigError(f"sequence parallel: a sequence of {t.shape[dim]} does not split over `tp` {n}")
    flat = t.movedim(dim, 0).contiguous()
    out = torch.empty((flat.shape[0] // n, *flat.shape[1:]), dtype=t.dtype, device=t.device)
    with timeline.span(f"sequence-parallel reduce-scatter {timeline.size_text(flat.numel() * flat.element_size())}", "communication"):
        comm.reduce_scatter(out, flat, op="sum", algorithm="native", group=group)
    return out.movedim(0, dim).contiguous()


def _split_last(t: torch.Tensor, group) -> torch.Tensor:
    n = group_size(group)
    return t if n == 1 else t.chunk(n, dim=-1)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum(g.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, 1), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, 1)

    @staticmethod
    def backward(ctx, g):
        return all_gather_along(g.contiguous(), ctx.group, 1), None


@eager  # a collective: run as it is under --compile (a graph break), never traced
def gather_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the sequence forward; reduce-scatter of the gradient backward."""
    return _GatherSequence.apply(x, group)


@eager  # a collective: run as it is under --compile (a graph break), never traced
def scatter_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """Reduce-scatter along the sequence forward; all-gather of the gradient backward."""
    return _ScatterSequence.apply(x, group)


@eager  # a collective: run as it is under --compile (a graph break), never traced
def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward; all-reduce (sum) of the gradient backward. Enters a column-parallel region."""
    return _CopyToGroup.apply(x, group)


@eager  # a collective: run as it is under --compile (a graph break), never traced
def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward; identity backward. Leaves a row-parallel region."""
    return _ReduceFromGroup.apply(x, group)


@eager  # a collective: run as it is under --compile (a graph break), never traced
def gather_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dimension forward; keep this rank's slice of the gradient backward."""
    return _GatherFromGroup.apply(x, group)


@eager  # a collective: run as it is under --compile (a graph break), never traced
def split_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""
    return _SplitToGroup.apply(x, group)
