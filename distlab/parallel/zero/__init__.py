"""ZeRO stages 1-3 (Rajbhandari et al. 2020) over the data-parallel group, from collectives.

Plain data parallel keeps a full copy of parameters, gradients and optimizer state on each of
the ``N`` ranks. ZeRO shards them:

* **stage 1** -- optimizer state: gradients are reduce-scattered, each rank's optimizer updates
  only its ``1/N`` shard, and the updated shards are all-gathered back into the full parameters.
  Bytes sent per step: reduce-scatter + all-gather = exactly an all-reduce.
* **stage 2** -- plus gradients: the full gradients are freed as soon as their bucket is handed
  to the reduce-scatter, and one bucket is in flight at a time (a bucket's reduce-scatter overlaps
  the backward that fills the next): a rank holds ``1/N`` of the gradients plus one bucket.
* **stage 3** -- plus parameters: a rank keeps only its shard; a unit's full parameters are
  all-gathered just before its forward and freed after it, all-gathered again just before its
  backward (a pre-hook on the node that produced its output) and freed once its gradients are
  reduce-scattered. Bytes per step: two all-gathers + one reduce-scatter = 1.5x an all-reduce.

**Buckets (stages 1-2).** As the bucketed data parallel does for its all-reduce, parameters are
grouped in reverse registration order (about the order backward produces their gradients) into
buckets of at most ``bucket_mb``; a post-accumulate-grad hook counts each gradient in, and when a
bucket's last one arrives its gradients are copied rank-major into one flat buffer (row ``r`` =
rank ``r``'s slice of every parameter in the bucket) and one reduce-scatter starts
*asynchronously* -- ``async_op`` for the native collective, a communication thread for distlab's
algorithms -- while backward computes earlier layers. Buckets launch in index order on every
rank. After the optimizer step, one all-gather per bucket puts the updated shards back.

**Units and the flat partition.** Each parameter is a unit: flattened, zero-padded to a multiple
of ``N``, and rank ``r`` owns elements ``[r*S, (r+1)*S)`` with ``S = ceil(numel / N)``. The
parameter becomes a view of that padded buffer, so gathering into the buffer updates it in place;
when ``N`` divides its size (most weights) its gradient is reduce-scattered straight from
``.grad``, without a flat copy. Stage 3 gathers and frees the units of one module (a Linear, a
conv, a norm layer) together, around that module's forward and backward. The optimizer (any
element-wise torch optimizer: SGD with momentum, Adam, AdamW) is built over the shards, one flat
parameter per unit, so its state is sharded too; the zero padding has zero gradient and stays
zero under those updates.

Gradients are averaged over the group, so the step equals plain data parallel (and
single-process training on the global batch) up to float32 summation order. Parameters that get
no gradient in a step count as zero gradient (the partition needs every rank to reduce every
unit, in the same order).

The package: :mod:`~distlab.parallel.zero.units` (shards and padding, buckets),
:mod:`~distlab.parallel.zero.reduce` (stages 1-2: bucketed reduce-scatter overlapped with
backward), :mod:`~distlab.parallel.zero.gather` (stage 3: gather, prefetch, the sharded Linear),
:mod:`~distlab.parallel.zero.state` (snapshots, placement, accounting),
:mod:`~distlab.parallel.zero.wrapper` (:class:`Zero`), and :mod:`~distlab.parallel.zero.cost`
(ZeRO's bookkeeping replayed on sizes: the peak ``distlab plan`` predicts, equal to the measured one).
"""

from distlab.parallel.zero.units import COALESCE_BELOW, Shard, goes_alone, sharded_linear
from distlab.parallel.zero.wrapper import STAGES, Zero

__all__ = ["COALESCE_BELOW", "STAGES", "Shard", "Zero", "goes_alone", "sharded_linear"]
