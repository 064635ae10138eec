"""Exercise: SyncBatchNorm's backward (docs/exercises.md).

distlab's SyncBatchNorm computes the forward over the global batch (one all-reduce of the channel sums) and the
weight's and bias's gradients; you write the input's gradient -- the one that needs every rank's values. Then grade
it -- equal to one process on the whole batch, a CNN with batch norm, data parallel over 3 ranks:

    distlab verify --nproc 3 --strategy "allreduce+syncbn=examples/exercises/syncbn_backward.py:input_gradient"
"""

import torch


def input_gradient(g, xhat, scale, n, all_reduce):
    """dL/dx of batch norm over the global batch.

    ``g`` = dL/dy and ``xhat`` = (x - mean) / sqrt(var + eps), this rank's, shaped (N, C, ...); ``scale`` (C,) =
    weight / sqrt(var + eps); ``n`` the number of values per channel over every rank's batch; ``all_reduce(t)``
    sums ``t`` over the ranks in place. Per channel, with means over all n values:

        dL/dx = scale * (g - mean(g) - xhat * mean(g * xhat))
    """
    raise NotImplementedError("write the input gradient: the two means over every rank's values (see the docstring)")


__all__ = ["input_gradient", "torch"]
