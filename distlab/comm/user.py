"""A collective of your own, named on the command line: ``--collective path/to/file.py:NAME`` (or
``package.module:NAME``) in ``train``, ``verify`` and ``bench``.

``NAME`` is an all-reduce with the signature distlab's own algorithms have::

    def allreduce(buf, op, group, rank, n):   # buf: a flat, contiguous tensor, the same size on every rank
        ...                                   # reduce it over the group's n ranks, in place (or return the result)

``op`` is ``sum``, ``max``, ``min`` or ``product`` (``avg`` arrives as ``sum`` and is divided afterwards);
``distlab.comm.ops.combine(op, acc, x)`` applies it. Send with :mod:`distlab.comm.p2p` (``isend``, ``irecv``,
``exchange``; ``group`` and the ranks as given): that is where a message's bytes are counted, so a run's
``comm_bytes_per_step`` and ``bench`` show what your algorithm sends -- one that moves nothing through it is
refused (torch's own point-to-point calls are not counted). distlab builds the other collectives from it: reduce-scatter (the all-reduce, this rank's chunk kept), all-gather (each rank's part in
place, zeros elsewhere, summed) and broadcast (zeros beside the source's, summed).
"""

from __future__ import annotations

import inspect

import torch

from distlab.comm import accounting
from distlab.comm.ops import finish
from distlab.errors import ConfigError, first_line
from distlab.runtime import user_code

PARAMETERS = ("buf", "op", "group", "rank", "n")


class UserCollective:
    """The four collectives distlab calls, made from the user's all-reduce ``fn`` (named ``spec``)."""

    def __init__(self, spec: str, fn):
        self.spec, self.fn = spec, fn

    @classmethod
    def load(cls, spec: str) -> "UserCollective":
        fn = user_code.load(spec, "--collective", "an all-reduce")
        try:
            inspect.signature(fn).bind(*PARAMETERS)
        except (TypeError, ValueError):
            raise ConfigError(f"--collective {spec}: {spec.rpartition(':')[2]} must take ({', '.join(PARAMETERS)}) -- "
                              f"the flat buffer to reduce in place, the op, the group, this rank and the group's "
                              f"size -- not {_shown(fn)}") from None
        return cls(spec, fn)

    def _reduce(self, buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
        before = accounting.stats().messages_sent
        try:
            out = self.fn(buf, "sum" if op == "avg" else op, group, rank, n)
        except NotImplementedError as exc:  # (an exercise not written yet)
            raise ConfigError(f"--collective {self.spec} is not written yet: {first_line(exc)}") from None
        if out is not None and out is not buf:
            if not isinstance(out, torch.Tensor) or out.shape != buf.shape or out.dtype != buf.dtype:
                got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise ConfigError(f"--collective {self.spec} returned {got}: reduce the buffer ({tuple(buf.shape)} "
                                f"{buf.dtype}) in place and return None, or return a tensor like it")
            buf.copy_(out)
        if n > 1 and buf.numel() and accounting.stats().messages_sent == before:
            raise ConfigError(f"--collective {self.spec} sent no message through distlab.comm.p2p on rank {rank} of "
                            f"{n}: send with its isend, irecv or exchange, which count the bytes (torch.distributed's "
                            f"own calls are not counted)")
        finish(op, buf, n)

    def all_reduce(self, buf: torch.Tensor, op: str, group, rank: int, n: int) -> None:
        self._reduce(buf, op, group, rank, n)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str, group, rank: int, n: int,
                       scratch: bool = False) -> None:
        work = inp if scratch else inp.clone()
        self._reduce(work, op, group, rank, n)
        out.copy_(work.view(n, -1)[rank])

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, group, rank: int, n: int) -> None:
        out.zero_()
        out.view(n, -1)[rank].copy_(inp.view(-1))
        self._reduce(out, "sum", group, rank, n)

    def broadcast(self, buf: torch.Tensor, src: int, group, rank: int, n: int) -> None:
        if rank != src:
            buf.zero_()
        self._reduce(buf, "sum", group, rank, n)


def _shown(fn) -> str:
    try:
        return f"({', '.join(inspect.signature(fn).parameters)})"
    except (TypeError, ValueError):
        return "a callable whose signature cannot be read"
