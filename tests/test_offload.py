"""Offload (``--offload optimizer|params``, distlab.parallel.offload): the store's file regions leave the process
once used and keep their values; a full disk and a directory another run holds are clear errors; through the
command, ZeRO-3 with its shards and state in files trains bit for bit as without, holds on the device and off it
exactly what ``distlab plan`` predicts, and resumes from a snapshot bit for bit; Muon (its gathers from offloaded
state) and SGD (its momentum offloaded) are their own runs without offload, bit for bit; and what cannot work is
refused before anything starts."""

import gc
import json
import subprocess
import sys

import pytest
import torch

from distlab.errors import ConfigError
from distlab.launch.spawn import run_ranks
from distlab.parallel.offload import OffloadStore, check_unused
from distlab.train import TrainConfig
from tests.conftest import patience
from tests.test_muon import _train


def _file_pages_mib() -> float:
    """This process's resident file-backed memory (``RssFile``), MiB."""
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    pytest.skip("no RssFile in /proc/self/status")


def test_a_used_region_leaves_the_process_keeps_its_values_and_a_held_directory_is_refused(tmp_path):
    store = OffloadStore(tmp_path / "off", rank=0)
    before = _file_pages_mib()
    t = store.zeros((16 << 20,), torch.float32)  # 64 MiB
    assert t.sum().item() == 0 and store.holds(t) and store.payload == 64 << 20
    t.fill_(1.5)
    touched = _file_pages_mib()
    store.release(t)
    after = _file_pages_mib()
    assert touched - before > 60 and after - before < 8, (before, touched, after)
    assert t.sum().item() == 1.5 * (16 << 20)  # read back from the file (the page cache)
    with pytest.raises(ConfigError, match="in use by another run"):
        OffloadStore(tmp_path / "off", rank=0)  # a second run on the same directory
    with pytest.raises(ConfigError, match="in use by another run"):
        check_unused(str(tmp_path / "off"))  # (what the command checks before launching)
    del t, store
    gc.collect()
    check_unused(str(tmp_path / "off"))
    fresh = OffloadStore(tmp_path / "off", rank=0)  # a stale file: replaced, from nothing
    assert (tmp_path / "off" / "rank0.bin").stat().st_size == 0 and fresh.zeros((4,), torch.float32).sum() == 0


def test_a_full_disk_is_an_error_when_the_state_is_made_not_a_crash_mid_step(tmp_path):
    code = ("import resource, signal, torch\n"
            "from distlab.errors import ConfigError\n"
            "from distlab.parallel.offload import OffloadStore\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
            f"store = OffloadStore({str(tmp_path / 'off')!r}, rank=0)\n"
            "store.zeros((1 << 16,), torch.float32)\n"
            "try:\n    store.zeros((1 << 20,), torch.float32)\n"
            "except ConfigError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=patience(120))
    assert proc.returncode == 0, proc.stderr
    assert "no room for 4.0 MiB more of offloaded state" in proc.stdout and "free space there" in proc.stdout


TINY = ["--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--dataset", "synthetic-text:4000", "--global-batch-size", "8", "--optimizer", "adamw"]


def test_zero3_offloaded_is_the_run_without_holds_what_plan_predicts_and_resumes_bitwise(run_cli, tmp_path):
    """ZeRO-3 on 2 ranks with ``--offload params``: the final model is the run's without offload bit for bit;
    the bytes on the device (``model_state_bytes_per_rank``) and in the files are the planner's; stopped after
    step 2 and resumed from its snapshot (a fresh file filled from it), every loss is the uninterrupted run's."""
    common = ["train", *TINY, "--weight-decay", "0.1", "--lr-schedule", "constant", "--zero", "3", "--nproc-per-node",
              "2", "--no-progress", "--comm-timeout", "60", "--log-every", "1"]
    off = ["--offload", "params", "--offload-dir", "off"]
    run_cli(*common, "--max-steps", "4", "--out", "plain", check=True, timeout=patience(240))
    run_cli(*common, *off, "--max-steps", "4", "--out", "whole", check=True, timeout=patience(240))
    for mode in ("none", "optimizer", "params"):
        run_cli("plan", *TINY, "--dp", "2", "--zero", "3", "--offload", mode, "--json", f"{mode}.json", check=True)
    plans = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("none", "optimizer", "params")}
    plain, whole = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("plain", "whole"))
    from safetensors.torch import load_file
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("plain", "whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain["model_state_bytes_per_rank"] == plans["none"]["model_state_bytes_per_rank"]
    assert whole["model_state_bytes_per_rank"] == plans["params"]["model_state_bytes_per_rank"]
    assert whole["offload"]["bytes_per_rank"] == plans["params"]["offload"]["bytes_per_rank"] > 0
    # what the files hold is what the device held between steps: the state (Adam's two moments), the parameter
    # shards and their gradients (the textbook split of ZeRO-3 without offload)
    held, parts = plans["params"]["offload"], plans["none"]
    assert held["shard_bytes_per_rank"] == parts["parameter_bytes_per_rank"]
    assert held["gradient_bytes_per_rank"] == parts["gradient_bytes_per_rank"]
    assert held["state_bytes_per_rank"] == parts["optimizer_bytes_per_rank"] - plans["params"]["optimizer_bytes_per_rank"]
    assert plans["optimizer"]["offload"]["bytes_per_rank"] == plans["params"]["offload"]["state_bytes_per_rank"]
    run_cli(*common, *off, "--snapshot-dir", "s", "--snapshot-every", "2", "--max-steps", "2", "--out", "first",
            check=True, timeout=patience(240))
    run_cli(*common, *off, "--snapshot-dir", "s", "--resume", "auto", "--max-steps", "4", "--out", "second",
            check=True, timeout=patience(240))
    losses = {d: [json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("whole", "second")}
    assert len(losses["second"]) >= 2 and losses["second"][-2:] == losses["whole"][-2:]


def _cfg(**kw):
    return TrainConfig.from_flags(**{**dict(model="gpt", n_layer=2, n_embd=32, n_head=2, dataset="synthetic-text:4000",
                                            block_size=16, global_batch_size=8, max_steps=3, lr=0.01,
                                            weight_decay=0.1, seed=1, log_every=1, progress=False,
                                            verbose=False, eval_every_epoch=False, eval_batches=1), **kw})


def test_muon_and_sgd_stepped_from_offloaded_state_are_their_runs_without_it(tmp_path):
    """Muon under ZeRO-2 (each matrix gathered from the shards' offloaded momentum) and SGD with momentum under
    data parallel (torch's loop, its buffer in the file): bit for bit the runs without offload."""
    layouts = [dict(optimizer="muon", zero=2), dict(optimizer="sgd", lr=0.05, weight_decay=0.0)]
    cfgs = []
    for i, kw in enumerate(layouts):
        cfgs += [_cfg(**kw), _cfg(**kw, offload="optimizer", offload_dir=str(tmp_path / f"off{i}"))]
    runs = run_ranks(_train, 2, cfgs, False, timeout=patience(300))[0]  # (each run's final parameters)
    for i, kw in enumerate(layouts):
        plain, offloaded = runs[2 * i], runs[2 * i + 1]
        assert all(torch.equal(a, b) for a, b in zip(plain, offloaded)), kw
    assert (tmp_path / "off0" / "rank1.bin").stat().st_size > 0


@pytest.mark.parametrize("flags, words", [
    (["--offload", "params", "--offload-dir", "d"], ["--zero 3"]),
    (["--offload", "optimizer"], ["--offload-dir DIR", "the host is the device"]),
    (["--offload-dir", "d"], ["give --offload optimizer or params"]),
    (["--offload", "disk", "--offload-dir", "d"], ["unknown --offload", "optimizer, params"]),
])
def test_what_offload_cannot_do_is_refused_before_anything_starts(refused_here, flags, words):
    proc = refused_here("train", *TINY, "--device", "cpu", *flags, "--max-steps", "1")
    assert all(w in proc.stderr for w in words), proc.stderr
