"""``distlab train --config FILE.toml``: every run writes the settings it trained with as
``OUT/config.toml`` (and in summary.json); a rerun from that file reproduces the run bitwise, flags
given beside it override it, and a bad file is one line naming the file and the key."""

import json

import pytest

from distlab.errors import ConfigError
from distlab.train import TrainConfig
from distlab.train.config_file import config_file_text, read_config_file


def test_a_run_rerun_from_its_config_file_ends_bitwise_where_it_ended_and_flags_override_it(run_cli, tmp_path):
    flags = ["--dataset", "synthetic:1x8x8:4:256", "--mlp-widths", "16,8", "--max-steps", "6",
             "--global-batch-size", "16", "--lr", "0.07", "--grad-accum", "2", "--lr-schedule", "cosine"]
    run_cli("train", *flags, "--out", str(tmp_path / "a"), "--no-progress", check=True)
    first = json.loads((tmp_path / "a" / "summary.json").read_text())
    written = (tmp_path / "a" / "config.toml").read_text()
    assert first["config_toml"] == written and "out =" not in written  # where outputs go is not a setting
    run_cli("train", "--config", str(tmp_path / "a" / "config.toml"), "--out", str(tmp_path / "b"), check=True)
    again = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert again["final_train_loss"] == first["final_train_loss"] and again["test_loss"] == first["test_loss"]
    assert {**again["config"], "out": None} == {**first["config"], "out": None}
    run_cli("train", "--config", str(tmp_path / "a" / "config.toml"), "--max-steps", "2", "--out",
            str(tmp_path / "c"), check=True)
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["steps"] == 2  # the flag wins


@pytest.mark.parametrize("text,message", [
    ("lr = \n", "is not TOML"),
    ("speed = 3\n", "unknown setting 'speed'"),
    ('lr = "fast"\n', "lr = 'fast' is not a float"),
    ('mlp_widths = [1, "a"]\n', "is not a tuple"),
    ("zero = true\n", "zero = True is not a int"),
    ("[strategy]\nzero = 1\n", "unknown setting 'strategy'"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        read_config_file(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="No such file"):
        read_config_file(str(tmp_path / "missing.toml"))


def test_the_file_holds_every_setting_of_what_is_trained_and_reads_back_to_the_same_config(tmp_path):
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(8, 4), dataset="synthetic:1x8x8:4:64", zero=2, tp=1,
                                 max_steps=5, time_budget_s=90.0, out=str(tmp_path / "x"), snapshot_dir="s")
    path = tmp_path / "c.toml"
    path.write_text(config_file_text(cfg))
    back = TrainConfig.from_flags(**read_config_file(str(path)))
    assert {**back.to_dict(), "out": None, "snapshot_dir": None} == {**cfg.to_dict(), "out": None, "snapshot_dir": None}


# --------------------------------------------------------------------------- a settings file runs no code

def _marker_model(tmp_path):
    """A model file that leaves a mark when it is run (imported), and a marker path."""
    mark = tmp_path / "ran"
    path = tmp_path / "netfile.py"
    path.write_text(f"import pathlib\npathlib.Path({str(mark)!r}).write_text('imported')\n"
                    "from torch import nn\n\ndef build(input_shape, num_classes):\n"
                    "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    return path, mark


def test_a_config_file_naming_a_callable_runs_nothing_and_says_how_to_allow_it(refused_here, run_cli, tmp_path):
    touched = tmp_path / "touched"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'model = "os:system"\nmodel_args = ["command=\\"touch {touched}\\""]\n'
                   'dataset = "synthetic:1x8x8:4:64"\nmax_steps = 1\n')
    r = refused_here("train", "--config", str(cfg), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and not touched.exists(), (r.stdout, r.stderr)
    assert "distlab: error:" in r.stderr and "--trust-config" in r.stderr and "--model os:system" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was made
    # Even when allowed, a standard-library function is not a model builder: refused before it is called.
    r = refused_here("train", "--config", str(cfg), "--trust-config", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and not touched.exists() and "not a model builder" in r.stderr, r.stderr
    r = refused_here("train", "--model", "os:system", "--model-arg", f'command="touch {touched}"', "--dataset",
                "synthetic:1x8x8:4:64", "--max-steps", "1", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and not touched.exists() and "not a model builder" in r.stderr, r.stderr


def test_a_config_files_own_model_runs_only_when_the_command_line_names_it_or_trusts_the_file(refused_here, run_cli, tmp_path):
    model, mark = _marker_model(tmp_path)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'model = "{model}:build"\ndataset = "synthetic:1x8x8:4:64"\nmax_steps = 1\n'
                   'global_batch_size = 8\n')
    r = refused_here("train", "--config", str(cfg), "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and not mark.exists(), (r.stdout, r.stderr)
    assert f"--model {model}:build" in r.stderr and "--trust-config" in r.stderr
    run_cli("train", "--config", str(cfg), "--model", f"{model}:build", "--out", str(tmp_path / "c"), check=True)
    assert mark.exists()
    mark.unlink()
    run_cli("train", "--config", str(cfg), "--trust-config", "--out", str(tmp_path / "d"), check=True)
    assert mark.exists()


def test_plan_reads_a_run_naming_its_own_model_without_running_that_model(run_cli, tmp_path):
    """A summary.json is data: ``plan validate`` / ``calibrate`` skip a run whose model is the user's code."""
    model, mark = _marker_model(tmp_path)
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "model": f"{model}:build", "world_size": 2, "dataset": "synthetic:1x8x8:4:64", "input_shape": [1, 8, 8],
        "num_classes": 4, "global_batch_size": 8, "local_batch_size": 4, "time_per_step_s_median": 0.01,
        "strategy": {"dp_sync": "bucketed"}}))
    from pathlib import Path

    from distlab.plan import calibrate, validate
    cal = calibrate([str(Path(__file__).resolve().parents[1] / "results" / "plan" / "bench-collectives")])
    with pytest.raises(ConfigError, match="no runs with 2"):  # the one run is skipped, its model not built
        validate(cal, [str(tmp_path / "runs")])
    assert not mark.exists()
    from distlab.plan.calibration import plannable
    assert not plannable({"model": f"{model}:build"}) and plannable({"model": "mlp"})


@pytest.mark.parametrize("content,message", [
    (b"\x00\xff\xfe binary \x89PNG\r\n", "is not TOML"),
    (b"x = " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deeply|is not TOML"),
    (b"learning_rate = 0.1\n", r"unknown setting 'learning_rate' \(did you mean lr\?\)"),
    (b"global_batch_sise = 8\n", r"did you mean global_batch_size\?"),
    (b'out = "elsewhere"\n', "only the command line says \\(--out\\)"),
    (b'snapshot_dir = "s"\n', "--snapshot-dir"),
])
def test_a_strange_config_file_is_one_line_naming_the_key_and_the_fix(tmp_path, content, message):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        read_config_file(str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_config_file_takes_the_flags_own_spellings_and_every_setting_it_takes_is_validated(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('model_arg = ["width=3"]\ntime_budget = "1h30m"\nbatch-size = 32\ntiming_warmup_steps = 2\n')
    assert read_config_file(str(path)) == {"model_args": ("width=3",), "time_budget_s": 5400.0,
                                                "global_batch_size": 32, "timing_warmup_steps": 2}
    path.write_text("timing_warmup_steps = -7\n")
    with pytest.raises(ConfigError, match="`timing_warmup_steps` must be at least 0, not -7"):
        TrainConfig.from_flags(**read_config_file(str(path)), dataset="synthetic:1x8x8:4:64").validate(1)


def test_a_misspelt_model_or_data_set_says_what_was_meant():
    with pytest.raises(ConfigError, match=r"unknown model 'resnet'.*did you mean resnet18\?"):
        TrainConfig.from_flags(model="resnet", dataset="synthetic:1x8x8:4:64").validate(1)
    with pytest.raises(ConfigError, match=r"unknown dataset 'fashon-mnist' \(did you mean fashion-mnist\?\)"):
        TrainConfig.from_flags(dataset="fashon-mnist").validate(1)
