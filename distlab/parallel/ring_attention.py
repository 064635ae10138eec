"""Ring attention's exact arithmetic and its hops (:mod:`distlab.parallel.context_parallel` says when it
runs): this rank's queries score every key/value block as the blocks pass around the context-parallel
ring, merged with each block's log-sum-exp (FlashAttention's online softmax); backward recomputes the
scores while the blocks go round again, each block's key/value gradient a hop behind it.

Every hop but the gradients' last one (home) is in flight while the rank computes on the block it
holds: the next block is sent for before this one is scored, and a block's gradient goes on to the
next rank while that rank scores the next block. What the compute does not hide is the wait a
timeline shows.
"""

from __future__ import annotations

import math

import torch

from distlab.comm import p2p
from distlab.runtime import timeline

class _Hop:
    """A ring hop in flight: ``t`` on its way to the next rank while the previous rank's block arrives
    (``tag`` keeps the keys and values apart from their gradients); :meth:`wait` returns the block."""

    def __init__(self, t: torch.Tensor, group, rank: int, n: int, tag: int = 0):
        self.sent, self.out = t.contiguous(), torch.empty(t.shape, dtype=t.dtype, device=t.device)
        self.works = [p2p.irecv(self.out, (rank - 1) % n, group, tag), p2p.isend(self.sent, (rank + 1) % n, group, tag)]

    def wait(self) -> torch.Tensor:
        """The previous rank's block, both directions done (a timeline shows what the compute did not hide)."""
        size = timeline.size_text(self.sent.numel() * self.sent.element_size())
        with timeline.span(f"context-parallel ring hop {size}", "communication"):
            p2p.wait_all(self.works)
        return self.out


def _pairs(layout, owner: int, causal: bool = True, meets: torch.Tensor | None = None, window: int | None = None,
           h: int = 0):
    """The (query half, key half, causal) blocks that rank ``layout.rank``'s queries (a
    :class:`~distlab.parallel.context_parallel.ContextLayout`) score against
    rank ``owner``'s keys: a key chunk before the query chunk in full, the same chunk under the
    causal mask, a later one not at all (the mask empties it). Without the mask, every pair in full.
    Skipped too: a pair whose chunks share no record (``meets``, packed windows: :func:`meeting`), and one
    whose every key is ``window`` or more before every query (a sliding window; ``h`` positions a chunk)."""
    for j, k_chunk in enumerate(layout.chunks(owner)):
        for i, q_chunk in enumerate(layout.chunks()):
            if ((not causal or k_chunk <= q_chunk) and (meets is None or meets[q_chunk, k_chunk])
                    and (window is None or (q_chunk - k_chunk - 1) * h + 1 < window)):
                yield i, j, causal and k_chunk == q_chunk


_MET: dict = {}  # the last packed batch's table (its records tensor kept, so its id names it): one read per batch


def meeting(records: torch.Tensor, chunks: int) -> torch.Tensor:
    """``(chunks, chunks)`` booleans on the host for windows' record numbers ``records`` ``(B, T)`` (never
    decreasing along a window) cut into ``chunks`` equal chunks: whether a query of chunk ``a`` shares a
    record with a key of chunk ``b <= a`` -- chunk ``b``'s last record is chunk ``a``'s first. One read of
    the device per batch, by the first layer that asks."""
    key = (id(records), chunks)
    if key not in _MET or _MET[key][0] is not records:
        size = records.shape[1] // chunks
        first, last = records[:, ::size][:, :chunks], records[:, size - 1::size][:, :chunks]
        table = (last[:, None, :] == first[:, :, None]).any(0).cpu() | torch.eye(chunks, dtype=torch.bool)
        _MET.clear()
        _MET[key] = (records, table)
    return _MET[key][1]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, apart: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of queries ``q`` over keys ``k`` (grouped as :func:`_grouped` makes them), the diagonal block's
    future masked where ``causal``; ``apart`` ``(B, 1, 1, tq, tk)``: the query and key are in different
    records of a packed window (masked)."""
    s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:  # the diagonal block: query i sees keys 0..i of it
        t = s.shape[-1]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if apart is not None:
        s = s.masked_fill(apart, float("-inf"))
    return s


def _apart(records: torch.Tensor | None, window: int | None, q_chunk: int, k_chunk: int, h: int,
           device) -> torch.Tensor | None:
    """Where a query of chunk ``q_chunk`` cannot see a key of chunk ``k_chunk`` (``h`` positions each) for
    other reasons than the causal mask: they are in different records of a packed window (``records``), or
    the key is ``window`` or more positions before the query (a sliding window's band cuts the block).
    None where nothing of the pair is cut so."""
    apart = None
    if window is not None and (q_chunk - k_chunk + 1) * h - 1 >= window:  # the block's farthest pair is outside
        i = torch.arange(q_chunk * h, (q_chunk + 1) * h, device=device)
        j = torch.arange(k_chunk * h, (k_chunk + 1) * h, device=device)
        apart = (i[:, None] - j[None, :] >= window)[None, None, None]
    if records is not None:
        q, k = records[:, q_chunk * h:(q_chunk + 1) * h], records[:, k_chunk * h:(k_chunk + 1) * h]
        other = (q[:, :, None] != k[:, None, :])[:, None, None]
        apart = other if apart is None else apart | other
    return apart


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``(B, H, t, D)`` as ``(B, groups, H / groups, t, D)``: the query heads each key/value head serves
    side by side (keys and values get a group dimension of 1, which the products broadcast over)."""
    b, h, t, d = x.shape
    return x.view(b, groups, h // groups, t, d)


def _group_sum(x: torch.Tensor) -> torch.Tensor:
    """A key/value gradient summed over the query heads of its group (nothing to sum without groups)."""
    return x if x.shape[2] == 1 else x.sum(2, keepdim=True)


class RingAttentionFunction(torch.autograd.Function):
    """Exact attention (causal or not) with key/value blocks passed around the ring (FlashAttention's
    recurrence, block by block). Saves only this rank's q, k, v, output and log-sum-exp -- never a
    block's scores -- and recomputes the scores in backward, where the blocks go round again, each
    block's key/value gradient a hop behind it, ending with a last hop at the rank it belongs to.
    Grouped-query attention (fewer key/value heads than query heads) travels as it is: each key/value
    head scores the query heads of its group, and its gradient sums theirs."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal: bool = True, records: torch.Tensor | None = None,
                window: int | None = None):
        n, rank = layout.cp, layout.rank
        meets = meeting(records, 2 * n) if records is not None else None
        h = q.shape[2] // 2
        shape, q = q.shape, _grouped(q, k.shape[1])  # (B, Hkv, g, t, D); keys and values (B, Hkv, 1, t, D)
        qs = (q[..., :h, :], q[..., h:, :])
        out = [torch.zeros_like(qs[0]), torch.zeros_like(qs[1])]
        lse = [torch.full(qs[0].shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device) for _ in range(2)]
        kv = torch.stack([k, v]).unsqueeze(3)
        for step in range(n):
            ahead = _Hop(kv, group, rank, n) if step < n - 1 else None  # the next block comes while this one scores
            owner = (rank - step) % n
            for i, j, masked in _pairs(layout, owner, causal, meets, window, h):
                apart = _apart(records, window, layout.chunks()[i], layout.chunks(owner)[j], h, q.device)
                s = _scores(qs[i], kv[0, ..., j * h:(j + 1) * h, :], masked, apart)
                block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
                new = torch.logaddexp(lse[i], block_lse)  # the online softmax: rescale what is there, add the block
                # (packed, windowed: a query shown no key yet keeps nothing, not exp(-inf - -inf))
                shift = new if apart is None else new.masked_fill(new == float("-inf"), 0.0)
                out[i] = out[i] * torch.exp(lse[i] - shift) + torch.exp(s - shift) @ kv[1, ..., j * h:(j + 1) * h, :]
                lse[i] = new
            kv = ahead.wait() if ahead is not None else kv
        out, lse = torch.cat(out, dim=-2), torch.cat(lse, dim=-2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.layout, ctx.causal, ctx.records, ctx.meets, ctx.window = group, layout, causal, records, meets, window
        return out.reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group = ctx.layout, ctx.group
        n, rank = layout.cp, layout.rank
        h = q.shape[-2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        grad = grad.reshape(out.shape)
        delta = (grad * out).sum(-1, keepdim=True)  # rowsum(dO * O): softmax's backward, once per query
        dq = torch.zeros_like(q)
        kv, back = torch.stack([k, v]).unsqueeze(3), None
        for step in range(n):
            ahead = _Hop(kv, group, rank, n) if step < n - 1 else None  # the next block's keys and values
            dkv = torch.zeros_like(kv)  # this rank's share of the block's key/value gradient
            owner = (rank - step) % n
            for i, j, masked in _pairs(layout, owner, ctx.causal, ctx.meets, ctx.window, h):
                qi, gi = slice(i * h, (i + 1) * h), slice(j * h, (j + 1) * h)
                kb, vb = kv[0, ..., gi, :], kv[1, ..., gi, :]
                apart = _apart(ctx.records, ctx.window, layout.chunks()[i], layout.chunks(owner)[j], h, q.device)
                p = torch.exp(_scores(q[..., qi, :], kb, masked, apart) - lse[..., qi, :])
                dkv[1, ..., gi, :] += _group_sum(p.transpose(-2, -1) @ grad[..., qi, :])          # dV
                ds = p * (grad[..., qi, :] @ vb.transpose(-2, -1) - delta[..., qi, :])
                dq[..., qi, :] += (ds @ kb) * scale
                dkv[0, ..., gi, :] += _group_sum((ds.transpose(-2, -1) @ q[..., qi, :]) * scale)  # dK
            # the earlier ranks' share arrived while this one computed: the sum goes on while the next block
            # computes, the last one home to its rank (one hop nothing hides; nothing at all with n = 1)
            back = _Hop(dkv if back is None else back.wait() + dkv, group, rank, n, tag=1) if n > 1 else None
            kv = ahead.wait() if ahead is not None else kv
        dkv = (back.wait() if back is not None else dkv).squeeze(3)
        return dq.flatten(1, 2), dkv[0], dkv[1], None, None, None, None, None
