"""Snapshots and resume: round trip, atomicity, keep-last-K, bad snapshots, safe loading, and
resumed training that is bitwise equal to an uninterrupted run, plus time budgets and LR scaling
(real SIGKILLs, SIGTERMs and full disks under torchrun: tests/test_faults.py).

Bitwise, not approximate: a resumed run replays exactly the same float operations as the
uninterrupted one (same batches, same RNG states, same optimizer state), so any difference at
all means some state was lost or restored wrongly.
"""

import contextlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from distlab import runtime
from distlab.errors import ConfigError
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.train import snapshot as snap
from distlab.train import snapshot_load as snap_load
from distlab.train.config import parse_duration
from distlab.train.optim import lr_multiplier
from tests.conftest import communicate_patiently, patience

LAYOUT = {"model": "mlp", "world_size": 1, "strategy": {"zero": 0}}


def _payload(step, value=1.0):
    return {"model": {"w": torch.full((3, 4), float(value))}, "scheduler": {}, "step": step,
            "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(3, 4)}}, "param_groups": [{"params": [0]}]},
            "rng": snap.rng_state(), "window": [0.0, 0],
            "run": {"history": [{"step": step, "loss": 0.5}], "evals": [], "best_val_loss": None,
                    "best_val_step": None, "time_used_s": 1.0, "last_loss": 0.5, "attempts": 1, "layouts": []}}


def _save(root, step, value=1.0, keep=5, layout=LAYOUT):
    return snap.save(root, step, _payload(step, value), layout, keep)


# --------------------------------------------------------------------------- files


def test_a_rank_file_is_streamed_to_disk_not_serialized_in_memory_first(tmp_path):
    """A snapshot of a model whose state fills the machine must not need that state again in memory: torch.save
    streams into the file, the checksum taken on the way (Python's allocations stay far below the 64 MiB tensor
    the payload holds); what is read back checks out and equals it."""
    import tracemalloc
    payload = _payload(3)
    payload["model"]["big"] = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    tracemalloc.start()
    try:
        path = snap.save(tmp_path, 3, payload, LAYOUT, 5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB allocated while writing"
    loaded = snap_load.resume("auto", str(tmp_path), LAYOUT)
    assert loaded.path == path and torch.equal(loaded.payload["model"]["big"], payload["model"]["big"])


def test_snapshot_round_trip_and_rng(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    path = _save(tmp_path, 7, value=2.5)
    expected = (torch.rand(3), np.random.rand(2), random.random())
    loaded = snap_load.resume("auto", str(tmp_path), LAYOUT)
    assert loaded.path == path and loaded.meta["step"] == 7
    assert torch.equal(loaded.payload["model"]["w"], torch.full((3, 4), 2.5))
    assert loaded.payload["run"]["history"] == [{"step": 7, "loss": 0.5}]
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    snap.set_rng_state(loaded.payload["rng"])  # every generator continues where it was saved
    again = (torch.rand(3), np.random.rand(2), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]
    assert json.loads((path / "meta.json").read_text())["files"]["rank-00000.pt"]["bytes"] == \
        (path / "rank-00000.pt").stat().st_size


def test_keep_last_k(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in snap.snapshots(tmp_path)] == ["step-00000005", "step-00000004"]


def test_pruning_never_touches_another_runs_snapshots(tmp_path):
    for step in (500, 550, 600):
        _save(tmp_path, step, keep=3, layout={**LAYOUT, "run_id": "older"})
    for step in (10, 20, 30, 40, 50, 60):
        _save(tmp_path, step, keep=3, layout={**LAYOUT, "run_id": "newer"})
    names = [p.name for p in snap.snapshots(tmp_path)]
    assert names == ["step-00000600", "step-00000550", "step-00000500", "step-00000060", "step-00000050",
                     "step-00000040"]
    assert [p.name for p in snap.foreign(tmp_path, "newer")] == names[:3]


def test_crash_while_writing_leaves_the_previous_snapshot(tmp_path, monkeypatch):
    _save(tmp_path, 1, value=1.0)
    real = snap._write_file

    def crash_on_meta(path, data):
        if path.name == "meta.json":
            raise OSError("disk died")  # the rank file of step 2 is on disk, its meta.json never is
        real(path, data)
    monkeypatch.setattr(snap, "_write_file", crash_on_meta)
    with pytest.raises(snap.SnapshotError, match=r"the snapshot of step 2 could not be written: disk died writing "
                                                 r".*tmp-step-00000002; the previous snapshot .*step-00000001 is intact"):
        _save(tmp_path, 2, value=2.0)
    monkeypatch.setattr(snap, "_write_file", real)
    assert [p.name for p in snap.snapshots(tmp_path)] == ["step-00000001"]
    assert not (tmp_path / ".tmp-step-00000002").exists()  # the partial snapshot is removed
    assert torch.equal(snap_load.resume("auto", str(tmp_path), LAYOUT).payload["model"]["w"], torch.ones(3, 4))
    _save(tmp_path, 2, value=2.0)  # the half-written attempt does not get in the way of the next
    assert snap_load.resume("auto", str(tmp_path), LAYOUT).meta["step"] == 2


@pytest.mark.parametrize("damage,message", [
    (lambda f: f.write_bytes(f.read_bytes()[:100]), "truncated"),
    (lambda f: f.write_bytes(f.read_bytes()[:-5] + b"XXXXX"), "corrupt"),
    (lambda f: f.unlink(), "missing rank-00000.pt"),
    (lambda f: (f.parent / "meta.json").write_text("{not json"), "meta.json is corrupt"),
])
def test_bad_snapshot_is_refused_and_auto_falls_back(tmp_path, damage, message):
    _save(tmp_path, 1, value=1.0)
    newest = _save(tmp_path, 2, value=2.0)
    damage(newest / "rank-00000.pt")
    with pytest.raises(snap.SnapshotError, match=message):
        snap_load.resume(str(newest), None, LAYOUT)
    warnings = []
    loaded = snap_load.resume("auto", str(tmp_path), LAYOUT, on_warning=warnings.append)
    assert loaded.meta["step"] == 1 and torch.equal(loaded.payload["model"]["w"], torch.ones(3, 4))
    assert any(message in w for w in warnings) and any("newest good snapshot" in w for w in warnings)


def test_a_bad_snapshot_is_moved_aside_not_overwritten(tmp_path):
    bad = _save(tmp_path, 3)
    (bad / "rank-00000.pt").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="moved the earlier snapshot"):
        _save(tmp_path, 3, value=4.0)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000003.bad-")]
    assert len(aside) == 1 and (aside[0] / "rank-00000.pt").read_bytes() == b"garbage"
    assert torch.equal(snap_load.resume("auto", str(tmp_path), LAYOUT).payload["model"]["w"], torch.full((3, 4), 4.0))


def test_snapshot_of_another_layout_is_refused_naming_the_difference(tmp_path):
    _save(tmp_path, 1)
    other = {**LAYOUT, "world_size": 4}
    with pytest.raises(snap.SnapshotError, match=r"world size 1, this run has 4"):
        snap_load.resume(str(tmp_path / "step-00000001"), None, other)
    with pytest.raises(snap.IncompatibleSnapshot, match=r"strategy \{'zero': 0\}, this run has \{'zero': 3\}"):
        snap_load.resume("auto", str(tmp_path), {**LAYOUT, "strategy": {"zero": 3}})
    assert [p.name for p in snap.snapshots(tmp_path)] == ["step-00000001"]  # a good snapshot stays where it is
    assert snap_load.resume("auto", str(tmp_path / "empty"), LAYOUT) is None  # nothing yet: start afresh


def test_loading_never_executes_code_from_a_snapshot(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    path = _save(tmp_path, 1)
    data = (path / "rank-00000.pt")
    torch.save({"model": Evil()}, data)
    meta = json.loads((path / "meta.json").read_text())  # checksums made to match: only weights_only stands guard
    import hashlib
    meta["files"]["rank-00000.pt"] = {"sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                                      "bytes": data.stat().st_size}
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(snap.SnapshotError, match="cannot be loaded safely: it holds a Python object") as refused:
        snap_load.resume(str(path), None, LAYOUT)
    assert not marker.exists() and "\n" not in str(refused.value)  # one line, not torch's page of advice


def _rehash(path, payload):
    """Write ``payload`` as rank 0's file of snapshot ``path`` with a matching checksum (only the schema
    check stands between it and a resume)."""
    import hashlib
    data = path / "rank-00000.pt"
    torch.save(payload, data)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"]["rank-00000.pt"] = {"sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                                      "bytes": data.stat().st_size}
    (path / "meta.json").write_text(json.dumps(meta))


def _edit_meta(path, change):
    meta = json.loads((path / "meta.json").read_text())
    change(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _edit_payload(path, change):
    payload = _payload(2, 2.0)
    change(payload)
    _rehash(path, payload)


MALFORMED = {
    "files as a list": lambda p: _edit_meta(p, lambda m: m.update(files=list(m["files"]))),
    "deeply nested meta.json": lambda p: (p / "meta.json").write_text("[" * 100_000 + "]" * 100_000),
    "meta.json a list": lambda p: (p / "meta.json").write_text("[1, 2]"),
    "meta step a string": lambda p: _edit_meta(p, lambda m: m.update(step="2")),
    "meta step of another directory": lambda p: _edit_meta(p, lambda m: m.update(step=7)),
    "world size 0": lambda p: _edit_meta(p, lambda m: m.update(world_size=0)),
    "a checksum that is a number": lambda p: _edit_meta(p, lambda m: m["files"]["rank-00000.pt"].update(sha256=5)),
    "missing run": lambda p: _edit_payload(p, lambda d: d.pop("run")),
    "run history a string": lambda p: _edit_payload(p, lambda d: d["run"].update(history="x")),
    "bad RNG state": lambda p: _edit_payload(p, lambda d: d["rng"].update(torch=torch.zeros(3))),
    "bad numpy RNG state": lambda p: _edit_payload(p, lambda d: d["rng"]["numpy"].update(keys=torch.zeros(2))),
    "payload step -100": lambda p: _edit_payload(p, lambda d: d.update(step=-100)),
    "payload step 1e18": lambda p: _edit_payload(p, lambda d: d.update(step=10 ** 18)),
    "window of three": lambda p: _edit_payload(p, lambda d: d.update(window=[0.0, 1, 2])),
    "model a list": lambda p: _edit_payload(p, lambda d: d.update(model=[1])),
    "a payload that is a tensor": lambda p: _rehash(p, torch.zeros(2)),
    "optimizer without param_groups": lambda p: _edit_payload(p, lambda d: d["optimizer"].pop("param_groups")),
    "optimizer param_groups a string": lambda p: _edit_payload(p, lambda d: d["optimizer"].update(param_groups="x")),
    "optimizer state of an unlisted parameter": lambda p: _edit_payload(
        p, lambda d: d["optimizer"]["state"].update({7: {"momentum_buffer": torch.zeros(1)}})),
    "optimizer state a list": lambda p: _edit_payload(p, lambda d: d["optimizer"].update(state=[1])),
    "nan weights": lambda p: _edit_payload(p, lambda d: d["model"]["w"].__setitem__((0, 0), float("nan"))),
    "inf momentum": lambda p: _edit_payload(
        p, lambda d: d["optimizer"]["state"][0]["momentum_buffer"].__setitem__((1, 1), float("-inf"))),
}


@pytest.mark.parametrize("variant", list(MALFORMED))
def test_a_malformed_snapshot_is_one_line_and_auto_falls_back_past_it(tmp_path, variant):
    _save(tmp_path, 1, value=1.0)
    newest = _save(tmp_path, 2, value=2.0)
    MALFORMED[variant](newest)
    with pytest.raises(snap.DamagedSnapshot) as refused:
        snap_load.resume(str(newest), None, LAYOUT)
    assert "\n" not in str(refused.value) and str(newest) in str(refused.value) and len(str(refused.value)) < 400
    warnings = []
    loaded = snap_load.resume("auto", str(tmp_path), LAYOUT, on_warning=warnings.append)
    assert loaded.meta["step"] == 1 and torch.equal(loaded.payload["model"]["w"], torch.ones(3, 4))
    assert len(warnings) == 2 and "moved aside to step-00000002.bad-" in warnings[0]
    assert [p.name for p in snap.snapshots(tmp_path)] == ["step-00000001"]  # out of every later count, not deleted
    assert len(list(tmp_path.glob("step-00000002.bad-*"))) == 1


def test_a_damaged_snapshot_is_nobodys_and_pruning_keeps_good_ones(tmp_path):
    for step in (10, 20):
        _save(tmp_path, step, keep=2, layout={**LAYOUT, "run_id": "r"})
    (tmp_path / "step-00000020" / "meta.json").write_text("{not json")
    assert snap.foreign(tmp_path, "r") == []  # unreadable is not "another run's"
    assert [p.name for p in snap.foreign(tmp_path, "s")] == ["step-00000010"]
    # An explicit resume of step 10 while step 20 is good: the run's new line never deletes what it just wrote.
    shutil.rmtree(tmp_path / "step-00000020")
    _save(tmp_path, 20, keep=2, layout={**LAYOUT, "run_id": "r"})
    _save(tmp_path, 11, keep=1, layout={**LAYOUT, "run_id": "r"})
    assert [p.name for p in snap.snapshots(tmp_path)] == ["step-00000020", "step-00000011"]


def test_snapshot_names_hold_steps_of_any_size(tmp_path):
    _save(tmp_path, 5, keep=2)
    big = _save(tmp_path, 123_456_789, keep=2)
    assert big.name == "step-123456789" and snap.snapshots(tmp_path)[0] == big
    assert snap_load.resume("auto", str(tmp_path), LAYOUT).meta["step"] == 123_456_789
    _save(tmp_path, 10 ** 12, keep=2)
    assert [snap.step_of(p) for p in snap.snapshots(tmp_path)] == [10 ** 12, 123_456_789]  # step 5 pruned


def test_resume_path_checks(tmp_path):
    _save(tmp_path, 1)
    snap_load.check_path(tmp_path / "step-00000001")
    with pytest.raises(snap.SnapshotError, match="--resume auto --snapshot-dir"):
        snap_load.check_path(tmp_path)
    with pytest.raises(snap.SnapshotError, match="no snapshot there"):
        snap_load.check_path(tmp_path / "nowhere")


# --------------------------------------------------------------------------- flags


def test_durations_and_lr_scaling():
    assert parse_duration("2h") == 7200 and parse_duration("90m") == 5400 and parse_duration("3600s") == 3600
    assert parse_duration("1h30m") == 5400 and parse_duration("12.5") == 12.5
    with pytest.raises(ConfigError, match="2h, 90m"):
        parse_duration("two hours")
    base = dict(dataset="synthetic:1x8x8:4:96", global_batch_size=64, lr=0.1)
    assert TrainConfig.from_flags(**base, lr_scaling="linear", base_batch_size=16).effective_lr == pytest.approx(0.4)
    assert TrainConfig.from_flags(**base, lr_scaling="sqrt", base_batch_size=16).effective_lr == pytest.approx(0.2)
    assert TrainConfig.from_flags(**base).effective_lr == 0.1
    with pytest.raises(ConfigError, match="`base_batch_size`"):
        TrainConfig.from_flags(**base, lr_scaling="sqrt").validate(2)
    with pytest.raises(ConfigError, match="`snapshot_dir`"):
        TrainConfig.from_flags(**base, snapshot_every=5).validate(1)
    cfg = TrainConfig.from_flags(**base, warmup_steps=4, lr_schedule="constant")
    assert [lr_multiplier(s, cfg, 100) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cfg = TrainConfig.from_flags(**base, warmup_steps=2, lr_schedule="cosine")
    assert lr_multiplier(50, cfg, 100) == pytest.approx(0.5) and lr_multiplier(0, cfg, 100) == 0.5


# --------------------------------------------------------------------------- training


def _cfg(tmp, **kw):
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:192", epochs=3, max_steps=None,
                    global_batch_size=16, lr=0.05, lr_schedule="cosine", optimizer="sgd", seed=5, log_every=2,
                    progress=False, verbose=False, val_fraction=0.25, snapshot_dir=str(tmp))
    return TrainConfig.from_flags(**{**settings, **kw})


def _resume_vs_straight(rank, world, straight, first, second):
    """``straight`` in one go; ``first`` then ``second`` (which resumes): final states must match."""
    a = Trainer(straight.validate(world), runtime.from_process_group())
    a.fit()
    b1 = Trainer(first.validate(world), runtime.from_process_group())
    b1.fit()
    b2 = Trainer(second.validate(world), runtime.from_process_group())
    summary = b2.fit()
    same_params = all(torch.equal(x, y) for x, y in zip(a.full_parameters(), b2.full_parameters()))
    same_optimizer = all(torch.equal(x, y) for x, y in zip(_opt_tensors(a), _opt_tensors(b2)))
    # what they logged, but for the clock: the first part's last line (logged only because it ended
    # there, mid-window) is gone, and the resumed part logs the window the uninterrupted run did
    logged = [[{k: v for k, v in r.items() if not k.endswith(("_per_s", "time_s", "mfu"))} for r in t.history]
              for t in (a, b2)]
    return same_params, same_optimizer, summary["resumed_from"], summary["best_val_step"], logged


def _opt_tensors(trainer):
    return [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


@pytest.mark.parametrize("world,extra", [(2, {}), (2, {"zero": 3, "optimizer": "adam", "lr": 0.01}),
                                         (2, {"zero": 3, "zero_impl": "plain", "optimizer": "adam", "lr": 0.01}),
                                         (4, {"dp_sync": "ddp"}),  # DDP re-cuts its buckets (4: a 2-rank sum is order-free)
                                         (2, {"tp": 2, "dp_sync": "bucketed"}),
                                         (2, {"pp": 2, "microbatches": 4, "optimizer": "adam", "lr": 0.01}),
                                         # PowerSGD's error feedback and warm start, distlab's and torch's DDP hook
                                         (2, {"grad_compression": "powersgd:2"}),
                                         (2, {"dp_sync": "ddp", "grad_compression": "powersgd:2"})])
def test_stop_and_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path, world, extra):
    # 144 training samples / 16 = 9 steps an epoch, 27 in all: the first part stops at step 13,
    # mid-epoch, with a snapshot; the second resumes from it (--resume auto) and finishes.
    straight = _cfg(tmp_path / "a", **extra)
    steps = 13
    first = _cfg(tmp_path / "b", snapshot_every=5, **extra)
    second = _cfg(tmp_path / "b", snapshot_every=5, resume="auto", **extra)
    first.max_steps = steps
    first.lr_schedule = straight.lr_schedule = second.lr_schedule = "constant"  # max_steps must not change the LR
    results = run_ranks(_resume_vs_straight, world, straight, first, second, timeout=180)
    for same_params, same_optimizer, resumed_from, best_step, (logged, resumed_logged) in results:
        assert same_params and same_optimizer
        assert resumed_logged == logged and not any(r.get("end_of_run") for r in logged[:-1])
        assert resumed_from.endswith(f"step-{steps:08d}")
        assert best_step is not None


def _constant_cfg(tmp, **kw):
    return _cfg(tmp, **{"lr_schedule": "constant", **kw})


def _fit(cfg):
    return Trainer(cfg.validate(1), runtime.from_process_group()).fit()


def test_a_fresh_run_never_uses_another_runs_snapshot_dir_and_a_resume_keeps_its_identity(tmp_path):
    run_ranks(_fresh_run_and_resume, 1, tmp_path, timeout=120)


def _fresh_run_and_resume(rank, world, tmp_path):
    _cfg = _constant_cfg  # the run is made longer on resume: only a constant LR schedule allows that
    first = _fit(_cfg(tmp_path / "s", max_steps=6, snapshot_every=3, keep_snapshots=2))
    before = sorted(p.name for p in (tmp_path / "s").iterdir())
    with pytest.raises(snap.SnapshotError, match=r"holds 2 snapshot\(s\) of another run .*`resume` auto"):
        _fit(_cfg(tmp_path / "s", max_steps=4, snapshot_every=2))
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == before  # nothing written, nothing pruned
    with pytest.raises(snap.SnapshotError, match="lr 0.05, this run has 0.1"):  # another configuration
        _fit(_cfg(tmp_path / "s", max_steps=9, snapshot_every=3, resume="auto", lr=0.1))
    resumed = _fit(_cfg(tmp_path / "s", max_steps=9, snapshot_every=3, keep_snapshots=2, resume="auto"))
    assert resumed["run_id"] == first["run_id"] and resumed["fingerprint"] == first["fingerprint"]
    assert resumed["resumed_from"].endswith("step-00000006") and Path(resumed["snapshot"]).is_dir()
    assert [p.name for p in snap.snapshots(tmp_path / "s")] == ["step-00000009", "step-00000006"]


def _damage_rank_file(path: Path, rank: int, change) -> None:
    """Change rank ``rank``'s payload of snapshot ``path`` and make its checksum match again."""
    import hashlib
    data = path / f"rank-{rank:05d}.pt"
    payload = torch.load(data, weights_only=True)
    change(payload)
    torch.save(payload, data)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][data.name] = {"sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "bytes": data.stat().st_size}
    (path / "meta.json").write_text(json.dumps(meta))


def _first_moment_reshaped(payload):
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)


def _weights_renamed(payload):
    payload["model"]["units"] = payload["model"]["units"][:1]


def _first_moment_0d(payload):
    payload["optimizer"]["state"][0]["exp_avg"] = torch.zeros(())


def _first_moment_a_string(payload):
    payload["optimizer"]["state"][0]["exp_avg"] = "abc"


def _lr_a_string(payload):
    payload["optimizer"]["param_groups"][0]["lr"] = "0.01"


def _schedule_step_a_string(payload):
    payload["scheduler"]["last_epoch"] = "4"


@pytest.mark.parametrize("damage", [_first_moment_reshaped, _weights_renamed, _first_moment_0d, _first_moment_a_string,
                                    _lr_a_string, _schedule_step_a_string])
def test_a_snapshot_whose_contents_do_not_load_is_set_aside_on_every_rank(tmp_path, damage):
    """Checksums valid, yet rank 0's state does not fit the run (ZeRO-1 on 2 ranks, Adam): a moment of
    another shape -- 0-d too --, a string where a tensor, a learning rate or a step count belongs, weights
    of another model: every rank falls back to the snapshot before it, none crashes mid-run."""
    run_ranks(_damaged_contents_then_resume, 2, tmp_path, damage, timeout=180)


def _damaged_contents_then_resume(rank, world, tmp_path, damage):
    kw = dict(snapshot_every=2, lr_schedule="constant", optimizer="adam", lr=0.01, zero=1, val_fraction=0.0)

    def _fit(cfg):
        return Trainer(cfg.validate(world), runtime.from_process_group()).fit()
    _fit(_cfg(tmp_path / "s", max_steps=4, **kw))
    newest = tmp_path / "s" / "step-00000004"
    if rank == 0:
        _damage_rank_file(newest, 0, damage)
    torch.distributed.barrier()
    with pytest.raises(snap.DamagedSnapshot, match=f"snapshot {newest}.* (shape|does not load|is not|not a)"):
        _fit(_cfg(tmp_path / "s", max_steps=6, resume=str(newest), **kw))
    resumed = _fit(_cfg(tmp_path / "s", max_steps=6, resume="auto", **kw))
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["steps"] == 6
    assert len(list((tmp_path / "s").glob("step-00000004.bad-*"))) == 1


def test_a_corrupt_newest_snapshot_is_moved_aside_and_the_run_goes_on_from_the_previous(tmp_path):
    run_ranks(_corrupt_newest_then_resume, 1, tmp_path, timeout=120)


def _corrupt_newest_then_resume(rank, world, tmp_path):
    kw = dict(snapshot_every=2, lr_schedule="constant")
    first = _fit(_cfg(tmp_path / "s", max_steps=4, keep_snapshots=2, **kw))
    (tmp_path / "s" / "step-00000004" / "meta.json").write_text("{not json")
    # keep 1 and a snapshot every step: pruning counts the good snapshots of this run only
    resumed = _fit(_cfg(tmp_path / "s", max_steps=3, keep_snapshots=1, resume="auto", **{**kw, "snapshot_every": 1}))
    assert resumed["resumed_from"].endswith("step-00000002") and resumed["run_id"] == first["run_id"]
    assert [p.name for p in snap.snapshots(tmp_path / "s")] == ["step-00000003"]
    assert len(list((tmp_path / "s").glob("step-00000004.bad-*"))) == 1  # kept for inspection, in no count
    again = _fit(_cfg(tmp_path / "s", max_steps=5, keep_snapshots=1, resume="auto", **kw))
    assert again["resumed_from"].endswith("step-00000003") and again["steps"] == 5


def test_out_and_snapshot_dir_of_another_run_are_refused_before_launch(refused_here, run_cli, tmp_path):
    args = ("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--max-steps", "4",
            "--no-progress", "--snapshot-every", "2")
    run_cli(*args, "--out", "run", "--snapshot-dir", "snaps", check=True)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    proc = refused_here(*args, "--out", "run", "--snapshot-dir", "other")
    assert proc.returncode == 2 and "--out run already holds a run" in proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics and not (tmp_path / "other").exists()
    proc = refused_here(*args, "--out", "run2", "--snapshot-dir", "snaps", "--nproc-per-node", "2")
    assert proc.returncode == 2 and "--snapshot-dir snaps holds 2 snapshot(s) of another run" in proc.stderr
    assert "--resume auto" in proc.stderr and not (tmp_path / "run2").exists()


TINY = ("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--no-progress", "--snapshot-every", "2")


def test_resume_never_touches_another_runs_out_and_a_finished_run_stays_as_it_was(refused_here, run_cli, tmp_path):
    run_cli(*TINY, "--max-steps", "4", "--out", "a", "--snapshot-dir", "sa", check=True)
    run_cli(*TINY, "--max-steps", "4", "--out", "b", "--snapshot-dir", "sb", check=True)
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    files = {p: p.read_bytes() for d in "ab" for p in (tmp_path / d).iterdir() if p.suffix in (".json", ".jsonl")}
    proc = refused_here(*TINY, "--max-steps", "4", "--out", "b", "--snapshot-dir", "sa", "--resume", "auto")
    assert proc.returncode == 2 and f"--out b holds run {b['run_id']}, this run resumes run {a['run_id']}" in \
        proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    proc = run_cli(*TINY, "--max-steps", "4", "--out", "a", "--snapshot-dir", "sa", "--resume", "auto", check=True)
    assert f"run {a['run_id']} had finished (step 4" in proc.stderr and "nothing changed" in proc.stderr
    assert all(p.read_bytes() == data for p, data in files.items())  # no summary rewritten, no resume counted
    proc = refused_here(*TINY, "--max-steps", "4", "--out", "a", "--snapshot-dir", "sa", "--resume", "auto", "--lr", "0.2")
    assert proc.returncode == 2 and "was written with lr 0.05, this run has 0.2" in proc.stderr
    assert "none of" not in proc.stderr and "move them away" not in proc.stderr
    proc = refused_here(*TINY, "--max-steps", "3", "--out", "a", "--snapshot-dir", "sa", "--resume", "auto")
    assert proc.returncode == 2 and "total steps 4, this run has 3 (the LR schedule decays" in proc.stderr, proc.stderr
    run_cli("train", "--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16", "--no-progress", "--max-steps", "2",
            "--out", "c", check=True)
    proc = refused_here(*TINY, "--max-steps", "2", "--out", "c", "--snapshot-dir", "sc")  # c's run left no snapshot
    assert proc.returncode == 2 and "--out c already holds a run" in proc.stderr and "--resume" not in proc.stderr
    proc = refused_here(*TINY, "--max-steps", "2", "--out", "a", "--snapshot-dir", "fresh")
    assert proc.returncode == 2 and "--resume auto --snapshot-dir sa" in proc.stderr, proc.stderr


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody may write into: a read-only tmpfs as root (permission bits do not stop root),
    mode 0555 otherwise."""
    import subprocess
    path = tmp_path / "ro"
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        path.chmod(0o555)
        if os.access(path, os.W_OK):
            pytest.skip("cannot make a read-only directory here")
    yield path
    if mounted:
        subprocess.run(["umount", str(path)], check=False)
    path.chmod(0o755)


@pytest.fixture
def full_dir(tmp_path):
    """A directory on a file system with no space left (a small tmpfs filled up; root only), holding an
    empty subdirectory ``run``."""
    import subprocess
    path = tmp_path / "full"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs and fill it")
    (path / "run").mkdir()
    with open(path / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * 4096)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)  # lazily: nothing may keep it mounted


def test_a_full_disk_is_one_line_before_launch_and_while_running(refused_here, run_cli, tmp_path, full_dir):
    proc = refused_here(*TINY, "--max-steps", "2", "--snapshot-dir", "s", "--out", "full/run2")
    assert proc.returncode == 2 and "--out full/run2 cannot be written" in proc.stderr, proc.stderr
    assert "No space left on device" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    from distlab.errors import WriteError
    from distlab.train.metrics import MetricsLog, write_summary
    log = MetricsLog(full_dir / "run")
    for write in (lambda: log.write({"step": 1, "loss": 0.5}), lambda: write_summary(full_dir / "run", {"steps": 1})):
        with pytest.raises(WriteError, match=r"could not write .*/run/(metrics.jsonl|summary.json): No space left on "
                                             r"device \(errno 28\); free some space"):
            write()
    assert sorted(p.name for p in (full_dir / "run").iterdir()) in ([], ["metrics.jsonl"])  # nothing half-written


def test_unwritable_directories_and_export_targets_are_one_line_before_any_work(refused_here, run_cli, tmp_path, read_only_dir):
    import hashlib
    (tmp_path / "afile").write_text("x")
    for flags, message in ((("--snapshot-dir", "afile"), "--snapshot-dir afile is a file, not a directory"),
                           (("--snapshot-dir", "s", "--out", "afile/run"), "--out afile/run cannot be made: afile is"),
                           (("--snapshot-dir", "ro/s"), "--snapshot-dir ro/s cannot be written"),
                           (("--snapshot-dir", "s", "--out", "ro"), "--out ro cannot be written")):
        proc = refused_here(*TINY, "--max-steps", "2", *flags)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert not (tmp_path / "s").exists()  # refused before anything was made
    run_cli(*TINY, "--max-steps", "2", "--snapshot-dir", "s", "--out", "run", check=True)
    for target, message in (("run", "-o run is a directory"), ("ro/model.pt", "ro/model.pt could not be written")):
        proc = refused_here("export", "s/step-00000002", "-o", target)
        assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert list(read_only_dir.iterdir()) == [] and not list((tmp_path / "run").glob("*.pt"))
    proc = run_cli("export", "s/step-00000002", "-o", "model.pt", check=True)
    digest = hashlib.sha256((tmp_path / "model.pt").read_bytes()).hexdigest()
    assert (tmp_path / "model.pt.sha256").read_text() == f"{digest}  model.pt\n" and digest[:16] in proc.stdout


def _strict_json(path):
    def refuse(token):
        raise AssertionError(f"{path} holds {token}: not strict JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_non_finite_settings_are_refused_and_a_diverging_run_stops_at_its_step_keeping_the_last_good_state(refused_here, 
        run_cli, tmp_path):
    torch.save({"net.1.weight": torch.full((16, 64), float("nan")), "net.1.bias": torch.zeros(16)},
               tmp_path / "nan.pt")
    for flags, name in ((("--lr", "nan"), "--lr"), (("--lr", "inf"), "--lr"), (("--weight-decay", "nan"), "--weight-decay"),
                        (("--time-budget", "nan"), "--time-budget"), (("--momentum", "-1"), "--momentum"),
                        (("--eval-batch-size", "0"), "--eval-batch-size"), (("--init-from", "nan.pt"), "non-finite")):
        proc = refused_here(*TINY, "--max-steps", "2", "--snapshot-dir", "s", "--out", "r", *flags)
        assert proc.returncode == 2 and name in proc.stderr and proc.stderr.count("\n") == 1, (flags, proc.stderr)
        assert not (tmp_path / "r").exists()
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:2560", "--mlp-widths", "16", "--lr", "1e20",
                   "--nproc-per-node", "2", "--max-steps", "20", "--snapshot-dir", "s", "--snapshot-every", "10",
                   "--out", "r", "--no-progress")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "distlab: error: training diverged at step 2: the gradients are not finite" in proc.stderr
    assert "the last good state is in s/step-00000001" in proc.stderr
    summary = _strict_json(tmp_path / "r" / "summary.json")
    assert summary["stopped"] == "non_finite" and summary["steps"] == 1
    for record in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines():
        json.loads(record, parse_constant=lambda t: pytest.fail(f"metrics.jsonl holds {t}"))
    meta = snap.read_meta(tmp_path / "s" / "step-00000001")
    assert all(torch.isfinite(t).all() for r in range(2) for t in
               snap_load.load_rank_file(tmp_path / "s" / "step-00000001", meta, r)["model"].values())


def test_a_first_ctrl_c_stops_cleanly_and_a_second_stops_at_once():
    import signal
    from distlab.train.preemption import Preemption
    before = signal.getsignal(signal.SIGINT)
    with Preemption() as stop:
        assert stop.poll() is None
        os.kill(os.getpid(), signal.SIGINT)  # delivered to this (main) thread before kill returns
        assert stop.poll() == "interrupted"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGINT) is before  # the handler of before the run is back


def _long_run_with_a_snapshot(tmp_path, nproc: str | None, env: dict | None = None):
    """A run far longer than any test, started in ``tmp_path``, once it has written its first snapshot."""
    import subprocess
    import sys
    import time
    cmd = [sys.executable, "-m", "distlab", "train", "--dataset", "synthetic:1x8x8:4:200000", "--mlp-widths", "16",
           "--no-progress", "--device", "cpu", "--snapshot-every", "20", "--snapshot-dir", "s", "--out", "run",
           "--lr-schedule", "constant", *(["--nproc-per-node", nproc] if nproc else [])]
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, **(env or {})}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + patience(120)
    while time.time() < deadline and not snap.snapshots(tmp_path / "s"):
        if proc.poll() is not None:
            raise AssertionError(proc.communicate())
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("nproc", [None, "2"])
def test_ctrl_c_snapshots_writes_its_summary_and_exits_130(tmp_path, nproc):
    import signal
    proc = _long_run_with_a_snapshot(tmp_path, nproc)
    try:
        proc.send_signal(signal.SIGINT)
        out, err = communicate_patiently(proc, 60)
    finally:
        proc.kill()
    assert (tmp_path / "run" / "summary.json").exists(), (proc.returncode, out[-3000:], err[-3000:])
    summary = _strict_json(tmp_path / "run" / "summary.json")
    assert proc.returncode == 130 and summary["stopped"] == "interrupted", (out, err)
    assert summary["snapshot"].endswith(f"step-{summary['steps']:08d}")  # the step it stopped at, saved
    assert "Traceback" not in err and not any(line.startswith(("W", "E", "[")) for line in err.splitlines()), err
    if nproc:
        assert f"stopped by SIGINT at step {summary['steps']} as asked; snapshot" in err
    else:
        assert f"interrupted (Ctrl-C) at step {summary['steps']}" in out


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _descendants(pid: int) -> list[int]:
    found = _children(pid)
    for child in list(found):
        found += _descendants(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_one_run_per_snapshot_dir_and_workers_die_with_their_launcher(refused_here, run_cli, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    long_run = [sys.executable, "-m", "distlab", "train", "--dataset", "synthetic:1x8x8:4:200000", "--mlp-widths",
                "16", "--no-progress", "--nproc-per-node", "2", "--device", "cpu", "--snapshot-every", "5",
                "--snapshot-dir", "s", "--out", "run", "--lr-schedule", "constant"]
    from distlab.launch import prefork
    # a shell's environment: no server of another process to share (tests/test_prefork.py has that case)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", prefork.SOCKET_ENV, prefork.KEY_ENV)}
    env["TMPDIR"] = str(tmp_path)  # the launcher's temporary directories: a SIGKILLed one cannot remove them
    first = subprocess.Popen(long_run, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + patience(120)
        while time.time() < deadline and not snap.snapshots(tmp_path / "s"):
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.2)
        holder = json.loads((tmp_path / "s" / ".distlab-lock").read_text())
        assert holder["pid"] == first.pid and holder["run_id"]
        proc = refused_here(*TINY, "--max-steps", "4", "--snapshot-dir", "s", "--out", "second", "--resume", "auto")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"--snapshot-dir s is in use by another run (run id {holder['run_id']}, pid {first.pid} on host" \
            in proc.stderr and not (tmp_path / "second").exists()
        # torchrun's two workers; started warm, their two clients, the prefork server and the two it forked
        workers = _descendants(first.pid)
        assert len(workers) == (2 if os.environ.get("DISTLAB_WORKER_START") == "exec" else 5), workers
        assert all(_alive(w) for w in workers)
        first.send_signal(signal.SIGKILL)  # the launcher only
        first.wait(timeout=patience(30))
        deadline = time.time() + patience(30)
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)  # no orphan trains on beside a restart
    finally:
        if first.poll() is None:
            first.kill()
    # The lock died with its holder: the restart takes the directory and goes on from the newest snapshot.
    newest = snap.step_of(snap.snapshots(tmp_path / "s")[0])
    proc = run_cli(*TINY[:-2], "--dataset", "synthetic:1x8x8:4:200000", "--nproc-per-node", "2", "--snapshot-every",
                   "5", "--snapshot-dir", "s", "--out", "run", "--lr-schedule", "constant", "--resume", "auto",
                   "--max-steps", str(newest + 2), check=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == newest + 2 and summary["run_id"] == holder["run_id"]


def test_a_launch_from_a_process_that_goes_on_lets_its_directories_go_when_its_workers_end(tmp_path):
    """``distlab.cli.main`` called from Python (a notebook, a sweep): the launch holds its directories while its
    workers run and lets them go when they end, so the same process can run into them again."""
    import fcntl

    from tests.conftest import invoke
    argv = [*TINY, "--nproc-per-node", "2", "--snapshot-dir", "s", "--out", "run", "--lr-schedule", "constant"]
    code, _, err = invoke([*argv, "--max-steps", "2"], tmp_path, fds=True)
    assert code == 0, err
    for held in ("s", "run"):
        fd = os.open(tmp_path / held / ".distlab-lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while this process still holds it
        finally:
            os.close(fd)
    code, _, err = invoke([*argv, "--max-steps", "4", "--resume", "auto"], tmp_path, fds=True)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_time_budget_stops_cleanly_with_a_snapshot_and_summary(run_cli, tmp_path):
    proc = run_cli("train", "--dataset", "synthetic:1x28x28:10:20000", "--epochs", "100", "--time-budget", "3s",
                   "--snapshot-dir", "snaps", "--out", "run", "--log-every", "100", "--no-progress", check=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped"] == "time_budget" and 0 < summary["steps"] < 100 * 312
    assert summary["test_accuracy"] is not None
    # It stopped where one more step, the final evaluation and the snapshot would not have fitted any more:
    # the time used then plus what it kept reach the budget (equal to it but for one rounding of a sum).
    # Whether the end then took no longer than kept is a prediction (a loaded machine may stall it): the
    # estimate itself is test_the_time_budget_counts_on_the_slowest_recent_step_and_leaves_out_warm_up's.
    stop, kept = summary["time_budget_stop_s"], summary["time_budget_kept_s"]
    assert 0 < stop <= summary["time_used_s"] and kept > 0.2 and stop + kept >= 3.0 * (1 - 2 ** -52)
    assert summary["snapshot"].endswith(f"step-{summary['steps']:08d}")
    meta = snap.read_meta(tmp_path / summary["snapshot"])
    assert meta["step"] == summary["steps"] and "time budget 3 s reached" in proc.stdout
    assert f"(stopped at {stop:.1f} s, keeping {kept:.1f} s for the last step, evaluation and snapshot)" in proc.stdout


def test_bench_scaling_table_json_and_plots(run_cli, tmp_path):
    proc = run_cli("bench", "scaling", "--world", "2", "--dataset", "synthetic:1x8x8:4:1024", "--max-steps", "12",
                   "--per-worker-batch", "16", "--global-batch", "32", "--out", "sc", "--plot", "plots", timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = json.loads((tmp_path / "sc" / "scaling.json").read_text())
    by = {(r["mode"], r["world_size"]): r for r in records}
    assert set(by) == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}  # world 1 added as the baseline
    assert by["weak", 1]["scaling_efficiency"] == 1.0 and by["weak", 2]["global_batch_size"] == 32
    # every run's ranks get the threads the largest world's do: efficiency compares equal compute per rank
    assert len({r["threads_per_rank"] for r in records}) == 1, [r["threads_per_rank"] for r in records]
    assert by["weak", 2]["lr"] == pytest.approx(1e-3 * 2 ** 0.5)  # sqrt scaling from the per-worker batch
    assert by["strong", 2]["global_batch_size"] == 32 and by["strong", 2]["lr"] == pytest.approx(1e-3)
    # 1024 * 0.9 training samples: 57 steps an epoch at 16, 28 at 32; efficiency is per-worker throughput.
    assert by["weak", 1]["steps_per_epoch"] == 57 and by["weak", 2]["steps_per_epoch"] == 28
    w2 = by["weak", 2]
    assert w2["scaling_efficiency"] == pytest.approx(w2["samples_per_s"] / (2 * by["weak", 1]["samples_per_s"]))
    assert all(r["best_val_loss"] is not None and 0 <= r["test_accuracy"] <= 1 for r in records)
    assert "steps/ep" in proc.stdout and "best val" in proc.stdout
    assert (tmp_path / "plots" / "scaling-loss-vs-time.png").stat().st_size > 10_000


def test_the_time_budget_counts_on_the_slowest_recent_step_and_leaves_out_warm_up():
    """What the budget keeps for the end: one more step as slow as the slowest of the last 20 (a
    loaded machine's steps are not all the typical one; a budget overrun by one slow step is one
    the job's scheduler kills), the final evaluation and snapshot (estimated from the typical step
    before they were ever timed) and a margin."""
    from distlab.train.run_state import time_to_finish
    steady = [0.002] * 19 + [0.3]  # one step slowed down by another process
    need = time_to_finish(steady, warmup=0, eval_steps=10, eval_s=None, snapshot_s=0.05, budget=60)
    assert need >= 0.3 + 10 * 0.002 / 3 + 0.05 + 1.2 - 1e-12  # the spike, the evaluation, the snapshot, 2%
    # a warm-up step (allocation, first collectives) is not what the next one costs: once steady
    # steps exist, it is left out of every estimate
    first = time_to_finish([5.0] + [0.002] * 10, warmup=1, eval_steps=3000, eval_s=None, snapshot_s=0.0,
                           budget=60)
    assert first == pytest.approx(0.002 + 3000 * 0.002 / 3 + 1.2)
    # before a steady step exists, the first step (compiling, allocating, connecting: often 100x the next ones)
    # is still the one more step kept, but the evaluation is not extrapolated from it -- otherwise a compiled run
    # with a budget of an hour would stop after its first step, estimating 1000 evaluation batches at its cost
    assert time_to_finish([60.0], warmup=5, eval_steps=3000, eval_s=None, snapshot_s=0.0, budget=3600) == \
        pytest.approx(60.0 + 72)
    assert time_to_finish([60.0, 0.1, 0.3], warmup=5, eval_steps=3000, eval_s=None, snapshot_s=0.0, budget=3600) == \
        pytest.approx(60.0 + 0.2 * 1000 + 72)
    # measured evaluation and snapshot times are used as they are
    assert time_to_finish([0.01] * 5, warmup=0, eval_steps=10, eval_s=2.0, snapshot_s=3.0, budget=10) == \
        pytest.approx(0.01 + 2.0 + 3.0 + 0.2)


def test_a_second_ctrl_c_stops_the_launch_at_once_while_workers_are_still_stopping(tmp_path):
    """Workers that take long to stop (here: they ignore SIGINT) hold the first Ctrl-C's clean stop; a
    second Ctrl-C ends the job at once, the workers with it."""
    import signal
    import textwrap
    import time
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, signal
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a worker: Ctrl-C does nothing to it
            _set = signal.signal
            signal.signal = lambda sig, handler: _set(sig, signal.SIG_IGN if sig == signal.SIGINT else handler)
            _set(signal.SIGINT, signal.SIG_IGN)
    """))
    # (a sitecustomize runs when an interpreter starts: the workers as fresh interpreters, not forked warm)
    proc = _long_run_with_a_snapshot(tmp_path, "2", {"PYTHONPATH": str(site), "DISTLAB_WORKER_START": "exec"})
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the first waits for the workers' clean stop (which never comes here)
        proc.send_signal(signal.SIGINT)
        start = time.time()
        out, err = communicate_patiently(proc, 60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and time.time() - start < patience(30), (proc.returncode, err)
    assert "distlab: stopped at once (a second Ctrl-C)" in err and "Traceback" not in err, err
    assert snap.snapshots(tmp_path / "s")  # the earlier snapshots are intact


def _poll_over_a_side_group(rank, world):
    """As on an NCCL job (the default group's backend reported as nccl): the flag goes over a gloo group
    of Preemption's own, on the host; rank 1's signal stops both ranks at the same poll."""
    from unittest import mock
    import torch.distributed as dist
    from distlab.train.preemption import Preemption
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        stop = Preemption()
    assert stop.group is not None and dist.get_world_size(stop.group) == world
    answers = []
    with stop:
        for i in range(6):
            if rank == 1 and i == 2:
                stop.signalled = 1  # what SIGTERM's handler sets
            answers.append(stop.poll())
            if answers[-1]:
                break
    return answers


def test_the_preemption_flag_of_a_gpu_job_goes_over_a_host_group_and_stops_every_rank_together():
    from distlab.launch.spawn import run_ranks
    a, b = run_ranks(_poll_over_a_side_group, 2, timeout=60)
    assert a == b == [None, None, None, "preempted"]  # set before poll 3, read by every rank at poll 4


def _weights_broken_at_step_2(rank, world, tmp_path):
    from distlab.errors import NonFiniteError

    def poison(step):
        if step == 2:
            with torch.no_grad():
                next(trainer.engine.module.parameters()).view(-1)[0] = float("nan")
    cfg = _cfg(tmp_path / "s", max_steps=5, snapshot_every=1, val_fraction=0.0, lr_schedule="constant")
    trainer = Trainer(cfg.validate(world), runtime.from_process_group(), hooks=[poison])
    with pytest.raises(NonFiniteError) as stopped:
        trainer.fit()
    return str(stopped.value), [p.name for p in snap.snapshots(tmp_path / "s")]


def test_weights_that_are_not_finite_are_never_snapshotted_nor_called_the_last_good_state(tmp_path):
    """Step 2's update leaves a nan in the weights (here put there by hand): no snapshot of step 2 is
    written; step 3's gradients stop the run, naming step 1's snapshot as the last good state."""
    message, kept = run_ranks(_weights_broken_at_step_2, 1, tmp_path, timeout=120)[0]
    assert kept == ["step-00000001"], kept
    assert "the last good state is in" in message and message.count("step-00000001") == 1
    assert "no snapshot of step 2: its weights hold nan or inf" in message


def _signalled_again_while_it_snapshots(rank, world, tmp_path):
    """SIGTERM at step 2 (as a scheduler signals every process of a job), then again while the run writes the
    snapshot it stops with (torchrun's agent passing the first one on, or the scheduler repeating itself)."""
    import signal

    def term(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
    cfg = _cfg(tmp_path / "s", max_steps=6, snapshot_every=100, val_fraction=0.0, lr_schedule="constant")
    trainer = Trainer(cfg.validate(world), runtime.from_process_group(), hooks=[term])
    first_save = trainer.run.save

    def save_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return first_save(*args, **kwargs)
    trainer.run.save = save_signalled
    summary = trainer.fit()
    return summary["stopped"], summary["steps"], [p.name for p in snap.snapshots(tmp_path / "s")]


def test_a_sigterm_while_a_preempted_run_writes_its_snapshot_and_summary_changes_nothing(tmp_path):
    stopped, steps, kept = run_ranks(_signalled_again_while_it_snapshots, 2, tmp_path, timeout=120)[0]
    assert stopped == "preempted" and 2 < steps < 6
    assert kept == [f"step-{steps:08d}"]


def test_a_rank_file_is_checked_and_loaded_without_reading_it_whole_into_memory(tmp_path):
    """Resuming a state that fills the machine must not need the file's bytes beside it: the checksum is taken a
    piece at a time and torch.load reads the same open file (Python's allocations stay far below the 64 MiB)."""
    import tracemalloc
    payload = _payload(3)
    payload["model"]["big"] = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    snap.save(tmp_path, 3, payload, LAYOUT, 5)
    tracemalloc.start()
    try:
        loaded = snap_load.resume("auto", str(tmp_path), LAYOUT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB allocated while reading"
    assert torch.equal(loaded.payload["model"]["big"], payload["model"]["big"])
