"""The wrappers shared by chunk-owning algorithms (ring, direct): given how to reduce-scatter and
all-gather a list of ``n`` chunks, build all-reduce, reduce-scatter and all-gather on buffers
(with :func:`distlab.comm.all_reduce`'s semantics: ``avg`` divides by the group size)."""

from __future__ import annotations

from typing import Callable

import torch

from distlab.comm.ops import finish


def build(reduce_scatter_chunks: Callable, all_gather_chunks: Callable):
    """Return ``(all_reduce, reduce_scatter, all_gather)`` built from the two chunk phases."""

    def all_reduce(buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
        chunks = list(torch.tensor_split(buf, n))  # sizes differ by at most one element
        reduce_scatter_chunks(chunks, op, group, rank, n)
        all_gather_chunks(chunks, group, rank, n)
        finish(op, buf, n)

    def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int,
                       scratch: bool = False) -> None:
        work = inp if scratch else inp.clone()  # the chunks are reduced in place
        chunks = list(work.chunk(n)) if work.numel() else [work] * n
        reduce_scatter_chunks(chunks, op, group, rank, n)
        out.copy_(chunks[rank])
        finish(op, out, n)

    def all_gather(out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
        chunks = list(out.chunk(n)) if out.numel() else [out] * n
        chunks[rank].copy_(inp)
        all_gather_chunks(chunks, group, rank, n)

    return all_reduce, reduce_scatter, all_gather
