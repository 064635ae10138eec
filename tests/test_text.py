"""Text: the fortunes corpus and its split rule, windows of tokens, synthetic text, the GPT model,
and training it through the real CLI (one process and data parallel, equal to one process)."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from distlab.data import load_dataset, locate
from distlab.data.text import (FORTUNES_SYSTEM_DIR, TextDataset, conditional_entropy_of_synthetic, fortune_files,
                               read_fortunes)
from distlab.errors import ConfigError, DataNotFoundError
from distlab.models import GPT, task_correct, task_loss
from distlab.train.config import TrainConfig


def _corpus(root: Path, files: dict[str, list[str]]) -> Path:
    """Fortune files as the package lays them out: text with '%' lines, a .dat index beside each."""
    d = root / "fortunes"
    d.mkdir(parents=True)
    for name, fortunes in files.items():
        (d / name).write_text("\n%\n".join(fortunes) + "\n%\n")
        (d / f"{name}.dat").write_bytes(b"\0" * 24)
    (d / "stray.txt.u8").write_text("not a fortune file")  # the package's symlinks: skipped
    return d


def test_every_tenth_fortune_is_validation_across_files_in_name_order(tmp_path):
    d = _corpus(tmp_path, {"b-topic": [f"b{i}" for i in range(8)], "a-topic": [f"a{i}\nline two" for i in range(7)]})
    assert [p.name for p in fortune_files(d)] == ["a-topic", "b-topic"]
    train, test = bytes(read_fortunes(d, "train")), bytes(read_fortunes(d, "test"))
    # order: a0..a6 (numbers 0-6), then b0..b7 (7-14): validation is numbers 9 (b2) and ... none at 19
    assert test == b"b2\n%\n"
    assert train.split(b"\n%\n")[:-1] == [f"a{i}\nline two".encode() for i in range(7)] + \
        [f"b{i}".encode() for i in (0, 1, 3, 4, 5, 6, 7)]


def test_windows_predict_each_token_once_and_targets_are_shifted_by_one():
    tokens = torch.arange(25, dtype=torch.uint8)
    data = TextDataset.from_tokens("t", "train", tokens, block_size=8, source="")
    assert len(data) == 3 and data.input_shape == (8,)
    x, y = data.batch(torch.arange(3))
    assert torch.equal(y, x + 1) and x.dtype == torch.long
    # dense batches: torch's pipelining refuses a strided view of the window (stride (9, 1) for (8, 1))
    assert x.is_contiguous() and y.is_contiguous() and x.stride() == (8, 1)
    assert sorted(y.flatten().tolist()) == list(range(1, 25))  # every token but the first, exactly once
    with pytest.raises(ConfigError, match="too few for one window"):
        TextDataset.from_tokens("t", "test", tokens[:5], block_size=8, source="")
    part = data.subset(torch.tensor([2]), "val")
    assert torch.equal(part.batch(torch.tensor([0]))[0], x[2:3])


def test_synthetic_text_is_seeded_and_learnable_below_its_unigram_entropy():
    a = load_dataset("synthetic-text:5000", "train", seed=0, block_size=16)
    b = load_dataset("synthetic-text:5000", "train", seed=0, block_size=16)
    assert torch.equal(a.tokens, b.tokens) and len(a.tokens) == 5000
    assert not torch.equal(a.tokens[:500], load_dataset("synthetic-text:5000", "train", seed=1).tokens[:500])
    assert a.unigram_entropy > 5.0 > 1.5 > conditional_entropy_of_synthetic()
    with pytest.raises(ConfigError, match="synthetic-text:TOKENS"):
        load_dataset("synthetic-text:many", "train")


@pytest.mark.skipif(not Path(FORTUNES_SYSTEM_DIR).is_dir(), reason="Debian's fortunes package is not installed")
def test_the_installed_corpus_is_found_and_split():
    assert locate("fortunes") == Path(FORTUNES_SYSTEM_DIR)
    train, test = load_dataset("fortunes", "train"), load_dataset("fortunes", "test")
    assert 0.08 < len(test.tokens) / (len(train.tokens) + len(test.tokens)) < 0.12
    assert 3.0 < train.unigram_entropy < 3.6  # English bytes


def test_a_missing_corpus_names_the_package_and_the_synthetic_stand_in(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        locate("fortunes", tmp_path)
    assert "apt-get install fortunes" in str(err.value) and "--dataset synthetic-text:" in str(err.value)
    d = _corpus(tmp_path / "mine", {"x": ["one", "two"]})
    assert locate("fortunes", d.parent) == d


def test_gpt_is_causal_and_scores_per_token():
    torch.manual_seed(0)
    model = GPT(vocab=256, block_size=16, n_layer=2, n_head=4, n_embd=32).eval()
    x = torch.randint(0, 256, (2, 16))
    out = model(x)
    assert out.shape == (2, 16, 256)
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    again = model(changed)
    assert torch.equal(out[:, :10], again[:, :10]) and not torch.allclose(out[:, 10:], again[:, 10:])
    y = torch.randint(0, 256, (2, 16))
    assert math.isclose(task_loss(out, y).item(), math.log(256), rel_tol=0.05)  # small init: near uniform
    assert task_correct(out, y)[1] == 32
    with pytest.raises(ValueError, match="longer than the model's block size"):
        model(torch.zeros((1, 17), dtype=torch.long))


def test_models_and_datasets_must_agree_on_the_kind_of_data():
    with pytest.raises(ConfigError, match="use --model gpt"):
        TrainConfig.from_flags(model="mlp", dataset="synthetic-text").validate(1)
    with pytest.raises(ConfigError, match="a text dataset"):
        TrainConfig.from_flags(model="gpt", dataset="fashion-mnist").validate(1)
    with pytest.raises(ConfigError, match="divisible by `n_head` 3"):
        TrainConfig.from_flags(model="gpt", dataset="synthetic-text", n_head=3, n_embd=128).validate(1)


def test_gpt_learns_from_context_through_the_cli(run_cli, tmp_path):
    """A few hundred steps take the loss well below the unigram entropy (the best a model that
    ignores context can do); the summary says nats per token and perplexity."""
    proc = run_cli("train", "--model", "gpt", "--dataset", "synthetic-text:40000", "--n-embd", "32", "--n-head", "2",
                   "--block-size", "16", "--optimizer", "adamw", "--lr", "0.01", "--max-steps", "150",
                   "--global-batch-size", "32", "--no-progress", "--out", "run", timeout=300, check=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["loss_unit"] == "nats/token" and summary["unigram_entropy"] > 5.0
    assert summary["test_loss"] < 0.6 * summary["unigram_entropy"]
    assert math.isclose(summary["test_perplexity"], math.exp(summary["test_loss"]))
    assert "unigram entropy" in proc.stdout and "nats/token" in proc.stdout


def test_gpt_data_and_tensor_parallel_equal_one_process():
    """On 4 ranks: data parallel, ZeRO-1, and a 2 x 2 mesh with attention split by heads and the
    vocabulary split in embedding, head and loss -- also with sequence parallel -- each train the
    transformer as one process does (float32 rounding; verify's tolerance)."""
    from distlab.tools.verify import parse_strategy, verify
    cases = ["bucketed+gpt", "zero=1+gpt", "allreduce+tp=2+gpt", "allreduce+tp=2+sp+gpt"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=4, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r
    assert [r["strategy"] for r in records] == cases
    with pytest.raises(ConfigError, match="no float32 tolerance"):
        parse_strategy("bucketed+gpt+adam")


def test_fortunes_copy_is_used_from_a_named_data_dir(run_cli, tmp_path):
    if not Path(FORTUNES_SYSTEM_DIR).is_dir():
        pytest.skip("Debian's fortunes package is not installed")
    mine = tmp_path / "data" / "fortunes"
    mine.mkdir(parents=True)
    for name in ("science", "science.dat"):
        shutil.copy(Path(FORTUNES_SYSTEM_DIR) / name, mine / name)
    proc = run_cli("train", "--model", "gpt", "--dataset", "fortunes", "--data-dir", str(tmp_path / "data"),
                   "--n-embd", "16", "--n-head", "2", "--max-steps", "2", "--no-progress", "--out", "run", check=True)
    assert f"from {mine}" in proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["data_path"] == str(mine)
