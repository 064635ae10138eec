"""``distlab train --config FILE.toml``: every run writes the settings it trained with as
``OUT/config.toml`` (and in summary.json); a rerun from that file reproduces the run bitwise, flags
given beside it override it, and a bad file is one line naming the file and the key."""

import json

import pytest

from distlab.errors import ConfigError
from distlab.train import TrainConfig


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
        TrainConfig.read_toml(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="No such file"):
        TrainConfig.read_toml(str(tmp_path / "missing.toml"))


def test_the_file_holds_every_setting_of_what_is_trained_and_reads_back_to_the_same_config(tmp_path):
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(8, 4), dataset="synthetic:1x8x8:4:64", zero=2, tp=1,
                                 max_steps=5, time_budget_s=90.0, out=str(tmp_path / "x"), snapshot_dir="s")
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    back = TrainConfig.from_flags(**TrainConfig.read_toml(str(path)))
    assert {**back.to_dict(), "out": None, "snapshot_dir": None} == {**cfg.to_dict(), "out": None, "snapshot_dir": None}
