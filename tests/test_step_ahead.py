"""The offloaded step overlapped with the next forward (``--offload-overlap``, distlab.parallel.step_ahead): through
the command, data parallel's run is its run without the overlap bit for bit and says how long it waited; tensor
parallel, a pipeline and the experts alike; the waits are what makes it so (a forward that does not wait reads
the parameters of the step before); and the layouts it cannot overlap are refused in one line."""

import json
import threading

import pytest
import torch
from torch import nn

from distlab.launch.spawn import run_ranks
from distlab.parallel.offload import OffloadStore
from distlab.parallel.step_ahead import StepAhead
from distlab.train import TrainConfig
from distlab.train.low_precision_optim import Adam16
from tests.conftest import patience
from tests.test_muon import _train

TINY = ["--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--dataset", "synthetic-text:4000", "--global-batch-size", "8", "--optimizer", "adamw"]


def test_data_parallel_overlapped_is_its_run_without_bit_for_bit_and_says_what_it_waited(run_cli, tmp_path):
    """AdamW with weight decay and a cosine schedule (the learning rate changes right after each launch), its
    moments in a file, 2 ranks, no log line before the end (so every step but the first overlaps the next
    forward): the final model is the run's without ``--offload-overlap``, bit for bit, and the summary says how
    long the training thread waited for the steps."""
    common = ["train", *TINY, "--weight-decay", "0.1", "--lr-schedule", "cosine", "--nproc-per-node", "2",
              "--no-progress", "--comm-timeout", "60", "--max-steps", "6", "--log-every", "100"]
    run_cli(*common, "--offload", "optimizer", "--offload-dir", "a", "--out", "plain", check=True,
            timeout=patience(240))
    run_cli(*common, "--offload", "optimizer", "--offload-dir", "b", "--offload-overlap", "--out", "overlapped",
            check=True, timeout=patience(240))
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "overlapped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "overlapped" / "summary.json").read_text())
    overlap = summary["offload"]["overlap"]
    assert 0 <= overlap["forward_waited_s"] <= overlap["waited_s"]
    assert "overlap" not in json.loads((tmp_path / "plain" / "summary.json").read_text())["offload"]


def _cfg(tmp, **kw):
    return TrainConfig.from_flags(**{**dict(model="gpt", n_layer=2, n_embd=32, n_head=2, dataset="synthetic-text:4000",
                                            block_size=16, global_batch_size=8, max_steps=4, lr=0.01,
                                            optimizer="adamw", weight_decay=0.1, seed=1, log_every=100,
                                            progress=False, verbose=False, eval_every_epoch=False, eval_batches=1,
                                            offload="optimizer", offload_dir=tmp), **kw})


def test_tensor_parallel_a_pipeline_and_the_experts_overlapped_are_their_runs_without(tmp_path):
    """Each layout's slices, stage, experts or ZeRO-3 shards (in the state's file, and with their parameter shards
    there too; beside experts held whole) stepped beside the next forward: bit for bit the run without."""
    layouts = [dict(tp=2), dict(pp=2, microbatches=2), dict(ep=2, model="gpt-moe"), dict(zero=3),
               dict(zero=3, offload="params"), dict(zero=3, ep=2, model="gpt-moe")]
    cfgs = [_cfg(str(tmp_path / f"{i}-{overlap}"), **kw, offload_overlap=overlap)
            for i, kw in enumerate(layouts) for overlap in (False, True)]
    runs = run_ranks(_train, 2, cfgs, False, timeout=patience(300))[0]  # (each run's final parameters)
    for i, kw in enumerate(layouts):
        plain, overlapped = runs[2 * i], runs[2 * i + 1]
        assert all(torch.equal(a, b) for a, b in zip(plain, overlapped)), kw


def _losses(tmp_path, ahead: StepAhead | None, watch: bool = True, gate: threading.Event | None = None,
            steps: int = 3):
    """A small MLP, AdamW with its moments in a file, ``steps`` steps: each step's loss, and the parameters; with
    ``ahead``, the steps launched on its thread (``watch``: the forward waiting for them). With ``gate``, the
    steps wait until the second forward and backward have run (a step slower than both, as on a GPU beside a
    host)."""
    class Gated(Adam16):
        def _param_step(self, *args):
            if gate is not None:
                assert gate.wait(timeout=patience(60)), "the gate was never opened"
            super()._param_step(*args)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if ahead is not None and watch:
        ahead.watch(model)
    elif ahead is not None:
        ahead.active = True  # (it launches the steps, but no forward waits for them)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    store = OffloadStore(tmp_path / ("ahead" if ahead else "plain"), rank=0)
    opt = Gated(model.parameters(), lr=0.05, weight_decay=0.1, state_dtype=None, offload=store, ahead=ahead)
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        loss.backward()
        if gate is not None and i >= 1:  # (after the backward too: it reads what the forward read)
            gate.set()
        opt.step()
    if ahead is not None:
        ahead.close()
    return losses, [p.detach().clone() for p in model.parameters()]


def test_the_forward_waits_for_the_parameters_it_reads_and_without_the_waits_reads_the_step_before(tmp_path):
    """Watched, every loss and parameter is the unoverlapped run's, bit for bit. Unwatched, with the first step
    held until the second forward has run, that forward reads the parameters from before the step: its loss is
    the first one again, which the unoverlapped run's second is not."""
    plain_losses, plain_params = _losses(tmp_path, None)
    watched_losses, watched_params = _losses(tmp_path, StepAhead())
    assert watched_losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(plain_params, watched_params))
    stale_losses, _ = _losses(tmp_path / "stale", StepAhead(), watch=False, gate=threading.Event(), steps=2)
    assert stale_losses[1] == stale_losses[0] != plain_losses[1]


def test_steps_run_in_the_order_the_forward_reads_their_parameters_whatever_the_groups_order(tmp_path):
    """AdamW's groups put the embedding (undecayed) after the layers; the step thread steps the embedding first,
    as the forward reads it first -- else the forward's first module waits for the whole step."""
    stepped = []

    class Recorded(Adam16):
        def _param_step(self, param, *args):
            stepped.append(param.shape)
            super()._param_step(param, *args)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 10))
    ahead = StepAhead()
    ahead.watch(model)
    weights = [model[1].weight, model[1].bias, model[3].weight, model[3].bias]
    opt = Recorded([{"params": weights}, {"params": [model[0].weight], "weight_decay": 0.0}], lr=0.01,
                   weight_decay=0.1, state_dtype=None, offload=OffloadStore(tmp_path, rank=0), ahead=ahead)
    x = torch.randint(0, 10, (4, 3))
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()
    ahead.close()
    forward_order = [p.shape for p in model.parameters()]
    assert stepped == forward_order * 2, stepped


@pytest.mark.parametrize("flags, words", [
    ([], ["give --offload optimizer too"]),
    (["--offload", "optimizer", "--offload-dir", "d", "--zero", "2"], ["ZeRO-2 all-gathers the updated shards"]),
    (["--offload", "params", "--offload-dir", "d", "--zero", "3", "--zero-impl", "plain"], ["--zero-impl plain"]),
    (["--offload", "optimizer", "--offload-dir", "d", "--optimizer", "muon"], ["Muon's step gathers"]),
])
def test_what_the_overlap_cannot_do_is_refused_before_anything_starts(refused_here, flags, words):
    proc = refused_here("train", *TINY, "--device", "cpu", *flags, "--offload-overlap", "--max-steps", "1")
    assert proc.stderr.count("\n") == 1 and all(w in proc.stderr for w in words), proc.stderr
