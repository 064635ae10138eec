"""Tensor parallel's region, vocabulary and sequence layers for transformers (Megatron-LM's layout):
attention split by heads, the vocabulary split in the embedding, the LM head and the cross-entropy,
the sequence split between blocks. A model's
``tensor_parallel_plan()`` says where they go (:mod:`distlab.models.plans` names the styles) and
:mod:`distlab.parallel.tensor_parallel.plan` puts them there; nothing here knows a model.

Over the ``t`` ranks of a tensor-parallel group:

* **attention** -- the query, key and value projections are column parallel (each rank computes
  ``n_head / t`` whole heads), the output projection row parallel. The block's input enters the
  parallel region once (:func:`~distlab.parallel.tensor_parallel.copy_to_group`: one all-reduce of
  its gradient backward, not one per projection: :class:`CopyToGroup`) and leaves it with one
  all-reduce forward. The MLP is a column/row pair.
* **vocabulary-parallel embedding** -- rank ``r`` holds token rows ``[r V/t, (r+1) V/t)``, looks up
  the tokens it holds (zeros for the others) and the group sums: one all-reduce of ``(B, T, C)``. A
  vocabulary ``t`` does not divide is cut as ``torch.chunk`` cuts it (``ceil(V/t)`` rows a rank, the last
  fewer: :func:`vocab_rows`), the embedding and the head alike.
* **vocabulary-parallel LM head and cross-entropy** -- each rank computes the logits of its
  ``V/t`` tokens only; :func:`vocab_parallel_cross_entropy` needs three all-reduces of one number
  per token (the max, the sum of exponentials, the target's logit; a fourth, the logits' sum, for
  label smoothing) where gathering the logits would move ``V`` numbers per token: no rank ever
  holds a full ``(B, T, V)`` tensor.

**Sequence parallel** (``sequence_parallel``; Korthikanti et al. 2022) also splits what lies
between those blocks -- the LayerNorms, the residual stream, the position embedding -- along the
sequence: each rank keeps ``T/t`` positions there. Entering a block all-gathers the sequence,
leaving it reduce-scatters (the two together move exactly the bytes of the all-reduce they
replace), so the activations of those regions take ``1/t`` of the memory. Their parameters
(LayerNorms, position embedding, the row-parallel biases) see only this rank's positions; their
gradients are summed over the group as they are computed.

Shards are slices of the full, seeded model, so the sharded model computes what the whole one does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab import comm
from distlab.models import IGNORE_INDEX
from distlab.parallel.tensor_parallel.layers import ColumnParallelLinear, frozen_as
from distlab.parallel.tensor_parallel.mappings import (all_gather_chunks, chunk_sizes, copy_to_group, gather_sequence,
                                                       reduce_from_group, scatter_sequence)
from distlab.runtime import group_rank, group_size


class CopyToGroup(nn.Module):
    """The entry of a parallel region as a module: identity forward, gradient all-reduced backward."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_group(x, self.group)


class GatherSequence(nn.Module):
    """The entry of a parallel region under sequence parallel: all-gather the sequence forward,
    reduce-scatter the gradient backward."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_sequence(x, self.group)


def vocab_rows(vocab: int, group, name: str) -> tuple[list[int], int, int]:
    """``(every rank's rows, this rank's first, its end)`` of a vocabulary of ``vocab`` tokens split over
    ``group``: ``ceil(V/t)`` rows a rank, the last the rest where ``t`` does not divide ``V`` (as ``torch.chunk``
    cuts it; Megatron pads the vocabulary to a multiple instead -- rows that must then never be predicted; here
    there are none, and the whole model's tensors are its own)."""
    sizes = chunk_sizes(vocab, group_size(group), f"{name}'s vocabulary")
    start = sum(sizes[:group_rank(group)])
    return sizes, start, start + sizes[group_rank(group)]


class VocabParallelEmbedding(nn.Module):
    """This rank's ``V/t`` rows of ``embedding`` (:func:`vocab_rows`); lookups of other ranks' tokens are
    summed in."""

    tp_split = {"weight": 0}

    def __init__(self, embedding: nn.Embedding, group=None, name: str = "embedding"):
        super().__init__()
        self.group, self.num_embeddings = group, embedding.num_embeddings
        self.sequence_parallel = False  # True: reduce-scatter along the sequence instead of all-reducing
        self.sizes, self.start, self.end = vocab_rows(embedding.num_embeddings, group, name)
        self.weight = nn.Parameter(embedding.weight.detach()[self.start:self.end].clone(),
                                   requires_grad=embedding.weight.requires_grad)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.weight.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return scatter_sequence(out, self.group) if self.sequence_parallel else reduce_from_group(out, self.group)

    def full_parameters(self) -> list[torch.Tensor]:
        return [all_gather_chunks(self.weight.detach(), self.group, 0, self.sizes)]


def _reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    return comm.all_reduce(t, op=op, algorithm="native", group=group) if group_size(group) > 1 else t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, vocab, smoothing, ignore_index):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 up, float64 kept
        top = _reduce(logits.max(-1).values, "max", group)
        shifted = logits - top[:, None]
        exp = shifted.exp()
        total = _reduce(exp.sum(-1), "sum", group)
        kept = target != ignore_index  # an ignored target scores 0 and sends no gradient, as in F.cross_entropy
        local = target - start
        mine = (local >= 0) & (local < logits.shape[-1]) & kept
        local = local.masked_fill(~mine, 0)
        picked = _reduce(shifted.gather(-1, local[:, None]).squeeze(-1).masked_fill(~mine, 0.0), "sum", group)
        ctx.save_for_backward(exp / total[:, None], local, mine, kept)
        ctx.vocab, ctx.smoothing = vocab, smoothing
        nll = total.log() - picked
        if smoothing:
            # F.cross_entropy's smoothing: (1 - s) x nll + s x the mean over the vocabulary of -log p_j, where
            # -log p_j = log total - shifted_j: one more all-reduce of a number per token (the shards' sums).
            mean_shifted = _reduce(shifted.sum(-1), "sum", group) / vocab
            nll = (1.0 - smoothing) * nll + smoothing * (total.log() - mean_shifted)
        return nll.masked_fill(~kept, 0.0)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, kept = ctx.saved_tensors
        g = softmax.clone()
        if ctx.smoothing:
            g -= ctx.smoothing / ctx.vocab  # d/dz_j of s x mean(-log p): s (p_j - 1/V)
        rows = torch.arange(len(local), device=g.device)[mine]
        g[rows, local[mine]] -= 1.0 - ctx.smoothing
        return g * grad.masked_fill(~kept, 0.0)[:, None], None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, start: int,
                                 reduction: str = "mean", label_smoothing: float = 0.0,
                                 ignore_index: int = IGNORE_INDEX, vocab: int | None = None) -> torch.Tensor:
    """Cross-entropy of logits split over the vocabulary: ``logits`` ``(..., V/t)`` are this
    rank's columns ``[start, start + V/t)``, ``target`` ``(...)`` the true token ids. Equal to
    ``F.cross_entropy`` of the gathered logits, ``label_smoothing`` included (the target ``1 - s`` on
    the true token plus ``s / V`` on every token; Megatron-LM's spreads ``s`` over the other tokens
    only, a different loss) and ``ignore_index`` too: a target equal to it scores 0 and sends no
    gradient, and the mean is over the kept targets (nan where none is kept, as torch's). ``vocab``: the whole
    vocabulary (default: this rank's columns times the ranks, where they split it evenly)."""
    vocab = vocab or logits.shape[-1] * group_size(group)
    target = target.flatten()
    per_token = _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target, group, start, vocab,
                                                 float(label_smoothing), ignore_index)
    if reduction == "mean":
        return per_token.sum() / (target != ignore_index).sum()
    return per_token.sum() if reduction == "sum" else per_token


@torch.no_grad()
def vocab_parallel_correct(logits: torch.Tensor, target: torch.Tensor, group, start: int) -> tuple[int, int]:
    """(tokens whose argmax over the whole vocabulary is the target, tokens whose target is kept); ties
    go to the lowest id, as ``argmax`` does."""
    value, index = logits.max(-1)
    best = _reduce(value.clone(), "max", group)
    mine = torch.where(value == best, index + start, torch.full_like(index, 2**62))
    winner = _reduce(mine, "min", group)
    return int((winner == target).sum()), int((target != IGNORE_INDEX).sum())


class VocabParallelLinear(ColumnParallelLinear):
    """An output projection to vocabulary logits, column parallel over the vocabulary: returns this
    rank's ``V/t`` logits per token, scored across the shards by :meth:`loss` and :meth:`correct`
    (no rank builds the full logits). Its input has entered the parallel region before it (an
    ``enter`` of the model's plan), so it does not copy it again."""

    def __init__(self, linear: nn.Linear, group=None, name: str = "head"):
        self.sizes, start, end = vocab_rows(linear.out_features, group, name)
        bias = linear.bias.detach()[start:end] if linear.bias is not None else None
        self._setup(linear.weight.detach()[start:end], bias, group, False, linear.in_features, linear.out_features)
        frozen_as(self, linear)
        self.copy_input = False
        self.start = start

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.in_features) if name == "weight" else (self.out_features,)

    def full_parameters(self) -> list[torch.Tensor]:
        """The whole weight and bias, gathered from the group's unequal parts (collective)."""
        return [all_gather_chunks(p.detach(), self.group, 0, self.sizes) for p in (self.weight, self.bias)
                if p is not None]

    def loss(self, logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
             label_smoothing: float = 0.0) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.group, self.start, reduction, label_smoothing,
                                            vocab=self.out_features)

    def correct(self, logits: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
        return vocab_parallel_correct(logits, target, self.group, self.start)
