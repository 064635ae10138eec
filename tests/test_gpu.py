"""The GPU path, each test with a CPU twin: the same code path and assertions on ``cpu`` (run everywhere)
and on ``cuda`` (``gpu`` marker: run where CUDA is present, skipped with the reason elsewhere). A change
that breaks the path breaks the twin here, on a machine without a GPU.

Equivalence bounds are distlab.tools.verify's (float32 summation order; bf16/fp16 unit roundoff), so they
hold on any device: a GPU run and the CPU reference differ in how they sum, not in what.
"""

import json

import pytest
import torch

from distlab import runtime
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.tools.verify import reference_run, tolerance
from tests.conftest import mlp_only

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# fp16 autocast and its loss scaling are for GPUs (refused on the CPU): the CPU twin runs bf16
LOW_PRECISIONS = [pytest.param("cpu", "bf16", id="cpu-bf16"),
                  pytest.param("cuda", "bf16", id="cuda-bf16", marks=pytest.mark.gpu),
                  pytest.param("cuda", "fp16", id="cuda-fp16", marks=pytest.mark.gpu)]


def _cfg(**kw):
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", epochs=2, max_steps=10,
                    global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9, seed=3,
                    log_every=1, progress=False, verbose=False, eval_every_epoch=False)
    return TrainConfig.from_flags(**mlp_only({**settings, **kw})).validate(1)


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
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = task_loss(model(x), y)
        loss.backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _on(device: str) -> dict:
    """run_ranks' settings for a rank on ``device`` (GPUs hidden from a CPU rank)."""
    return {"gpus": device == "cuda", "timeout": 300}


@pytest.mark.parametrize("device", DEVICES)
def test_single_device_training_equals_cpu_training_within_the_float32_bound(device):
    cfg = _cfg()
    (params, _, summary), = run_ranks(_train_on, 1, cfg, device, **_on(device))
    ref_params, _ = reference_run(cfg)  # on the CPU
    assert summary["device"].startswith(device) and summary["data_on_device"] is (device == "cuda")
    assert _max_diff(params, ref_params) <= tolerance(cfg)


@pytest.mark.parametrize("device", DEVICES)
def test_the_mixture_of_experts_on_one_device_equals_cpu_training_within_the_float32_bound(device):
    """The MoE GPT's routing, sorting by expert and combination run on the device (dropless): the
    same steps as on the CPU, up to float32 summation order."""
    cfg = _cfg(model="gpt-moe", dataset="synthetic-text:4000", n_layer=2, n_head=4, n_embd=16, block_size=8,
               experts=4, top_k=2, lr=0.05, max_steps=4)
    (params, _, summary), = run_ranks(_train_on, 1, cfg, device, **_on(device))
    ref_params, _ = reference_run(cfg)  # on the CPU
    assert summary["device"].startswith(device) and summary["experts"]["dropped"] == 0
    assert _max_diff(params, ref_params) <= tolerance(cfg)


@pytest.mark.parametrize("device,precision", LOW_PRECISIONS)
def test_reduced_precision_within_its_derived_bound(device, precision):
    cfg = _cfg(precision=precision, max_steps=5)
    (params, losses, _), = run_ranks(_train_on, 1, cfg, device, **_on(device))
    assert _max_diff(params, _reference_on(cfg, device)) <= tolerance(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("device", DEVICES)
def test_an_overflowing_fp16_step_is_skipped_and_the_scale_backs_off(device):
    from distlab.parallel.precision import LossScaler
    p = torch.nn.Parameter(torch.ones(4, device=device))
    scaler = LossScaler(init_scale=2.0 ** 16)
    with torch.autocast("cuda", dtype=torch.float16, enabled=device == "cuda"):
        loss = (p.half() * 60000).sum()  # the scaled loss and its gradient overflow float16
    scaler.scale(loss).backward()
    found = scaler.unscale_([p])
    scaler.update(found)
    assert found is True and scaler.scale_value == 2.0 ** 15 and scaler.skipped == 1


def _world_one(rank, world, backend, device):
    rt = runtime.init(backend=backend, device=device, env={})
    t = torch.ones(3, device=device)
    torch.distributed.all_reduce(t)
    runtime.shutdown()
    return rt.backend, t.sum().item()


@pytest.mark.parametrize("device", DEVICES)
def test_the_devices_backend_with_world_one(device):
    backend = "nccl" if device == "cuda" else "gloo"
    assert run_ranks(_world_one, 1, backend, device, init_group=False, gpus=device == "cuda",
                     timeout=120) == [(backend, 3.0)]


@pytest.mark.parametrize("device", DEVICES)
def test_doctor_sees_the_device(run_cli, device):
    proc = run_cli("doctor", env={"DISTLAB_DEVICE": device}, fresh=device == "cuda")
    assert proc.returncode == 0, proc.stderr
    assert ("cuda:0 " in proc.stdout) if device == "cuda" else ("cores: " in proc.stdout and "load: " in proc.stdout)


@pytest.mark.parametrize("device", DEVICES)
def test_resident_batches_equal_host_batches(device):
    from distlab.data import load_dataset
    data = load_dataset("synthetic:3x8x8:4:64", "train")
    data.augment = True
    resident = data.to(device)
    idx = torch.tensor([5, 1, 9, 33])
    for augment in (False, True):
        host = data.batch(idx, augment=augment, generator=torch.Generator().manual_seed(2))
        dev = resident.batch(idx, augment=augment, generator=torch.Generator().manual_seed(2))
        assert all(d.device.type == device and torch.equal(h, d.cpu()) for h, d in zip(host, dev))


@pytest.mark.parametrize("device", DEVICES)
def test_bench_overhead_runs_every_side_on_the_device(run_cli, tmp_path, device):
    precisions = "fp32,fp16" if device == "cuda" else "fp32"  # (more of the CPU side: tests/test_device_path.py)
    proc = run_cli("bench", "overhead", "--workloads", "mlp", "--precisions", precisions, "--steps", "20",
                   "--runs", "1", "--dataset", "synthetic:1x28x28:10:2048", "--out", "o",
                   env={"DISTLAB_DEVICE": device}, timeout=600, fresh=device == "cuda")
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "o" / "overhead.json").read_text())
    assert {r["side"] for r in records} == ({"plain", "plain-resident", "distlab"} if device == "cuda" else
                                            {"plain", "distlab"})
    assert {r["device"] for r in records} == {device}


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_resumes_on_the_other_device_and_back(run_cli, tmp_path, device):
    """GPU -> CPU -> GPU (its twin: CPU throughout), each resume longer than the last: the constant
    schedule lets a resumed run change its length (a decaying one refuses, naming the setting)."""
    train = ("train", "--dataset", "synthetic:1x8x8:4:256", "--global-batch-size", "16", "--no-progress",
             "--snapshot-dir", "s", "--snapshot-every", "2", "--lr-schedule", "constant")
    fresh = device == "cuda"  # the GPU in a process of its own, as a user runs it (this one may have hidden it)
    run_cli(*train, "--max-steps", "4", "--out", "a", env={"DISTLAB_DEVICE": device}, check=True, fresh=fresh)
    run_cli(*train, "--max-steps", "6", "--resume", "auto", "--out", "b", env={"DISTLAB_DEVICE": "cpu"}, check=True,
            fresh=fresh)
    run_cli(*train, "--max-steps", "8", "--resume", "auto", "--out", "c", env={"DISTLAB_DEVICE": device}, check=True,
            fresh=fresh)
    b, c = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "bc")
    assert b["resumed_from"].endswith("step-00000004") and b["device"] == "cpu"
    assert c["resumed_from"].endswith("step-00000006") and c["device"].startswith(device) and c["steps"] == 8


def _low_precision_resume(rank, world, tmp, device, precision):
    """Straight 10 steps vs 6 steps, a snapshot, then a resume to 10 (fp16: with its loss scaler)."""
    base = dict(precision=precision, lr=0.5)  # a large LR: fp16's scaler backs off and grows within the run
    straight = Trainer(_cfg(**base), runtime.from_process_group(torch.device(device)))
    straight.fit()
    first = _cfg(**base, max_steps=6, snapshot_dir=str(tmp), snapshot_every=3)
    Trainer(first, runtime.from_process_group(torch.device(device))).fit()
    second = Trainer(_cfg(**base, snapshot_dir=str(tmp), resume="auto"), runtime.from_process_group(torch.device(device)))
    second.fit()
    same = all(torch.equal(a, b) for a, b in zip(straight.full_parameters(), second.full_parameters()))
    scalers = [t.engine.precision.scaler for t in (straight, second)]
    return same, [s.state_dict() if s is not None else None for s in scalers]


@pytest.mark.parametrize("device,precision", LOW_PRECISIONS)
def test_a_low_precision_resume_is_bitwise_with_the_loss_scaler_restored(tmp_path, device, precision):
    (same, (a, b)), = run_ranks(_low_precision_resume, 1, tmp_path / "s", device, precision, **_on(device))
    assert same and a == b and (a is not None) == (precision == "fp16")


@pytest.mark.gpu
def test_a_mapped_corpus_trains_from_gpu_memory(tmp_path):
    """A prepared corpus (uint16 tokens, memory-mapped) on a GPU: data_on_device widens it there and the
    windows drawn are the host's."""
    from distlab.data import load_dataset
    from distlab.data.tokens import prepare
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "book.txt").write_text("".join(f"paragraph {i} of the book\n\n" for i in range(40)))
    prepare(tmp_path / "src" / "book.txt", tmp_path / "tok", progress=False)  # a file: a document per paragraph
    host = load_dataset(f"tokens:{tmp_path / 'tok'}", "train", block_size=8)
    device = host.to("cuda")
    idx = torch.tensor([0, 5, len(host) - 1])
    assert all(torch.equal(a.cpu(), b) for a, b in zip(device.batch(idx), host.batch(idx)))


@pytest.mark.parametrize("device", DEVICES)
def test_the_optimizer_is_one_fused_kernel_on_a_gpu_and_torchs_default_elsewhere(device):
    from distlab.train.optim import build_optimizer
    for name in ("sgd", "adam", "adamw"):
        opt = build_optimizer([torch.nn.Parameter(torch.zeros(3, device=device))], _cfg(optimizer=name))
        assert bool(opt.defaults.get("fused")) == (device == "cuda"), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_traced_step_on_the_device(tmp_path, device):
    """--trace on the device: the training thread's spans (CUDA events on a GPU, read once after the
    traced steps), each step's forward, backward and optimizer step, in order."""
    cfg = _cfg(out=str(tmp_path), trace="2:3", max_steps=4)
    (_, _, summary), = run_ranks(_train_on, 1, cfg, device, **_on(device))
    assert summary["trace"]["steps"] == [2, 3]
    spans = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    names = [e["name"] for e in sorted(spans, key=lambda e: e["ts"]) if e["cat"] == "compute"]
    for name in ("forward", "backward", "optimizer step"):
        assert names.count(name) == 2, names
    assert names.index("forward") < names.index("backward") < names.index("optimizer step")
    assert all(e["dur"] >= 0 for e in spans)


@pytest.mark.parametrize("device", DEVICES)
def test_grpo_generates_on_the_runs_device_and_draws_what_the_host_draws(run_cli, tmp_path, device):
    """The generation copy sits on the run's device; its samples come from a host generator, so a prompt's
    completions on the device are the CPU's (logits equal but for summation order, far from a draw's edge); the
    command trains from rewards there."""
    from distlab.models import GPT
    from distlab.train import rollout
    torch.manual_seed(0)
    model = GPT(256, 16, 1, 2, 16).eval()
    prompt, seed = list(b"12+3="), rollout.seed_of(0, 3, 7)
    host, _, _ = rollout.complete(model, prompt, 4, 6, 1.0, 1.0, frozenset({10}), seed)
    there, _, _ = rollout.complete(model.to(device), prompt, 4, 6, 1.0, 1.0, frozenset({10}), seed)
    assert rollout.device_of(model).type == device and there == host
    run_cli("train", "--model", "gpt", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "12",
            "--dataset", "synthetic-rl:40", "--reward", "number", "--group-size", "2", "--max-new-tokens", "3",
            "--global-batch-size", "2", "--max-steps", "2", "--no-progress", "--out", "run",
            env={"DISTLAB_DEVICE": device}, check=True, fresh=device == "cuda")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["device"].startswith(device) and all(0 <= r["reward"] <= 1 for r in rows if "reward" in r)
