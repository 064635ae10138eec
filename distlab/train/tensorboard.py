"""``--tensorboard DIR``: the run's numbers as TensorBoard event files, beside metrics.jsonl.

Written by rank 0 with torch's ``SummaryWriter`` (``tensorboard --logdir DIR`` shows them), at the
same steps as metrics.jsonl and the evaluations:

=======================  ===========================================================
``train/loss``           mean training loss of the log window
``train/lr``             learning rate
``train/samples_per_s``  throughput of the window's steps
``eval/test_loss`` ...   every evaluation field (test and validation loss, accuracy)
``memory/rank_R_rss_mb`` each rank's peak resident memory so far (MB)
``memory/rank_R_cuda_mb`` each rank's peak GPU memory so far, on a GPU run
=======================  ===========================================================

TensorBoard is an optional dependency (``pip install tensorboard``); asking for it without the
package is refused before launch with that line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.errors import ConfigError
from distlab.runtime import group_size
from distlab.train.metrics import peak_rss_mb

INSTALL = "pip install tensorboard (or pip install 'distlab[tensorboard]')"


def check_available() -> None:
    """Refuse ``--tensorboard`` where the package is missing, saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
    except ImportError:
        raise ConfigError(f"--tensorboard writes TensorBoard's event files, which needs the tensorboard package: "
                          f"{INSTALL}") from None


class TensorBoardLog:
    """Rank 0 writes; every rank calls :meth:`memory` (it gathers each rank's peaks)."""

    def __init__(self, directory: str | None, is_main: bool, device: torch.device, purge_step: int | None = None):
        self.device = device
        self.writer = None
        if directory and is_main:
            from torch.utils.tensorboard import SummaryWriter
            # a resumed run rewrites the steps after its snapshot: TensorBoard drops the older events past it
            self.writer = SummaryWriter(log_dir=directory, purge_step=purge_step)
        self.enabled = bool(directory)

    def scalars(self, prefix: str, record: dict, step: int) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key in ("step", "epoch", "time_s", "test_samples", "test_tokens") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def memory(self, step: int) -> None:
        """Each rank's peak memory (a gather over the world: every rank calls it when enabled)."""
        if not self.enabled:
            return
        cuda = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else -1.0
        mine = torch.tensor([peak_rss_mb(), cuda], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(group_size())]
        if len(every) > 1:
            dist.all_gather(every, mine)
        else:
            every = [mine]
        if self.writer is None:
            return
        for rank, values in enumerate(every):
            rss, cuda_mb = values.tolist()
            self.writer.add_scalar(f"memory/rank_{rank}_rss_mb", rss, step)
            if cuda_mb >= 0:
                self.writer.add_scalar(f"memory/rank_{rank}_cuda_mb", cuda_mb, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
