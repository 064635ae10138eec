"""The bucketed gradient syncs: distlab's ``bucketed`` and torch's DDP (``ddp``) behind the same
:class:`~distlab.parallel.sync_methods.SyncMethod` interface.

Parameters are grouped in reverse registration order (roughly the order backward produces their
gradients) into buckets of ``bucket_mb``; ``bucketed`` flattens a bucket and all-reduces it
*asynchronously the moment its last gradient is accumulated*, so communication overlaps the rest of
backward, and the optimizer step waits for all buckets -- what DDP does, in ~100 readable lines.
``ddp`` is torch's ``DistributedDataParallel`` with its bucket size, a non-native collective
installed as its communication hook.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from distlab import comm
from distlab.runtime import timeline
from distlab.errors import ConfigError
from distlab.parallel.compression import CastCodec, Codec, PowerSGD

from distlab.parallel.sync_methods import SyncMethod, flatten_grads, grad_params, module_device, unflatten_into_grads


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.ready: set[int] = set()
        self.buffer: torch.Tensor | None = None
        self.work: comm.Handle | None = None  # its all-reduce under way
        self.is_sum = True  # the buffer will hold the sum (divide by the group size), else the mean


class _BucketSync(SyncMethod):
    """Base of the methods that reduce in buckets of ``bucket_mb`` MB during backward."""

    def __init__(self, group=None, collective: str = "native", bucket_mb: float = 25.0,
                 find_unused: bool = False, codec: Codec | None = None, **options):
        super().__init__(group, collective, codec)
        if not bucket_mb > 0:
            raise ConfigError(f"`bucket_mb` must be positive, not {bucket_mb}")
        self.bucket_mb = bucket_mb
        self.find_unused = find_unused


class BucketedSync(_BucketSync):
    """Bucketed all-reduce overlapped with backward (the idea behind DDP, Li et al. VLDB 2020).

    At wrap time parameters are grouped, in reverse registration order, into buckets of at most
    ``bucket_mb`` MB (a larger parameter gets a bucket to itself). A post-accumulate-grad hook on
    every parameter marks it ready; when a bucket's last parameter is ready, its gradients are
    copied into one flat buffer and its all-reduce starts asynchronously -- ``async_op=True`` for
    the native collective, a dedicated communication thread for distlab's algorithms -- while
    backward goes on computing earlier layers' gradients. Buckets are launched strictly in index
    order (a bucket that becomes ready early waits for its predecessors), so every rank issues
    the same collectives in the same order. ``sync()`` waits for all of them and copies the
    averaged gradients back.

    A parameter that receives no gradient in a step would leave its bucket unlaunched forever;
    by default that is an error naming the parameter, with ``find_unused=True`` its gradient
    counts as zero (like DDP's ``find_unused_parameters``).
    """

    name = "bucketed"

    def __init__(self, group=None, collective: str = "native", bucket_mb: float = 25.0,
                 find_unused: bool = False, codec: Codec | None = None, **options):
        super().__init__(group, collective, bucket_mb, find_unused, codec)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.buckets: list[_Bucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket index, position)
        self.names: dict[int, str] = {}
        self.next_launch = 0
        self.enabled = True
        self._hooks = []

    def wrap(self, module: nn.Module) -> nn.Module:
        self.names = {id(p): name for name, p in module.named_parameters()}
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(grad_params(module)):
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > self.bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        for b, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self.where[id(p)] = (b, i)
                if self.world_size > 1:  # one process has nothing to send: no Python call per gradient
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        return module

    # -- during backward ---------------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self.enabled or self.world_size == 1:
            return
        b, i = self.where[id(p)]
        self.buckets[b].ready.add(i)
        self._launch_ready()

    def _launch_ready(self) -> None:
        while (self.next_launch < len(self.buckets)
               and len(self.buckets[self.next_launch].ready) == len(self.buckets[self.next_launch].params)):
            self._launch(self.buckets[self.next_launch])
            self.next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        with torch.no_grad():
            bucket.buffer = flatten_grads(bucket.params)
            bucket.is_sum = self.codec.exact
            if isinstance(self.codec, CastCodec) and self.collective == "native":  # pre-divided, narrow, summed
                bucket.buffer = bucket.buffer.div_(self.world_size).to(self.codec.dtype)
        if not self.codec.exact and not (isinstance(self.codec, CastCodec) and self.collective == "native"):
            shapes = [p.shape for p in bucket.params]  # a codec of several collectives: on the communication thread
            bucket.work = comm.run_async(self.codec.all_reduce_mean, bucket.buffer, shapes,
                                         self.buckets.index(bucket), self.collective, self.group)
        else:
            bucket.work = comm.all_reduce(bucket.buffer, "sum", self.collective, self.group, async_op=True)
        if timeline.active():
            size = bucket.buffer.numel() * bucket.buffer.element_size()
            timeline.async_span(f"bucket {self.buckets.index(bucket)} all-reduce {timeline.size_text(size)}",
                                bucket.work, bytes=size)

    # -- at the step ---------------------------------------------------------------------------

    @torch.no_grad()
    def sync(self, module: nn.Module) -> None:
        if self.world_size == 1:
            return
        if self.next_launch < len(self.buckets):  # some parameters got no gradient this step
            missing = [self.names.get(id(p), "?") for b in self.buckets[self.next_launch:]
                       for i, p in enumerate(b.params) if i not in b.ready]
            if not self.find_unused:
                self._reset()
                raise ConfigError(
                    f"{len(missing)} parameter(s) received no gradient in this step ({', '.join(missing[:5])}"
                    f"{', ...' if len(missing) > 5 else ''}); pass `find_unused` to treat "
                    f"their gradients as zero, or remove them from the model")
            for b in self.buckets[self.next_launch:]:
                b.ready = set(range(len(b.params)))
            self._launch_ready()
        try:
            for bucket in self.buckets:
                bucket.work.wait()
                if bucket.is_sum:
                    bucket.buffer.div_(self.world_size)
                unflatten_into_grads(bucket.buffer, bucket.params)
        finally:
            self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.buffer = bucket.work = None
        self.next_launch = 0

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module) -> Iterator[None]:
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def _ddp_comm_hook(state, bucket):  # no annotations: DDP rejects the string ones of `from __future__`
    """DDP communication hook averaging DDP's bucket with distlab's codec and all-reduce algorithm
    (``state`` = (codec, algorithm, group)); returns a completed ``Future[Tensor]``."""
    codec, algorithm, group = state
    buf = bucket.buffer()
    codec.all_reduce_mean(buf, [buf.shape], bucket.index(), algorithm, group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


class TorchDDPSync(_BucketSync):
    """torch's ``DistributedDataParallel`` (Li et al., VLDB 2020): gradients are all-reduced in
    buckets of ``bucket_mb`` MB during backward, overlapping communication with computation.
    A non-native ``collective`` replaces DDP's all-reduce through a communication hook (it runs
    synchronously inside the hook, so it does not overlap)."""

    name = "ddp"

    def wrap(self, module: nn.Module) -> nn.Module:
        device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
        own = [n for n, p in module.named_parameters() if hasattr(p, "sync_group")]
        if own:  # expert shards: neither broadcast nor reduced over the data-parallel group
            nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, own)
        ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, process_group=self.group, bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self.find_unused)
        if isinstance(self.codec, PowerSGD):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            # torch needs two plain iterations before compressing with error feedback (its minimum)
            state = powerSGD_hook.PowerSGDState(process_group=self.group, matrix_approximation_rank=self.codec.rank,
                                                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                                min_compression_rate=2, random_seed=0)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            self.powersgd = state
        elif isinstance(self.codec, CastCodec) and self.codec.name == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(self.group, default_hooks.fp16_compress_hook)
        elif self.collective != "native" or not self.codec.exact:  # torch's bf16 hook needs NCCL: distlab's cast
            ddp.register_comm_hook((self.codec, self.collective, self.group), _ddp_comm_hook)
        return ddp

    def sync(self, module: nn.Module) -> None:
        pass  # DDP already reduced during backward

    def state_dict(self) -> dict:
        """torch's PowerSGD hook state (error feedback, warm-start P and Q per bucket, its iteration and
        random generator) as tensors and numbers; {} for the other hooks."""
        s = getattr(self, "powersgd", None)
        if s is None:
            return {}
        kind, keys, pos, has_gauss, gauss = s.rng.get_state()
        return {"powersgd": {"iter": s.iter, "error": dict(s.error_dict), "p": dict(s.p_memory_dict),
                             "q": dict(s.q_memory_dict), "next_stats_report": s.next_stats_report,
                             "numel": [s.total_numel_before_compression, s.total_numel_after_compression],
                             "rng": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                                     "has_gauss": int(has_gauss), "gauss": float(gauss)}}}

    def load_state_dict(self, state: dict) -> None:
        s, saved = getattr(self, "powersgd", None), state.get("powersgd")
        if s is None or saved is None:
            return
        s.iter, s.next_stats_report = int(saved["iter"]), int(saved["next_stats_report"])
        s.error_dict, s.p_memory_dict, s.q_memory_dict = dict(saved["error"]), dict(saved["p"]), dict(saved["q"])
        s.total_numel_before_compression, s.total_numel_after_compression = (int(n) for n in saved["numel"])
        r = saved["rng"]
        s.rng.set_state(("MT19937", r["keys"].numpy().astype("uint32"), r["pos"], r["has_gauss"], r["gauss"]))

    def uncounted_bytes(self, module: nn.Module) -> int:
        """DDP's own all-reduce runs inside autograd, out of distlab's sight: its textbook volume.
        A distlab collective installed as its hook is counted like any other; torch's compression hooks
        count at their compressed volume."""
        return (self.bytes_per_sync(module) or 0) if self.collective == "native" and self.world_size > 1 else 0

    def no_sync(self, module: nn.Module):
        return module.no_sync()

    @property
    def rebuilds_buckets(self) -> bool:
        """DDP re-cuts its buckets after the first backward, in the order gradients arrived (not
        with ``find_unused_parameters``)."""
        return not self.find_unused
