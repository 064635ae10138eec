"""Pipeline parallel: a model's layers in ``P`` stages on ``P`` ranks, micro-batches flowing through.

The model is a sequence of layers: an ``nn.Sequential`` (the GPT: embedding, blocks, head), or a
model that lists its layers in order with ``pipeline_layers()`` (the MLP; VGG's features, pool and
classifier; ResNet's stem, blocks and head) -- :func:`sequential_layers`. :func:`partition` cuts
it into ``P`` contiguous stages balanced by parameter count (or at the layer counts given).
Stage ``s`` runs on rank ``s`` of the pipeline group: it receives its input activation from stage ``s - 1`` (the first stage reads the batch),
runs its layers, and sends the output to stage ``s + 1``; the last stage computes the loss. In the
backward pass gradients travel the other way. A step splits the batch into ``M`` micro-batches,
each loss divided by ``M``, so the accumulated gradients are those of the whole batch: the step
equals one step of the unsplit model.

Two schedules (the order in which each stage runs its ``M`` forwards and ``M`` backwards):

* **GPipe** (Huang et al. 2019): all forwards, then all backwards. Every stage holds the
  activations of all ``M`` micro-batches at the turn.
* **1F1B** (PipeDream-flush, Narayanan et al. 2021): stage ``s`` runs ``P - s - 1`` forwards to
  fill the pipeline, then alternates one forward and one backward, then drains. It holds at most
  ``P - s`` micro-batches' activations, whatever ``M``; the idle time is the same as GPipe's.

Either way a stage idles while the pipeline fills and drains: the *bubble*, ``(P - 1) / (M + P - 1)``
of the step with equal stages. Two schedules shrink it:

* **Interleaved 1F1B** (Narayanan et al. 2021, Megatron-LM's virtual pipeline; ``virtual`` V > 1):
  the layers are cut into ``P x V`` chunks and rank ``r`` holds chunks ``r, r + P, r + 2P, ...``, so
  a micro-batch crosses every rank V times, each pass a V-th of the work: filling and draining cost
  a V-th as long, the bubble ``(P - 1) / (V M + P - 1)``, for V times the messages.
* **Zero bubble** (``zb``: ZB-H1 of Qi et al. 2024): each backward is split in two -- ``B``, the
  gradient of the stage's input, which the previous stage waits for, and ``W``, the gradients of
  its weights, which nobody waits for -- and the ``W`` passes fill the slots where 1F1B idles. ``W``
  starts from the output of each operation that read a weight (:mod:`.weight_pass`), so it runs no
  collective a layer puts after its product (sequence parallel's reduce-scatter, expert parallel's combine).

Both run from an explicit action list per rank (:func:`schedule_actions`): a list scheduler plays
the step on every rank with unit costs (forward 1, backward 2, or ``B`` 1 and ``W`` 1), always taking
a ready backward first, then a forward while the rank holds fewer micro-batches than the 1F1B limit
(Megatron's warm-up count when interleaved), then a ``W``. Each rank runs its actions in that order;
(a micro-batch counts as held until its last backward pass -- its ``W`` under zero bubble, which
keeps the graph for it: ZB-H1's memory, 1F1B's limit); the order is a topological order of the step's dependencies and every send is non-blocking, so
no schedule can deadlock, and each message stream (one per chunk boundary and direction, its own
tag) carries its micro-batches in order. The same simulation gives each schedule's ideal bubble. :attr:`PipelineStage.last_timing` measures it per step: time spent
waiting for a neighbour's message over the step's time.

Messages are point-to-point (:mod:`distlab.comm.p2p`, so the bytes are counted): an activation
goes with a small header giving its shape (stage outputs differ in shape: a CNN's feature maps, a
transformer's ``(B, T, C)``); a gradient has its activation's shape, which the sender's neighbour
knows. A send and the receive a stage needs next are posted together, so neighbours never wait on
each other's sends.
The package, one idea per module: :mod:`~distlab.parallel.pipeline.partition` (the layers and where
they are cut), :mod:`~distlab.parallel.pipeline.actions` (the schedules as action lists and their ideal
bubble), :mod:`~distlab.parallel.pipeline.stage` (a rank's stage: its layers, messages and step loops).
"""

from distlab.parallel.pipeline.actions import SCHEDULES, check_virtual, ideal_bubble, schedule_actions
from distlab.parallel.pipeline.partition import cut, partition, sequential_layers
from distlab.parallel.pipeline.activation_meter import ActivationMeter
from distlab.parallel.pipeline.stage import ACT, GRAD, PipelineStage, check_microbatches

__all__ = ["ACT", "GRAD", "ActivationMeter", "PipelineStage", "SCHEDULES", "check_microbatches", "check_virtual",
           "cut", "ideal_bubble", "partition", "schedule_actions", "sequential_layers"]
