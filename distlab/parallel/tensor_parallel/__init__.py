"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) and the naive alternative: ``mappings`` (the
collectives as autograd functions), ``layers`` (column- and row-parallel linear layers), ``vocabulary``
(region, vocabulary and sequence layers for transformers) and ``plan`` (a model's plan applied, and
priced).

A linear layer ``y = x W^T + b`` with ``W`` of shape ``(out, in)`` can be split over the ``t`` ranks
of a tensor-parallel group two ways:

* **column parallel**: each rank holds ``out/t`` rows of ``W`` (output features) and computes its
  slice of ``y`` from the whole ``x``;
* **row parallel**: each rank holds ``in/t`` columns of ``W`` and, from its slice of ``x``, a
  partial ``y`` that must be summed over the group.

All communication lives in four small autograd functions (``f`` and ``g`` in the Megatron paper):

=====================  =========================  =============================
function               forward                    backward
=====================  =========================  =============================
``copy_to_group``      identity                   all-reduce the gradient
``reduce_from_group``  all-reduce                 identity
``gather_from_group``  all-gather the last dim    keep this rank's slice
``split_to_group``     keep this rank's slice     all-gather the last dim
``gather_sequence``    all-gather dim 1           reduce-scatter dim 1
``scatter_sequence``   reduce-scatter dim 1       all-gather dim 1
=====================  =========================  =============================

The last two are sequence parallel's (Korthikanti et al. 2022) replacements for ``copy_to_group``
and ``reduce_from_group`` around a block whose outside is split along the sequence (dim 1 of
``(batch, sequence, features)``): an all-gather plus a reduce-scatter move what one all-reduce does.

**Megatron style** (an MLP block ``B(act(A(x)))``): ``A`` column parallel, ``B`` row parallel --
the activation stays split between them, so a block costs one all-reduce forward (after ``B``)
and one backward (the input gradient of ``A``). **Naive style**: every layer column parallel with
its output gathered: an all-gather after every layer forward, and an all-reduce of every layer's
input gradient backward. Shards are slices of the full layer, so a model built from the same
seed and then sharded computes exactly what the unsharded one does. Which layers of a model are
split, and how, is the model's own plan (:mod:`distlab.parallel.tensor_parallel.plan` applies it).
"""

from __future__ import annotations

from distlab.parallel.tensor_parallel.layers import STYLES, ColumnParallelLinear, RowParallelLinear
from distlab.parallel.tensor_parallel.mappings import (all_gather_along, all_reduce_sum, copy_to_group,
                                                       gather_from_group, gather_sequence, reduce_from_group,
                                                       scatter_sequence, split_to_group)

__all__ = ["STYLES", "ColumnParallelLinear", "RowParallelLinear", "all_gather_along", "all_reduce_sum", "copy_to_group",
           "gather_from_group", "gather_sequence", "reduce_from_group", "scatter_sequence", "split_to_group"]
