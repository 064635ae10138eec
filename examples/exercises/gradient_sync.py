"""Exercise: data parallel's gradient sync (docs/exercises.md).

Write ``MySync.sync`` below, then grade it -- equal to one process, alone and under gradient accumulation:

    distlab verify --nproc 3 --dp-sync examples/exercises/gradient_sync.py:MySync
"""

from torch import nn

from distlab import comm
from distlab.parallel import SyncMethod


class MySync(SyncMethod):
    """After backward every rank holds the gradient of its own slice of the global batch."""

    def sync(self, module: nn.Module) -> None:
        """Make every trainable parameter's ``.grad`` the mean over the group's ranks (a parameter without one
        counts as zeros), with ``comm.all_reduce(tensor, op=..., algorithm=self.collective, group=self.group)``
        so its bytes are counted; ``self.world_size`` is the group's size."""
        raise NotImplementedError("write the sync: every .grad the mean over the ranks (see the docstring)")


__all__ = ["MySync", "comm"]
