"""``distlab plan --dry-run RANK``: one rank of a layout at full size, on this CPU, without its memory.

The model is built on the meta device (tensors with shapes and no storage), torch's *fake* process group
stands in for the other ranks (every collective completes at once, nothing is sent), and distlab's own
code path runs on it: :func:`~distlab.parallel.parallelize` places rank ``RANK``'s part exactly as a run
places it (ZeRO's shards, tensor parallel's slices, a pipeline stage's layers), then two steps of forwards,
backwards and optimizer steps run on token windows of meta tensors. What the rank holds is then *measured*
the way a run measures it -- the engine's peak of parameters + gradients + optimizer state
(:attr:`~distlab.parallel.Engine.peak_bytes`), and the activations autograd saves, each storage once
(:class:`~distlab.parallel.pipeline.ActivationMeter`) -- so the planner's formula can be checked against
distlab's code at 8B and 70B on 64-512 ranks, where no machine here could hold one rank's tensors.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distlab.errors import ConfigError
from distlab.runtime.meta import on_meta_device


def unfollowable(strategy) -> str | None:
    """Why a layout's step reads tensors' values on the way (None where it does not): a dry run has none."""
    if strategy.pp > 1:
        return f"`pp` {strategy.pp}: a pipeline stage reads the shapes its neighbour sends"
    if strategy.ep > 1:
        return f"`ep` {strategy.ep}: expert parallel sends each expert the tokens routed to it, counted from values"
    if strategy.dp_sync == "ddp":
        return "`dp_sync` ddp: torch's DistributedDataParallel reads values while it reduces"
    return None


def dry_run(family: str, options, classes: int, shape: tuple[int, ...], strategy, world: int, rank: int,
            global_batch: int, optimizer: str = "adamw", lora=None, attention: str = "math") -> dict:
    """Rank ``rank`` of ``world`` running ``strategy`` on the meta device: its model state and saved activations,
    measured (two steps: the second metered, as a run meters its second). ``shape``: a sample's (a language
    model's window: ``(tokens,)``); ``classes``: the vocabulary or the classes; ``lora``: a
    :class:`~distlab.models.lora.LoRASpec`; ``attention="flash"``: attention as a GPU's fused kernel runs it
    (:class:`~distlab.plan.trace.FlashAttention`)."""
    import contextlib

    from distlab.plan.kernels import FlashAttention
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlab.models import build_model
    from distlab.parallel.mesh import Mesh
    from distlab.parallel.parallelize import parallelize
    from distlab.parallel.state_bytes import optimizer_tensors, storage_bytes
    if not 0 <= rank < world:
        raise ConfigError(f"--dry-run {rank}: the layout has ranks 0..{world - 1}")
    if dist.is_initialized():
        raise ConfigError("--dry-run runs one rank in its own process group: call it outside a distributed run")
    follows = unfollowable(strategy)
    if follows:
        raise ConfigError(f"--dry-run: {follows}, which a meta tensor does not have; dry-run the layout without it "
                          f"(the plan's figures for it stand as they are)")
    # the meta device runs no autocast and compiles nothing: float32 throughout, the model state unchanged
    strategy = strategy.replace(precision="fp32", compile=False)
    strategy.check(world)
    strategy.check_batch(global_batch, world)
    t0 = time.perf_counter()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = Mesh.of(strategy)
        with on_meta_device():
            model = build_model(family, shape, classes, options=options)
        if lora is not None:
            from distlab.models import lora as adapters
            adapters.apply(model, lora)
        engine = parallelize(model, strategy, mesh, device=torch.device("meta"))
        opt_cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
        trained = [p for p in engine.parameters() if p.requires_grad]
        opt = engine.attach(opt_cls(trained, lr=1e-3, **({"momentum": 0.9} if optimizer == "sgd" else {})))
        local = global_batch // strategy.dp_size(world)
        text = len(shape) == 1  # token windows: the targets as many as the inputs
        x = torch.zeros(local, *shape, dtype=torch.long if text else torch.float32, device="meta")
        y = torch.zeros(local, *shape, dtype=torch.long, device="meta") if text else \
            torch.zeros(local, dtype=torch.long, device="meta")
        engine.train()
        from torch.fx.experimental import _config as fx_config  # a mask's selection on meta: every element kept
        with FlashAttention() if attention == "flash" else contextlib.nullcontext(), \
                fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            for _ in range(2):  # the second step is the one a run meters (the first may build caches)
                opt.zero_grad(set_to_none=True)
                engine.forward_backward(x, y, engine.loss)
                opt.step()  # (engine.step's non-finite check reads values: a meta tensor has none)
                engine.observe()
        held = [t for p in engine.module.parameters() for t in (p,)]
        activations = engine.schedule.activation_peak_bytes  # (Accumulate's: a pipeline is refused above)
        return {"rank": rank, "world_size": world, "strategy": str(strategy), "global_batch_size": global_batch,
                "input_shape": list(shape), "model_state_bytes": int(engine.peak_bytes),
                "parameter_bytes": storage_bytes(held),
                "optimizer_bytes": storage_bytes(optimizer_tensors(opt)),
                "activation_bytes": int(activations or 0), "seconds": time.perf_counter() - t0}
    finally:
        dist.destroy_process_group()
