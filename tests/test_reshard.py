"""Resuming a snapshot under another layout: world size, ZeRO stage, tensor or pipeline parallel.

Each case trains under layout A with a snapshot at step 7 (mid-epoch) and goes on to step 13;
layout B resumes that snapshot. Right after loading, B's gathered parameters and optimizer state
must *equal* A's at step 7 (resharding copies tensors, it computes nothing). B then trains on to
step 13 on the same samples; with SGD its parameters must agree with A's within distlab.tools.verify's
float32 bound for the 13 steps (the layouts sum gradients in different orders; 3.7e-5 here), far
below what a skipped or repeated batch does (~1e-3 and more, checked below). Adam has no such
bound (it divides each entry by its own size, so rounding noise can move an entry by up to lr):
its cases check the resharded state exactly and that training goes on from it.
"""

import pytest
import torch
import torch.distributed as dist

from distlab import runtime
from distlab.errors import ConfigError
from distlab.models import build_model
from distlab.parallel.placement import Placement, assemble, placement_of, take
from distlab.launch.spawn import RankFailure, run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.train import reshard
from distlab.train.export import export
from distlab.train import snapshot as snap
from distlab.train.optim import optimizer_index
from distlab.tools.verify import tolerance

AT, END = 7, 13


def _cfg(snapshots, **kw):
    settings = dict(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:192", epochs=3, max_steps=END,
                    global_batch_size=24, lr=0.05, lr_schedule="constant", optimizer="sgd", seed=5, log_every=50,
                    progress=False, verbose=False, val_fraction=0.25, snapshot_dir=str(snapshots))
    return TrainConfig.from_flags(**{**settings, **kw})


def _whole(trainer):
    """The whole model and optimizer state of a run, put together from every rank's pieces (collective)."""
    mine = {"placement": {**placement_of(trainer.engine),  # (the optimizer's numbering: Muon's groups reorder)
                          "optimizer_index": optimizer_index(trainer.optimizer, trainer.engine.parameters())},
            "model": trainer.engine.sharded_state_dict(),
            "optimizer": trainer.optimizer.state_dict()}
    everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    elementwise, scalars, _ = reshard.full_optimizer(everyone)
    return reshard.full_model(everyone), elementwise, scalars


def _train_a(rank, world, cfg):
    captured = {}

    def capture(step):
        if step == AT:
            captured["state"] = _whole(trainer)
            captured["params"] = trainer.full_parameters()

    trainer = Trainer(cfg.validate(world), runtime.from_process_group(), hooks=[capture])
    trainer.fit()
    return captured["state"], captured["params"], trainer.full_parameters()


def _resume_b(rank, world, loaded_cfg, continued_cfg):
    loaded = Trainer(loaded_cfg.validate(world), runtime.from_process_group())
    summary = loaded.fit()  # resumes at step 7 of 7: loads, trains nothing
    state, params = _whole(loaded), loaded.full_parameters()
    continued = Trainer(continued_cfg.validate(world), runtime.from_process_group())
    out = continued.fit()
    return state, params, continued.full_parameters(), summary, out


def _equal_states(a, b):
    (model_a, opt_a, scalars_a), (model_b, opt_b, scalars_b) = a, b
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    assert opt_a.keys() == opt_b.keys() and opt_a
    for k in opt_a:
        assert opt_a[k].keys() == opt_b[k].keys()
        for name in opt_a[k]:
            assert torch.equal(opt_a[k][name], opt_b[k][name]), (k, name)
    assert scalars_a.keys() == scalars_b.keys()
    for name in scalars_a:
        for k, v in scalars_a[name].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(scalars_b[name][k])), (name, k)


ADAM = {"optimizer": "adam", "lr": 0.01}
MUON = {"optimizer": "muon", "lr": 0.01}
CASES = {
    "dp 2 -> 3": (2, {}, 3, {}),
    "dp 4 -> zero2 2": (4, {}, 2, {"zero": 2}),
    "zero3 -> zero1": (2, {"zero": 3, **ADAM}, 2, {"zero": 1, **ADAM}),
    "zero1 2 -> zero3 3": (2, {"zero": 1, **ADAM}, 3, {"zero": 3, **ADAM}),
    "plain zero3 2 -> zero2 3": (2, {"zero": 3, "zero_impl": "plain", **ADAM}, 3, {"zero": 2, **ADAM}),
    "zero1 3 -> plain zero2 2": (3, {"zero": 1, **ADAM}, 2, {"zero": 2, "zero_impl": "plain", **ADAM}),
    "hybrid zero3 4 -> zero2 2": (4, {"zero": 3, "dp_shard": 2, **ADAM}, 2, {"zero": 2, **ADAM}),
    "zero1 2 -> hybrid zero2 4": (2, {"zero": 1, **ADAM}, 4, {"zero": 2, "dp_shard": 2, **ADAM}),
    "muon zero3 2 -> tp2": (2, {"zero": 3, **MUON}, 2, {"tp": 2, **MUON}),
    "tp2 -> 1 process": (2, {"tp": 2}, 1, {}),
    "pp2 -> tp2": (2, {"pp": 2, "microbatches": 2, **ADAM}, 2, {"tp": 2, **ADAM}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_snapshot_resumes_under_another_layout_exactly(tmp_path, case):
    world_a, extra_a, world_b, extra_b = CASES[case]
    cfg_a = _cfg(tmp_path / "a", snapshot_every=AT, keep_snapshots=5, **extra_a)
    results_a = run_ranks(_train_a, world_a, cfg_a, timeout=180)
    state_a, params_a, final_a = results_a[0]
    at = str(tmp_path / "a" / snap.step_dir_name(AT))
    loaded_cfg = _cfg(tmp_path / "b1", resume=at, max_steps=AT, **extra_b)
    continued_cfg = _cfg(tmp_path / "b2", resume=at, **extra_b)
    results_b = run_ranks(_resume_b, world_b, loaded_cfg, continued_cfg, timeout=180)
    for state_b, params_b, final_b, summary, out in results_b:
        _equal_states(state_a, state_b)
        assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
        assert summary["steps"] == AT and out["steps"] == END
        diff = max((x - y).abs().max().item() for x, y in zip(final_a, final_b))
        bound = tolerance(cfg_a.validate(world_a))
        if bound is not None:  # SGD
            assert diff <= bound, (diff, bound)
        else:  # Adam: no bound; the exact state checks above are the proof, and training went on from it
            assert all(torch.isfinite(t).all() for t in final_b)
        moved = max((x - y).abs().max().item() for x, y in zip(params_a, final_a))
        assert moved > 1e-3  # the six steps after the snapshot change the model far beyond the tolerance
        layouts = out["layouts"]
        assert [(l["world_size"], l["step"]) for l in layouts] == [(world_a, 0), (world_b, AT)]


def test_a_global_batch_that_does_not_divide_the_new_world_is_refused_naming_the_sizes_that_do():
    with pytest.raises(ConfigError, match=r"not divisible by world size 5: .* keep 24 \(a resumed snapshot keeps its "
                                          r"global batch\) on a world size that divides it: 1, 2, 3, 4, 6, 8, 12, 24"):
        _cfg("unused", resume="auto").validate(5)


def test_placements_cut_and_put_back_every_layout():
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for dim, parts in [(None, 1), (0, 2), (1, 3), (1, 2)]:
        for ranks in (1, 3, 5):  # ZeRO over 1, 3 or 5 ranks of each tensor-parallel piece
            pieces = []
            for part in range(parts):
                n = take(full, Placement("w", (4, 6), dim, parts, part)).numel()
                shard = -(-n // ranks)
                for r in range(ranks):
                    length = max(0, min(n, (r + 1) * shard) - r * shard)
                    p = Placement("w", (4, 6), dim, parts, part, r * shard, length)
                    t = take(full, p, shard)
                    assert t.numel() == shard and torch.equal(t[length:], torch.zeros(shard - length))
                    pieces += [(p, t), (p, t)]  # a data-parallel replica is read once
            assert torch.equal(assemble(pieces)["w"], full), (dim, parts, ranks)
    with pytest.raises(ValueError, match="cover 12 of its 24"):
        assemble([(Placement("w", (4, 6), 0, 2, 0), full[:2])])


def test_a_snapshot_missing_a_rank_file_entry_cannot_be_resharded(tmp_path):
    payload = {"placement": {"keys": ["w"], "params": [Placement("w", (4,), 0, 2, 0).to_dict()], "buffers": {}},
               "model": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": [{"params": [0]}]}}
    with pytest.raises(reshard.ReshardError, match="cover 2 of its 4"):
        reshard.full_model([payload])


# --------------------------------------------------------------------------- export and --init-from


def _train_and_gather(rank, world, cfg):
    trainer = Trainer(cfg.validate(world), runtime.from_process_group())
    trainer.fit()
    return trainer.engine.full_state_dict()


def _init_from(rank, world, cfg):
    return Trainer(cfg.validate(world), runtime.from_process_group()).full_parameters()


@pytest.mark.parametrize("extra", [{"pp": 2, "microbatches": 2}, {"zero": 3, "tp": 2}])
def test_export_writes_the_whole_model_and_init_from_starts_from_it(tmp_path, extra):
    world = 2 if "pp" in extra else 4
    cfg = _cfg(tmp_path / "a", max_steps=6, snapshot_every=3, **extra)
    whole = run_ranks(_train_and_gather, world, cfg, timeout=180)[0]
    info = export(tmp_path / "a" / snap.step_dir_name(6), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)  # plain torch, no distlab object inside
    assert state.keys() == whole.keys() and all(torch.equal(state[k], whole[k]) for k in whole)
    assert info["step"] == 6 and info["build"] == "distlab.models.build_model('mlp', (1, 8, 8), 4, widths=(32, 16))"
    plain = build_model("mlp", (1, 8, 8), 4, widths=(32, 16))
    plain.load_state_dict(state)  # strict: the single-process model's keys and shapes
    started = run_ranks(_init_from, 2, _cfg(tmp_path / "b", init_from=str(tmp_path / "model.pt"), zero=2), timeout=120)
    for params in started:
        assert all(torch.equal(p, q) for p, q in zip(params, plain.parameters()))
    export(tmp_path / "a" / snap.step_dir_name(6), tmp_path / "model.safetensors")  # the ecosystem's format
    from safetensors.torch import load_file
    safe = load_file(tmp_path / "model.safetensors")
    assert safe.keys() == whole.keys() and all(torch.equal(safe[k], whole[k]) for k in whole)
    started = run_ranks(_init_from, 2, _cfg(tmp_path / "s", init_from=str(tmp_path / "model.safetensors")),
                        timeout=120)
    assert all(torch.equal(p, q) for p, q in zip(started[0], plain.parameters()))
    other = _cfg(tmp_path / "c", init_from=str(tmp_path / "model.pt"), mlp_widths=(32, 8))
    with pytest.raises(RankFailure, match=r"`init_from` .*model.pt is for another model: net.3.weight has shape "
                                          r"\(16, 32\), this model's \(8, 32\)"):
        run_ranks(_init_from, 1, other, timeout=60)


def test_export_and_init_from_refuse_bad_input_in_one_line(refused_here, run_cli, tmp_path):
    proc = refused_here("export", "nowhere", "-o", "m.pt")
    assert proc.returncode == 2 and "error: nowhere: no run directory, snapshot or model file there" in proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "m.pt").exists()
    torch.save({"not": "tensors", "code": print}, tmp_path / "evil.pt")  # weights_only refuses the function
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--init-from", "evil.pt", "--no-progress")
    assert proc.returncode == 2 and "`init_from`" not in proc.stderr
    assert "--init-from evil.pt cannot be loaded safely" in proc.stderr, proc.stderr
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors at all")
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--init-from", "junk.safetensors")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--init-from junk.safetensors cannot be loaded safely as a state_dict" in proc.stderr
    (tmp_path / "empty.pt").write_bytes(b"")
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--init-from", "empty.pt", "--no-progress")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--init-from empty.pt cannot be loaded safely as a state_dict" in proc.stderr
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:64", "--init-from", "missing.pt")
    assert proc.returncode == 2 and "--init-from missing.pt: no such file" in proc.stderr
