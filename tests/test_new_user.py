"""What a new user reads and trips on in a first run: the run's length, its header (optimizer, data,
evaluation), its console lines and summary (a smoothed loss said so, clipping counted, one thread said
as one), a text model's run that keeps its model without snapshots, and settings in the wrong place."""

from __future__ import annotations

import json

import pytest

MLP = ["train", "--dataset", "synthetic:1x8x8:4:640", "--mlp-widths", "16", "--global-batch-size", "64",
       "--no-progress"]


def test_max_steps_alone_sets_the_length_and_a_cap_by_epochs_is_said(run_cli, tmp_path):
    proc = run_cli(*MLP, "--max-steps", "25", "--out", "long", check=True)  # 10 steps an epoch
    summary = json.loads((tmp_path / "long" / "summary.json").read_text())
    assert summary["steps"] == 25 and summary["epochs"] == 2.5 and "25 steps, 10 per epoch" in proc.stdout
    proc = run_cli(*MLP, "--max-steps", "25", "--epochs", "2", "--out", "capped", check=True)
    assert json.loads((tmp_path / "capped" / "summary.json").read_text())["steps"] == 20
    assert "warning  --max-steps 25 is past --epochs 2's 20 steps: the run stops at 20" in proc.stdout


def test_the_header_console_and_summary_say_what_trains_and_how(run_cli, tmp_path):
    proc = run_cli(*MLP, "--max-steps", "4", "--log-every", "2", "--label-smoothing", "0.1", "--clip-grad-norm",
                   "0.01", "--weight-decay", "0.01", "--threads", "1", "--out", "run", check=True)
    out = proc.stdout
    assert ("optim    sgd (momentum 0.9), lr 0.05, cosine to 0 over 4 steps, weight decay 0.01, gradients clipped to "
            "a global norm of 0.01, labels smoothed by 0.1") in out
    assert "strategy single process (1 thread, cpu)" in out and "1 x 1 thread, gloo" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(" | grad norm " in line for line in steps)
    # the last step's line, then its evaluation
    assert out.index("step      4/4") < out.index("eval step 4 (epoch 0)")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["clipped_steps"] == 4 and "clipped 4 of 4 steps to a global norm of 0.01" in out
    assert "labels smoothed by 0.1" in summary["train_loss_basis"]
    assert "(labels smoothed by 0.1: not comparable with the test loss)" in out
    assert "each evaluation scores all 160 test samples" in out


def test_a_users_model_is_named_as_what_its_builder_returns(run_cli, tmp_path):
    (tmp_path / "net.py").write_text("from torch import nn\n\ndef build(input_shape, num_classes, width=8):\n"
                                     "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    own = [a for a in MLP if a not in ("--mlp-widths", "16")]
    proc = run_cli(*own, "--model", "net.py:build", "--model-arg", "width=4", "--max-steps", "1", "--out", "run",
                   check=True)
    assert "(your model: a Sequential that net.py's build(width=4) returns)" in proc.stdout
    # a family's option given to your own model would do nothing: refused, naming what to give instead
    proc = run_cli(*own, "--model", "net.py:build", "--mlp-widths", "16", "--max-steps", "1", "--out", "no")
    assert proc.returncode == 2 and "--mlp-widths is an option of model mlp, mlp-bn" in proc.stderr \
        and "--model-arg key=value" in proc.stderr, proc.stderr


def test_an_article_is_said_as_the_word_is():
    from distlab.errors import with_article
    assert [with_article(w) for w in ("mlp", "gpt", "Sequential", "Embedding", "ndarray", "list")] == \
        ["an mlp", "a gpt", "a Sequential", "an Embedding", "an ndarray", "a list"]


def test_a_language_models_run_without_snapshots_keeps_its_model_for_generate_and_export(run_cli, tmp_path):
    run_cli("train", "--model", "gpt", "--dataset", "synthetic-text:3000", "--n-layer", "1", "--n-head", "2",
            "--n-embd", "16", "--block-size", "16", "--global-batch-size", "8", "--max-steps", "2", "--no-progress",
            "--out", "lm", check=True)
    assert json.loads((tmp_path / "lm" / "summary.json").read_text())["model_file"].endswith("lm/model.safetensors")
    text = run_cli("generate", "lm", "--prompt", "ab", "--max-new-tokens", "8", "--temperature", "0", check=True)
    assert text.stdout.startswith("ab")
    run_cli("export", "lm", "-o", "m.pt", check=True)
    from distlab.tools.generate import generate, load_gpt
    exported, _, _ = load_gpt(tmp_path / "m.pt", n_head=2)
    assert generate(exported, "ab", 8, 0.0, None, 0) + "\n" == text.stdout  # the same model either way
    # a classifier's run without snapshots: one line saying how to keep a model
    run_cli(*MLP, "--max-steps", "1", "--out", "mlp", check=True)
    for command in (["export", "mlp", "-o", "x.pt"], ["generate", "mlp"]):
        proc = run_cli(*command)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert "kept no model: it wrote no snapshot" in proc.stderr and "--snapshot-dir" in proc.stderr


@pytest.mark.parametrize("key", ["threads", "nproc_per_node", "master_port"])
def test_launch_settings_in_a_config_file_are_sent_to_the_command_line(refused_here, tmp_path, key):
    (tmp_path / "c.toml").write_text(f"{key} = 1\n")
    proc = refused_here("train", "--config", str(tmp_path / "c.toml"))
    flag = "--" + key.replace("_", "-")
    assert f"{key} is a launch setting" in proc.stderr and f"pass {flag} on the command line" in proc.stderr
    assert "did you mean" not in proc.stderr


def test_a_directory_of_one_text_file_says_its_files_are_documents(refused_here, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "all.txt").write_text("\n\n".join(f"paragraph {i} of some text" for i in range(30)))
    proc = refused_here("prepare-text", str(tmp_path / "src"), str(tmp_path / "out"))
    assert "is a directory: each file in it is one document, its paragraphs not split" in proc.stderr
    assert "give a file itself to have it cut into documents at blank lines" in proc.stderr
    proc = refused_here("train", "--model", "gpt", "--dataset", f"text:{tmp_path / 'src'}")
    assert "in a directory each file is one document" in proc.stderr
