"""GPipe and 1F1B as they read, one model chunk per rank (``pp_schedule`` gpipe and 1f1b): a stage receives a
micro-batch's activations from the stage before, runs its layers, and sends the result on without waiting; in
backward it receives the gradient of its output from the stage after, runs backward and sends its input's gradient
back. The schedules differ only in order:

* GPipe -- every forward, then every backward: a stage holds all ``M`` micro-batches' activations;
* 1F1B -- stage ``s`` runs ``P - s - 1`` forwards to fill the pipeline, then one forward and one backward in turn,
  then the backwards left: it holds at most ``P - s`` micro-batches', and the bubble is GPipe's,
  ``(P - 1) / (M + P - 1)``.

The general executor (:meth:`~distlab.parallel.pipeline.stage.PipelineStage._actions`) runs every schedule from its
list of actions -- interleaved chunks, zero bubble's split backward -- and ``tests/test_pipeline.py`` holds it to
these loops bit for bit on GPipe and 1F1B (``PipelineStage.by_actions``)."""

from __future__ import annotations

import torch

GRAD = 1  # the tag of gradient messages (activations: 0)


def gpipe(stage, xs, ys, loss_fn) -> None:
    sends = []
    for i in range(stage.microbatches):  # every forward first
        sends += _forward(stage, xs, ys, i, loss_fn)
    for _ in range(stage.microbatches):  # then every backward, oldest first
        sends += _backward(stage)
    stage._wait(*sends, what="wait for sends")


def one_f_one_b(stage, xs, ys, loss_fn) -> None:
    m = stage.microbatches
    warm = min(stage.stages - stage.stage - 1, m)  # the later the stage, the sooner its first backward
    sends = []
    for i in range(warm):
        sends += _forward(stage, xs, ys, i, loss_fn)
    for i in range(warm, m):  # steady state: one forward, one backward
        sends += _forward(stage, xs, ys, i, loss_fn)
        sends += _backward(stage)
    for _ in range(warm):  # drain
        sends += _backward(stage)
    stage._wait(*sends, what="wait for sends")


def _forward(stage, xs, ys, i, loss_fn) -> list:
    """Micro-batch ``i``'s forward (its input from the stage before, but on the first); its output sent on."""
    stage._forward_one(xs[i] if stage.first else stage._recv_act(), ys[i], loss_fn)
    return [] if stage.last else stage._send_act(stage._saved[-1][1])  # in flight while the stage goes on


def _backward(stage) -> list:
    """The oldest held micro-batch's backward (its output's gradient from the stage after, but on the last); its
    input's gradient sent back."""
    grad = None
    if not stage.last:
        grad = torch.empty_like(stage._saved[0][1])
        stage._wait(stage._next.irecv(grad, GRAD), what="wait for a gradient")
    g_in = stage._backward_one(grad)
    return [] if stage.first else [stage._prev.isend(g_in.contiguous(), GRAD)]
