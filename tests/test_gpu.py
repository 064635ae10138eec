"""The GPU path: run where CUDA is present, skipped with the reason elsewhere (``gpu`` marker).

Equivalence bounds are distlab.tools.verify's (float32 summation order; bf16/fp16 unit roundoff), so they
hold on any GPU: a GPU run and the CPU reference differ in how they sum, not in what.
"""

import json

import pytest
import torch

from distlab import runtime
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.tools.verify import reference_run, tolerance

pytestmark = pytest.mark.gpu


def _cfg(**kw):
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=2, max_steps=10,
                    global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9, seed=3,
                    log_every=1, progress=False, verbose=False, eval_every_epoch=False)
    return TrainConfig.from_flags(**{**settings, **kw}).validate(1)


def _train_on(rank, world, cfg, device):
    trainer = Trainer(cfg, runtime.from_process_group(torch.device(device)))
    summary = trainer.fit()
    return [p.cpu() for p in trainer.full_parameters()], [r["loss"] for r in trainer.history], summary


def _reference_on(cfg, device):
    """verify's single-process loop, on ``device``, under the run's autocast (and GradScaler for fp16)."""
    from distlab.data.sampler import sequential_batches
    from distlab.models import build_model, task_loss
    data = cfg.load("train")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options()).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.strategy.precision)
    for idx in sequential_batches(len(data), batch_size=cfg.global_batch_size, seed=cfg.seed)[:cfg.max_steps]:
        x, y = (t.to(device) for t in data.batch(torch.tensor(idx)))
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = task_loss(model(x), y)
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_single_gpu_training_equals_cpu_training_within_the_float32_bound():
    cfg = _cfg()
    (params, _, summary), = run_ranks(_train_on, 1, cfg, "cuda", gpus=True, timeout=300)
    ref_params, _ = reference_run(cfg)  # on the CPU
    assert summary["device"].startswith("cuda") and summary["data_on_device"] is True
    assert _max_diff(params, ref_params) <= tolerance(cfg)


def test_the_mixture_of_experts_on_one_gpu_equals_cpu_training_within_the_float32_bound():
    """The MoE GPT's routing, sorting by expert and combination run on the device (dropless): the
    same steps as on the CPU, up to float32 summation order."""
    cfg = _cfg(model="gpt-moe", dataset="synthetic-text:4000", n_layer=2, n_head=4, n_embd=16, block_size=8,
               experts=4, top_k=2, lr=0.05, max_steps=4)
    (params, _, summary), = run_ranks(_train_on, 1, cfg, "cuda", gpus=True, timeout=300)
    ref_params, _ = reference_run(cfg)  # on the CPU
    assert summary["device"].startswith("cuda") and summary["experts"]["dropped"] == 0
    assert _max_diff(params, ref_params) <= tolerance(cfg)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_on_gpu_within_its_derived_bound(precision):
    cfg = _cfg(precision=precision, max_steps=5)
    (params, losses, _), = run_ranks(_train_on, 1, cfg, "cuda", gpus=True, timeout=300)
    assert _max_diff(params, _reference_on(cfg, "cuda")) <= tolerance(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_fp16_overflow_skips_the_step_on_gpu():
    from distlab.parallel.precision import LossScaler
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    scaler = LossScaler(init_scale=2.0 ** 16)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = (p.half() * 60000).sum()  # the scaled loss and its gradient overflow float16
    scaler.scale(loss).backward()
    found = scaler.unscale_([p])
    scaler.update(found)
    assert found is True and scaler.scale_value == 2.0 ** 15 and scaler.skipped == 1


def _nccl_world_one(rank, world):
    rt = runtime.init(backend="nccl", device="cuda", env={})
    t = torch.ones(3, device="cuda")
    torch.distributed.all_reduce(t)
    runtime.shutdown()
    return rt.backend, t.sum().item()


def test_nccl_with_world_one():
    assert run_ranks(_nccl_world_one, 1, init_group=False, gpus=True, timeout=120) == [("nccl", 3.0)]


def test_doctor_sees_the_gpu(run_cli):
    proc = run_cli("doctor", env={"DISTLAB_DEVICE": "cuda"})
    assert proc.returncode == 0, proc.stderr
    assert "cuda" in proc.stdout.lower()


def test_resident_batches_equal_host_batches():
    from distlab.data import load_dataset
    data = load_dataset("synthetic:3x8x8:4:64", "train")
    data.augment = True
    on_gpu = data.to("cuda")
    idx = torch.tensor([5, 1, 9, 33])
    for augment in (False, True):
        host = data.batch(idx, augment=augment, generator=torch.Generator().manual_seed(2))
        dev = on_gpu.batch(idx, augment=augment, generator=torch.Generator().manual_seed(2))
        assert all(d.device.type == "cuda" and torch.equal(h, d.cpu()) for h, d in zip(host, dev))


def test_bench_overhead_runs_every_side_on_the_gpu(run_cli, tmp_path):
    proc = run_cli("bench", "overhead", "--workloads", "mlp", "--precisions", "fp32,fp16", "--steps", "20",
                   "--runs", "1", "--dataset", "synthetic:1x28x28:10:2048", "--out", "o",
                   env={"DISTLAB_DEVICE": "cuda"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "o" / "overhead.json").read_text())
    assert {r["side"] for r in records} == {"plain", "plain-resident", "distlab"}
    assert {r["device"] for r in records} == {"cuda"}


def test_a_snapshot_written_on_gpu_resumes_on_cpu_and_back(run_cli, tmp_path):
    train = ("train", "--dataset", "synthetic:1x8x8:4:256", "--global-batch-size", "16", "--no-progress",
             "--snapshot-dir", "s", "--snapshot-every", "2")
    run_cli(*train, "--max-steps", "4", "--out", "a", env={"DISTLAB_DEVICE": "cuda"}, check=True)
    run_cli(*train, "--max-steps", "6", "--resume", "auto", "--out", "b", env={"DISTLAB_DEVICE": "cpu"}, check=True)
    run_cli(*train, "--max-steps", "8", "--resume", "auto", "--out", "c", env={"DISTLAB_DEVICE": "cuda"}, check=True)
    b, c = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "bc")
    assert b["resumed_from"].endswith("step-00000004") and b["device"] == "cpu"
    assert c["resumed_from"].endswith("step-00000006") and c["device"].startswith("cuda") and c["steps"] == 8


def _fp16_resume(rank, world, tmp):
    """fp16 with its loss scaler: straight 10 steps vs 6 steps, a snapshot, then a resume to 10."""
    base = dict(precision="fp16", lr=0.5)  # a large LR: the scaler backs off and grows within the run
    straight = Trainer(_cfg(**base), runtime.from_process_group(torch.device("cuda")))
    straight.fit()
    first = _cfg(**base, max_steps=6, snapshot_dir=str(tmp), snapshot_every=3)
    Trainer(first, runtime.from_process_group(torch.device("cuda"))).fit()
    second = Trainer(_cfg(**base, snapshot_dir=str(tmp), resume="auto"), runtime.from_process_group(torch.device("cuda")))
    second.fit()
    same = all(torch.equal(a, b) for a, b in zip(straight.full_parameters(), second.full_parameters()))
    scales = [t.engine.precision.scaler.state_dict() for t in (straight, second)]
    return same, scales


def test_fp16_resume_is_bitwise_with_the_loss_scaler_restored(tmp_path):
    (same, (a, b)), = run_ranks(_fp16_resume, 1, tmp_path / "s", gpus=True, timeout=300)
    assert same and a == b
