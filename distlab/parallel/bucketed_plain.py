"""Bucketed data parallel as the idea reads (Li et al., VLDB 2020), nothing else (``--dp-sync bucketed_plain``): the
parameters, last layer first (about the order backward produces their gradients), cut into buckets of
``bucket_mb``; when a bucket's last gradient arrives, the bucket is flattened into one buffer and its all-reduce
starts at once, without waiting, while backward goes on computing earlier layers; the step waits for every bucket
and copies the mean back into ``.grad``.

:class:`~distlab.parallel.bucketed_sync.BucketedSync` (``bucketed``) is the same sync made safe and general (and
``tests/test_data_parallel.py`` holds the two to each other): buckets launched strictly in their order (a bucket
that fills early waits, so every rank issues the same collectives even where gradients arrive in another order),
a parameter without a gradient named (or counted as zero), gradient compression, and one process sending nothing."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from distlab import comm
from distlab.parallel.sync_methods import SyncMethod, flatten_grads, grad_params, unflatten_into_grads


class PlainBucketedSync(SyncMethod):
    name = "bucketed_plain"

    def __init__(self, group=None, collective: str = "native", bucket_mb: float = 25.0, **options):
        super().__init__(group, collective)
        self.bucket_bytes = bucket_mb * 2**20
        self.accumulating = False

    def wrap(self, module: nn.Module) -> nn.Module:
        self.buckets: list[list[nn.Parameter]] = [[]]
        for p in reversed(grad_params(module)):
            if self.buckets[-1] and sum(q.numel() * q.element_size() for q in self.buckets[-1] + [p]) > self.bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(p)
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.arrived = [0] * len(self.buckets)
        self.running: list[tuple[torch.Tensor, comm.Handle, list[nn.Parameter]]] = []
        for bucket in self.buckets:
            for p in bucket:
                p.register_post_accumulate_grad_hook(self._arrived)
        return module

    def _arrived(self, p: nn.Parameter) -> None:
        if self.accumulating:
            return
        b = self.bucket_of[id(p)]
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b]):  # the bucket is full: send it now, backward goes on
            with torch.no_grad():
                flat = flatten_grads(self.buckets[b])
            self.running.append((flat, comm.all_reduce(flat, "avg", self.collective, self.group, async_op=True),
                                 self.buckets[b]))

    @torch.no_grad()
    def sync(self, module: nn.Module) -> None:
        for flat, handle, params in self.running:
            handle.wait()
            unflatten_into_grads(flat, params)
        self.running, self.arrived = [], [0] * len(self.buckets)

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module):
        self.accumulating = True  # gradient accumulation: backward adds into .grad, nothing is sent
        try:
            yield
        finally:
            self.accumulating = False
