"""Exercise: ZeRO-2's step (docs/exercises.md).

The partition is done for you (``distlab.parallel.zero.plain.PlainZero``): every trainable parameter flattened,
zero-padded to ``self.n * s`` elements and cut in ``self.n`` shards of ``s``; this rank keeps shard ``self.rank``
in ``self.shards`` (the optimizer steps those alone). Write the two halves of the step below, then grade them --
equal to one process, alone and under gradient accumulation:

    distlab verify --nproc 3 --strategy "zero=2+zero_impl=examples/exercises/zero2_step.py:MyZero2"
"""

import torch

from distlab import comm
from distlab.parallel.zero.plain import PlainZero


class MyZero2(PlainZero):
    """``self.params``: (name, parameter) of each trainable parameter; ``self.size``: each one's shard size ``s``;
    ``self.shards``: this rank's shards (flat ``nn.Parameter``s); ``self._padded(t, s)``: ``t`` flattened and
    zero-padded to ``self.n * s`` elements; ``self.collective``, ``self.group``: what to call collectives with."""

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """After backward: each shard's ``.grad`` the group's mean of that shard of the gradient (a parameter
        without a gradient counts as zeros) -- ``comm.reduce_scatter(out, inp, op="avg",
        algorithm=self.collective, group=self.group)`` -- and, this being stage 2, the full gradients dropped."""
        raise NotImplementedError("write sync_gradients: reduce-scatter each gradient into its shard (see the "
                                  "docstring)")

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer stepped the shards: every parameter whole again, from every rank's shard --
        ``comm.all_gather(out, shard, algorithm=self.collective, group=self.group)`` -- and set as
        ``p.data = ...`` (the parameter's shape is ``self.shapes[id(p)]``)."""
        raise NotImplementedError("write after_step: all-gather the updated shards into the parameters")


__all__ = ["MyZero2", "comm"]
