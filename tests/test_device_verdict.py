"""A training step that never waits for the device: the gradients' verdict kept on the device, read at
log, evaluation and snapshot steps (:mod:`distlab.parallel.verdict`), step times from CUDA events.

Each test has a CPU twin: torch's fused optimizers run on the CPU too (forced here: distlab picks them
on a GPU only), so the same verdict path runs on a machine without a GPU; the ``gpu`` twins assert on
CUDA what the CPU twin can only approximate (``torch.cuda.set_sync_debug_mode``).
"""

import math
import warnings

import pytest
import torch

from distlab import runtime
from distlab.errors import NonFiniteError
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _cfg(**kw):
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=100, max_steps=10,
                    global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9, seed=3,
                    log_every=4, progress=False, verbose=False, eval_every_epoch=False)
    return TrainConfig.from_flags(**{**settings, **kw}).validate(1)


def _fused_trainer(cfg, device, hooks=None):
    """A Trainer whose optimizer is torch's fused kernel on any device (distlab's choice on a GPU)."""
    from distlab.train import optim
    optim.kernels = lambda params: {"fused": True}
    return Trainer(cfg, runtime.from_process_group(torch.device(device)), hooks=hooks)


def _diverge(rank, world, cfg, device, bad_step):
    """Train with the gradients of step ``bad_step`` made nan; what the stop left."""
    trainer = _fused_trainer(cfg, device)
    engine, forward_backward = trainer.engine, trainer.engine.forward_backward

    def poisoned(*args):
        loss = forward_backward(*args)
        if trainer.run.step + 1 == bad_step:
            next(p for p in engine.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
        return loss
    engine.forward_backward = poisoned
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    state = trainer.optimizer.state_dict()["state"]
    return (str(err.value), trainer.run.step, trainer.run.last_snapshot, [p.detach().cpu() for p in trainer.net.parameters()],
            {k: v.cpu() for k, v in state[0].items()})


def _straight(rank, world, cfg, device):
    trainer = _fused_trainer(cfg, device)
    trainer.fit()
    return [p.detach().cpu() for p in trainer.net.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw-clipped"])
def test_non_finite_gradients_found_on_the_device_stop_the_run_at_the_next_read(tmp_path, device, optimizer):
    """The verdict of step 3 is read at step 4 (a snapshot step): the run stops there naming step 3, its
    state that of step 2 (steps 3 and 4 were skipped on the device: bitwise the 2-step run, Adam's step
    count 2, SGD's momentum finite), no snapshot written at the stop (the newest is step 2's)."""
    kw = dict(optimizer="adamw", clip_grad_norm=0.5) if optimizer == "adamw-clipped" else {}
    cfg = _cfg(snapshot_dir=str(tmp_path / "s"), snapshot_every=2, **kw)
    (message, step, snapshot, params, state), = run_ranks(_diverge, 1, cfg, device, 3, gpus=device == "cuda",
                                                          timeout=300)
    assert message.startswith("training diverged at step 3: the gradients are not finite") and "the 1 step after it" in message
    assert step == 2 and snapshot is not None and snapshot.endswith("step-00000002"), snapshot
    two = _cfg(max_steps=2, **kw)
    expected, = run_ranks(_straight, 1, two, device, gpus=device == "cuda", timeout=300)
    assert all(torch.equal(a, b) for a, b in zip(params, expected))
    assert all(torch.isfinite(v).all() for v in state.values())
    if optimizer != "sgd":
        assert int(state["step"]) == 2


def _reads_between(rank, world, cfg, device, first, last):
    """Every read of a tensor's value from the device in the steps after ``first`` up to ``last``'s
    hook (no log, evaluation or snapshot among them): torch's sync debug mode on CUDA; on the CPU each
    Python-level read (``item``, ``bool``, ``float``, ``int``, ``tolist``) with where it came from."""
    reads, armed = [], [False]

    def arm(step):
        armed[0] = first <= step < last
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn" if armed[0] else "default")

    if device == "cpu":
        import traceback
        for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
            original = getattr(torch.Tensor, name)

            def watched(self, *a, _original=original, _name=name, **k):
                if armed[0]:
                    reads.append(f"{_name} at " + "".join(traceback.format_stack(limit=4)[:-1]))
                return _original(self, *a, **k)
            setattr(torch.Tensor, name, watched)
    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):  # the sync debug mode's, with the stack
            import traceback
            reads.append(f"{message} at " + "".join(traceback.format_stack(limit=8)[:-1]))

    trainer = _fused_trainer(cfg, device, hooks=[arm])
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        trainer.fit()
    return reads


def _write_cifar(root):
    """A small CIFAR-10 in its on-disk format: uint8 images, normalised per batch on the device."""
    import numpy as np
    from distlab.data.cifar import write_cifar_batch
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(d / f, rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 8))
    return str(root)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kw", [dict(), dict(optimizer="adamw", clip_grad_norm=1.0, precision="bf16"),
                                dict(dataset="cifar10", global_batch_size=4)],
                         ids=["sgd", "adamw-clipped-bf16", "uint8-images"])
def test_a_step_between_reads_waits_for_nothing_on_the_device(tmp_path, device, kw):
    """Steps 3-7 of 8 (log every 100: no log, evaluation or snapshot among them) read no value from the
    device: not the gradients' verdict, not the loss, not a clock, not a copy of normalisation constants."""
    if kw.get("dataset") == "cifar10":
        kw = {**kw, "data_dir": _write_cifar(tmp_path)}
    cfg = _cfg(max_steps=8, log_every=100, **kw)
    reads, = run_ranks(_reads_between, 1, cfg, device, 2, 7, gpus=device == "cuda", timeout=300)
    assert reads == [], "\n".join(reads)


def _diverge_on_one_rank(rank, world, cfg, bad_step):
    """Rank 1 alone gets a nan gradient at ``bad_step``: the all-reduced device verdict stops both."""
    trainer = _fused_trainer(cfg, "cpu")
    engine, forward_backward = trainer.engine, trainer.engine.forward_backward

    def poisoned(*args):
        loss = forward_backward(*args)
        if rank == 1 and trainer.run.step + 1 == bad_step:
            next(p for p in engine.parameters() if p.grad is not None).grad.view(-1)[0] = math.nan
        return loss
    engine.forward_backward = poisoned
    with pytest.raises(NonFiniteError) as err:
        trainer.fit()
    return str(err.value), trainer.run.step, [p.detach() for p in trainer.full_parameters()]


def _straight_on_ranks(rank, world, cfg):
    trainer = _fused_trainer(cfg, "cpu")
    trainer.fit()
    return [p.detach() for p in trainer.full_parameters()]


def test_a_sharded_layouts_device_verdict_is_every_ranks():
    """ZeRO-1 on 2 ranks (each holds a different optimizer shard): one rank's nan reaches the other through
    the verdict's all-reduce, on the device; both stop at step 4's log line naming step 3, with the state of
    the 2-step run."""
    cfg = _cfg(zero=1, max_steps=8).validate(2)
    (m0, s0, p0), (m1, s1, p1) = run_ranks(_diverge_on_one_rank, 2, cfg, 3, timeout=120)
    assert m0 == m1 and m0.startswith("training diverged at step 3:") and s0 == s1 == 2
    expected = run_ranks(_straight_on_ranks, 2, _cfg(zero=1, max_steps=2).validate(2), timeout=120)[0]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(p0, p1, expected))
