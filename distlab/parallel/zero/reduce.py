"""ZeRO's gradient reduction: stages 1-2 reduce-scatter buckets as backward fills them (overlapped,
in bucket order on every rank; stage 2 keeps one in flight), stage 3 each module's units once
their gradients are in. Small units share one collective; narrow wire dtypes are pre-divided."""

from __future__ import annotations

import torch

from distlab import comm
from distlab.errors import ConfigError
from distlab.runtime import timeline
from distlab.parallel.zero.units import Unit, describe, goes_alone


class BucketedReduce:
    """The reduce half of :class:`~distlab.parallel.zero.Zero` (attributes set by its constructor)."""

    def _on_bucket_grad(self, b: int) -> None:
        if not self._syncing:
            return
        bucket = self.buckets[b]
        if b < self._next_launch:
            raise ConfigError("a second backward reached a bucket already being reduced: run every backward but a "
                              "step's last under `no_sync()` (gradient accumulation), then sync_gradients()")
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].ready >= len(self.buckets[self._next_launch].units)):
            self._launch(self._next_launch)
            self._next_launch += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients rank-major into one buffer (freeing each full gradient once
        copied) and start its reduce-scatter; stage 2 first completes the bucket before."""
        if self.stage == 2 and b >= 1:
            self._finish(b - 1)  # one bucket in flight: its reduce overlapped the backward that filled this one
        bucket = self.buckets[b]
        units, n = bucket.units, bucket.units[0].n
        wire = self.reduce_dtype
        if len(units) == 1:
            bucket.flat = self._narrow(units[0].flat_grad())
        else:
            bucket.flat = torch.empty(n * bucket.shard_numel, dtype=wire or units[0].full.dtype,
                                      device=units[0].full.device)
            rows, col = bucket.flat.view(n, bucket.shard_numel), 0
            for u in units:  # row r = rank r's slice of every unit, so one reduce-scatter serves them all
                rows[:, col:col + u.shard_numel].copy_(self._narrow(u.flat_grad()).view(n, u.shard_numel))
                col += u.shard_numel
                u.param.grad = None
        units[0].param.grad = None  # a lone unit's buffer may be its gradient: the bucket holds it now
        bucket.out = torch.empty(bucket.shard_numel, dtype=bucket.flat.dtype, device=bucket.flat.device)
        op = "sum" if wire is not None else "avg"  # a narrow dtype is pre-divided (no float16 overflow)
        self._observe()
        bucket.work = comm.reduce_scatter(bucket.out, bucket.flat, op, self._rs, self.group, scratch=True,
                                          async_op=True)  # the bucket is scratch once sent
        if timeline.active():
            size = bucket.flat.numel() * bucket.flat.element_size()
            timeline.async_span(f"bucket {b} reduce-scatter {timeline.size_text(size)}", bucket.work, bytes=size)

    def _finish(self, b: int) -> None:
        """Wait for bucket ``b``'s reduce-scatter; its units' shard gradients become views of the result."""
        bucket = self.buckets[b]
        if bucket.out is None:
            return
        bucket.work.wait()
        if self.replicate is not None:  # hybrid sharding: averaged across the groups (before a cast back: waited)
            self._cross(bucket.out, wait=self.reduce_dtype is not None)
        out = bucket.out if self.reduce_dtype is None else bucket.out.to(bucket.units[0].full.dtype)
        offset = 0
        for u in bucket.units:
            u.shard.grad = out[offset:offset + u.shard_numel]
            offset += u.shard_numel
            u.reduced = True
        bucket.flat = bucket.out = bucket.work = None

    @staticmethod
    def _groups(units: list[Unit]) -> list[list[Unit]]:
        """Collective batches: a large unit goes alone (without padding its gradient and its full
        buffer are used in place; with padding, one padded copy of its gradient); the small ones
        share one collective (a copy of small tensors is cheaper than a collective's latency)."""
        alone = [[u] for u in units if goes_alone(u.numel)]
        small = [u for u in units if not goes_alone(u.numel)]
        by_dtype: dict[torch.dtype, list[Unit]] = {}
        for u in small:
            by_dtype.setdefault(u.full.dtype, []).append(u)
        return alone + list(by_dtype.values())

    def _reduce(self, units: list[Unit]) -> None:
        """Reduce-scatter (average) the gradients of ``units`` into their shards' gradients and drop
        the full gradients."""
        for group in self._groups(units):
            n = group[0].n
            flats = [self._narrow(u.flat_grad()) for u in group]
            # rank-major: row r = rank r's slice of every unit, so one reduce-scatter serves them all
            flat = flats[0] if len(group) == 1 else torch.cat(
                [f.view(n, u.shard_numel) for u, f in zip(group, flats)], dim=1).view(-1)
            self._observe(*flats, flat)
            out = torch.empty(flat.numel() // n, dtype=flat.dtype, device=flat.device)
            op = "sum" if self.reduce_dtype is not None else "avg"
            with timeline.span(f"reduce-scatter {describe(group)} {timeline.size_text(flat.numel() * flat.element_size())}",
                               "communication"):
                comm.reduce_scatter(out, flat, op=op, algorithm=self._rs, group=self.group, scratch=True)
            if self.replicate is not None:  # hybrid sharding: the shard averaged across the groups too
                self._cross(out, wait=self.reduce_dtype is not None)
            if self.reduce_dtype is not None:
                out = out.to(group[0].full.dtype)
            if group[0].store is not None:  # --offload params: the shard gradients kept beside the shards (complete
                self._crossed()  # first: the all-reduce across shard groups writes into `out`)
            offset = 0
            for u in group:
                u.shard.grad = u.offloaded_grad(out[offset:offset + u.shard_numel])
                offset += u.shard_numel
                u.reduced = True
                u.param.grad = None

    def _cross(self, shard: torch.Tensor, wait: bool) -> None:
        """Hybrid sharding: start averaging this rank's reduced ``shard`` (in place) over the ranks holding the
        same one -- the only bytes that cross the shard groups (:mod:`~distlab.parallel.zero.hsdp`); waited for
        now if ``wait``, else by :meth:`_crossed` (the shard gradients are views of it: complete before the step)."""
        op = "sum" if self.reduce_dtype is not None else "avg"  # (a narrow dtype's values were pre-divided)
        work = comm.all_reduce(shard, op, self._ar, self.replicate, async_op=True)
        if timeline.active():
            size = shard.numel() * shard.element_size()
            timeline.async_span(f"all-reduce across shard groups {timeline.size_text(size)}", work, bytes=size)
        self._crossing.append(work)
        if wait:
            self._crossed()

    def _crossed(self) -> None:
        """Wait for the all-reduces :meth:`_cross` started."""
        while self._crossing:
            self._crossing.pop(0).wait()

    def _narrow(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as it travels: divided by the replicas and cast when gradients travel in a narrower
        dtype (the sum of ``N`` pre-divided values is the mean, without float16 overflow)."""
        if self.reduce_dtype is None or flat.dtype == self.reduce_dtype:
            return flat
        return flat.div(self.replicas).to(self.reduce_dtype)
