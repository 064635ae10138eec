"""Ring attention as the idea reads (Liu et al. 2023), nothing else (``cp_style=ring_plain``): this rank's queries
score the key/value block it holds, then the block passes to the right neighbour while the left one's arrives,
``cp - 1`` hops, and each block's softmax-weighted values are merged into the output exactly by their log-sum-exps
(FlashAttention's online softmax). A hop is an autograd function whose backward sends the block's gradient back
the way it came, so autograd does the rest.

:class:`~distlab.parallel.context_parallel.RingAttention` (``cp_style=ring``) is the same ring made lean (and
``tests/test_context_parallel.py`` holds the two to each other): autograd here keeps every block that passed (a
rank ends its forward holding the whole sequence's keys and values, and every block's scores), where the tuned one
keeps nothing but its output and log-sum-exp and sends the blocks round again in backward, recomputing the scores;
it sends the next block while it scores this one, skips the blocks the causal mask empties, sends grouped key/value
heads unrepeated, and masks packed records and sliding windows."""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm.p2p import exchange
from distlab.errors import ConfigError


class _Hop(torch.autograd.Function):
    """``x`` to the right neighbour, the left one's back; backward: the gradient to the left, the right one's back."""

    @staticmethod
    def forward(ctx, x, group, rank, n):
        ctx.args = group, rank, n
        got = torch.empty_like(x)
        exchange(x.contiguous(), (rank + 1) % n, got, (rank - 1) % n, group)
        return got

    @staticmethod
    def backward(ctx, grad):
        group, rank, n = ctx.args
        got = torch.empty_like(grad)
        exchange(grad.contiguous(), (rank - 1) % n, got, (rank + 1) % n, group)
        return got, None, None, None


class PlainRingAttention(nn.Module):
    def __init__(self, group, layout, causal: bool = True, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.group, self.layout, self.causal, self.window, self.scale = group, layout, causal, window, scale

    def forward(self, q, k, v, records=None):  # (B, H, t, D): this rank's t tokens of every sequence
        if records is not None or self.window is not None:
            raise ConfigError("`cp_style` ring_plain is attention over whole sequences: packed records and sliding "
                              "windows are the tuned ring's -- use `cp_style` ring")
        n, rank, t = self.layout.cp, self.layout.rank, q.shape[2] * self.layout.cp
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        mine = self.layout.positions(t, rank, q.device)  # each query's position in the whole sequence
        kv, out, lse = torch.cat([k, v], dim=-1), None, None  # one message a hop
        wide = torch.promote_types(q.dtype, torch.float32)  # the scores and the merge in float32 at least
        for step in range(n):
            if step:
                kv = _Hop.apply(kv, self.group, rank, n)
            kb, vb = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in kv.split(k.shape[-1], dim=-1))
            scores = (q.to(wide) @ kb.to(wide).transpose(-2, -1)) * scale
            if self.causal:  # a key after the query is masked (never a whole row: step 0 holds each query's own key)
                theirs = self.layout.positions(t, (rank - step) % n, q.device)
                scores = scores.masked_fill(theirs[None, :] > mine[:, None], torch.finfo(scores.dtype).min)
            block_lse = scores.logsumexp(-1, keepdim=True)
            block_out = torch.softmax(scores, -1) @ vb.to(wide)
            if out is None:
                out, lse = block_out, block_lse
            else:  # the two partial softmaxes as one: each weighed by its share of the merged normaliser
                merged = torch.logaddexp(lse, block_lse)
                out = out * (lse - merged).exp() + block_out * (block_lse - merged).exp()
                lse = merged
        return out.to(q.dtype)
