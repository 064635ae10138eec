"""The two step schedules (:class:`~distlab.parallel.protocols.StepSchedule`): accumulate k
micro-batches, or run this rank's pipeline stage.

The Engine calls ``forward_backward`` and then syncs; neither schedule syncs itself. Both run
every backward but the step's last under ``engine.no_sync()``, so data parallel and ZeRO reduce
once per step, overlapped with the last backward where the method can.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch
import torch.distributed as dist

from distlab import comm
from distlab.errors import ConfigError
from distlab.models.aux_loss import step_share
from distlab.models.packing import Packed, bind
from distlab.parallel.pipeline import ActivationMeter, PipelineStage, ideal_bubble
from distlab.runtime import reduce_scalars, timeline


class Accumulate:
    """``k`` equal micro-batches per step (``strategy.grad_accum``): each loss divided by ``k``, so
    the accumulated gradient is the mean over the whole local batch and the step equals one step on
    the k-times-larger batch. ``k == 1`` is a plain step."""

    MEASURED_STEP = 2  # the step whose activations are metered (the first may build caches)
    tied: dict[str, str] = {}  # a whole model holds its tied parameters once: nothing to reduce

    def __init__(self, k: int = 1):
        self.k = k
        self.steps = 0
        self.activation_peak_bytes: int | None = None  # saved for backward at once, one metered step

    def forward_backward(self, engine, x: torch.Tensor, y: torch.Tensor,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         fields: Packed | None = None) -> torch.Tensor:
        self.steps += 1
        try:
            if self.steps != self.MEASURED_STEP:
                return self._run(engine, x, y, loss_fn, fields)
            with ActivationMeter(engine.module.parameters()) as meter:  # one step: the hooks cost a little
                loss = self._run(engine, x, y, loss_fn, fields)
            self.activation_peak_bytes = meter.peak
            return loss
        finally:
            bind(engine.module, None)  # what runs next (an evaluation, a sample) reads its own batch

    def _run(self, engine, x: torch.Tensor, y: torch.Tensor, loss_fn, fields: Packed | None) -> torch.Tensor:
        k = self.k
        if len(x) % k:  # never drop len(x) % k samples, nor weigh them differently
            raise ConfigError(f"a batch of {len(x)} samples does not split into {k} equal accumulation micro-batches "
                              f"(grad_accum): give a batch that {k} divides")
        if k == 1:  # one micro-batch: the same step (a share of 1 is the default), without the split's contexts
            bind(engine.module, fields)  # read by the forward and by a block recomputed in backward
            with timeline.span("forward"), engine.precision.autocast():
                loss = loss_fn(engine(x), y)
            with timeline.span("backward"):
                engine.precision.backward(loss)
            return loss.detach().to(torch.float64)
        micro = len(x) // k
        total = None
        with step_share(1 / k):  # a loss the model adds itself (a mixture's balance loss) is divided alike
            for i in range(k):
                xm, ym = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
                bind(engine.module, fields.rows(i * micro, (i + 1) * micro) if fields is not None else None)
                with engine.no_sync() if i < k - 1 else contextlib.nullcontext():
                    with timeline.span("forward", micro_batch=i), engine.precision.autocast():
                        loss = loss_fn(engine(xm), ym) / k
                    with timeline.span("backward", micro_batch=i):
                        engine.precision.backward(loss)
                # the micro-batch losses summed in float64, as Python floats would be; read when the caller wants
                part = loss.detach().to(torch.float64)
                total = part if total is None else total + part
        return total

    def infer(self, engine, x: torch.Tensor, fields: Packed | None = None) -> torch.Tensor:
        bind(engine.module, fields)
        try:
            return engine(x)
        finally:
            bind(engine.module, None)

    def model_key(self, key: str) -> str:
        return key

    def gather_stages(self, mine):
        return [mine]

    def gather_model(self, pairs):
        return list(pairs)

    def stages(self) -> list[dict]:
        return []

    def reduce_gradients(self, engine) -> None:
        pass

    def report(self, warmup: int, device) -> dict:
        """The most activation bytes any rank held for backward at once (one metered step)."""
        if self.activation_peak_bytes is None:
            return {}
        held, = reduce_scalars([self.activation_peak_bytes], op=dist.ReduceOp.MAX, device=device)
        return {"activation_peak_bytes": int(held),
                "activation_basis": f"storages autograd saved for backward at once (parameters excepted), step "
                                    f"{self.MEASURED_STEP}, the most of any rank"}


class Pipelined:
    """This rank's :class:`~distlab.parallel.PipelineStage` runs its schedule (GPipe or 1F1B) over
    ``microbatches`` micro-batches; the loss, known on the last stage, is broadcast along the
    pipeline so every rank returns it. Each step's timings are kept for :meth:`report`."""

    def __init__(self, stage: PipelineStage, mesh, ties: list[list[str]] = ()):
        self.stage, self.mesh = stage, mesh
        self.timings: list[dict] = []  # PipelineStage.last_timing of every step
        self._tie_groups(list(ties))

    def forward_backward(self, engine, x, y, loss_fn, fields: Packed | None = None) -> torch.Tensor:
        stage = self.stage
        with step_share(1 / stage.microbatches):
            loss = stage.train_step(x if stage.first else None, y if stage.last else None, loss_fn, engine.no_sync,
                                    batch_size=len(x) if x is not None else None, precision=engine.precision,
                                    fields=fields)
        self.timings.append(stage.last_timing)
        value = (loss.detach() if loss is not None else torch.zeros(())).reshape(1).to(torch.float32)
        dist.broadcast(value, src=self.mesh.pp_ranks[-1], group=self.mesh.pp_group)
        return value[0].to(torch.float64)

    def infer(self, engine, x: torch.Tensor, fields: Packed | None = None) -> torch.Tensor | None:
        return self.stage.infer(x, fields)

    def model_key(self, key: str) -> str:
        return self.stage.model_key(key)

    def gather_stages(self, mine):
        parts = [None] * self.mesh.pp
        dist.all_gather_object(parts, mine, group=self.mesh.pp_group)
        return parts

    def gather_model(self, pairs):
        """Each rank's pairs split by chunk, gathered, and laid out virtual stage by virtual stage
        (chunk ``c`` of rank ``r`` is stage ``c P + r``)."""
        stage = self.stage
        chunks = [[(stage.model_key(k), v) for k, v in pairs if stage.chunk_of(k) == c] for c in range(stage.virtual)]
        parts = self.gather_stages(chunks)
        return [kv for c in range(stage.virtual) for part in parts for kv in part[c]]

    def stages(self) -> list[dict]:
        return self.stage.describe()

    def _tie_groups(self, ties: list[list[str]]) -> None:
        """The pairs of each pipeline's first and last stage, where a parameter is tied across them (every
        rank makes every pair's group, in one order: new_group is collective over the world)."""
        self.tied = {name: group[0] for group in ties for name in group[1:]}
        self.pair = None
        if not ties:
            return
        if self.mesh.pp == 2:
            self.pair = self.mesh.pp_group
            return
        pipelines = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, list(self.mesh.pp_ranks))
        for ranks in sorted({tuple(p) for p in pipelines}):
            group = dist.new_group([ranks[0], ranks[-1]])
            if self.mesh.rank in (ranks[0], ranks[-1]):
                self.pair = group

    def reduce_gradients(self, engine) -> None:
        """A parameter tied across the first and last stage (an embedding and its LM head): each stage's
        copy took its own layers' gradient; both get the sum, so the copies stay one parameter."""
        if self.pair is None:
            return
        if not hasattr(self, "_tied_index"):
            from distlab.parallel.placement import placement_of
            names = [p["name"] for p in placement_of(engine)["params"]]
            held = {*self.tied, *self.tied.values()}
            self._tied_index = [i for i, name in enumerate(names) if name in held]
        params = engine.parameters()
        for i in self._tied_index:
            grad = params[i].grad
            if grad is None:  # no loss reached it this step: its copy on the other stage still sends its share
                grad = params[i].grad = torch.zeros_like(params[i])
            comm.all_reduce(grad, op="sum", group=self.pair)

    def report(self, warmup: int, device) -> dict:
        """The stages, schedule and measured bubble (every rank calls it: it reduces over the world)."""
        stage = self.stage
        timings = self.timings[min(warmup, len(self.timings) // 2):]
        bubble = statistics.median(t["bubble_measured"] for t in timings) if timings else 0.0
        peak = max((t["in_flight_peak"] for t in timings), default=0)
        held = max((t["activation_peak_bytes"] for t in timings), default=0)
        total, = reduce_scalars([bubble], device=device)
        worst, held = reduce_scalars([peak, held], op=dist.ReduceOp.MAX, device=device)
        return {"pipeline": {
            "stages": stage.describe(), "microbatches": stage.microbatches, "schedule": stage.schedule,
            "bubble_measured": total / dist.get_world_size(),
            "bubble_ideal": ideal_bubble(stage.stages, stage.microbatches, stage.schedule, stage.virtual),
            **({"virtual": stage.virtual} if stage.virtual > 1 else {}),
            "in_flight_peak": int(worst), "activation_peak_bytes": int(held),
            "bubble_basis": "per step, the share of a stage's step spent waiting for a neighbour's activation or "
                            "gradient (median over steps after warm-up, mean over ranks); ideal: (P - 1) / (M + P - 1); "
                            "in_flight_peak and activation_peak_bytes (storages saved for backward, parameters "
                            "excepted): the most any stage held at once"}}
