"""``distlab prepare-text`` and ``--dataset tokens:DIR``: a corpus tokenized once into flat token files
with a manifest, memory-mapped (never read whole), drawn by the same seeded sampler: the same tokens
as ``text:PATH``, documents held out whole, a resume bitwise equal to a straight run."""

import json

import numpy as np
import pytest
import torch

from distlab.data import load_dataset
from distlab.data import tokens as token_files
from distlab.errors import ConfigError


def _corpus(root, docs: int = 12):
    """SRC/train and SRC/test, a file per document (some with CRLF and blank lines inside)."""
    for i in range(docs):
        split = "test" if i % 4 == 3 else "train"
        (root / split).mkdir(parents=True, exist_ok=True)
        text = f"\n\ndocument {i}: " + " ".join(f"word{(i * 7 + j) % 13}" for j in range(30)) + "\r\n\n  more\n\n\n"
        (root / split / f"d{i:02d}.txt").write_bytes(text.encode())
    (root / "train" / ".hidden").write_text("never read")


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_prepared_tokens_are_the_tokens_text_path_reads(tmp_path, tokenizer):
    _corpus(tmp_path / "src")
    manifest = token_files.prepare(tmp_path / "src", tmp_path / "out", tokenizer, progress=False)
    for split in ("train", "test"):
        text = load_dataset(f"text:{tmp_path / 'src'}", split, block_size=4, tokenizer=tokenizer)
        mapped = load_dataset(f"tokens:{tmp_path / 'out'}", split, block_size=4)
        assert mapped.tokens.dtype == torch.uint16 and torch.equal(text.tokens.long(), mapped.tokens.long())
        entry = manifest["splits"][split]
        data = (tmp_path / "out" / entry["file"]).read_bytes()
        import hashlib
        assert entry["tokens"] == len(text.tokens) and hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert mapped.tokens_per_byte == pytest.approx(text.tokens_per_byte)
    assert manifest["splits"]["test"]["documents"] == 3 and manifest["splits"]["train"]["documents"] == 9
    if tokenizer != "bytes":
        assert mapped.tokenizer.sha256 == text.tokenizer.sha256 == manifest["tokenizer_sha256"]
    train = load_dataset(f"tokens:{tmp_path / 'out'}", "train", block_size=4)
    counts = np.bincount(train.tokens.numpy(), minlength=train.num_classes)
    p = counts[counts > 0] / counts.sum()
    assert train.unigram_entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    with open(tmp_path / "out" / "train.bin", "r+b") as f:  # mapped, not read: the file's bytes are the tensor's
        f.write(np.array([257], dtype="<u2").tobytes())
    assert int(train.tokens[0]) == 257


def test_every_tenth_document_is_held_out_whole(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text("".join(f"paragraph {i} line one\nparagraph {i} line two\n\n" for i in range(25)))
    token_files.prepare(src, tmp_path / "out", progress=False)
    test = bytes(load_dataset(f"tokens:{tmp_path / 'out'}", "test", block_size=2).tokens.tolist())
    train = bytes(load_dataset(f"tokens:{tmp_path / 'out'}", "train", block_size=2).tokens.tolist())
    assert test == b"".join(f"paragraph {i} line one\nparagraph {i} line two\n".encode() + b"\n" for i in (9, 19))[:-1]
    assert b"paragraph 9 " not in train and train.count(b"line one") == 23


def test_wide_vocabularies_take_four_bytes_a_token():
    assert token_files.dtype_for(65536) == np.uint16 and token_files.dtype_for(65537) == np.uint32


def test_a_damaged_or_missing_corpus_is_refused_before_any_work(tmp_path, refused_here):
    _corpus(tmp_path / "src")
    token_files.prepare(tmp_path / "src", tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="already holds a prepared corpus"):
        token_files.prepare(tmp_path / "src", tmp_path / "out", progress=False)
    train = tmp_path / "out" / "train.bin"
    train.write_bytes(train.read_bytes()[:-2])  # one token short
    base = ["train", "--model", "gpt", "--block-size", "4", "--max-steps", "1"]
    proc = refused_here(*base, "--dataset", f"tokens:{tmp_path / 'out'}")
    assert "holds" in proc.stderr and "prepare the corpus again" in proc.stderr and proc.stderr.count("\n") == 1
    (tmp_path / "out" / "manifest.json").unlink()
    proc = refused_here(*base, "--dataset", f"tokens:{tmp_path / 'out'}")
    assert "has no manifest.json" in proc.stderr
    proc = refused_here(*base, "--dataset", f"tokens:{tmp_path / 'nowhere'}")
    assert "there is no directory" in proc.stderr and "prepare-text" in proc.stderr
    proc = refused_here("prepare-text", str(tmp_path / "nowhere"), str(tmp_path / "o2"))
    assert "there is no file or directory" in proc.stderr
    (tmp_path / "bin.txt").write_bytes(b"text\0more")
    proc = refused_here("prepare-text", str(tmp_path / "bin.txt"), str(tmp_path / "o3"))
    assert "holds NUL bytes" in proc.stderr


def test_a_run_on_a_mapped_corpus_resumes_bitwise_on_two_ranks(run_cli, tmp_path):
    _corpus(tmp_path / "src", docs=40)
    run_cli("prepare-text", str(tmp_path / "src"), str(tmp_path / "tok"), "--tokenizer", "bpe:300", check=True)
    flags = ["train", "--nproc-per-node", "2", "--model", "gpt", "--dataset", f"tokens:{tmp_path / 'tok'}",
             "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8", "--global-batch-size", "8",
             "--lr-schedule", "constant", "--log-every", "1", "--no-progress"]
    proc = run_cli(*flags, "--max-steps", "6", "--out", "straight", "--snapshot-dir", "s1", check=True)
    # the header says where the corpus is (mapped from disk, not held) and the summary which memory is whose
    assert "memory-mapped from disk (" in proc.stdout and "in host memory (" not in proc.stdout
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert 0 < straight["peak_anon_rss_mb"] <= straight["peak_rss_mb"] and "RssAnon" in straight["memory_basis"]
    assert f"{straight['peak_anon_rss_mb']:.0f} MB anonymous" in proc.stdout
    run_cli(*flags, "--max-steps", "3", "--out", "half", "--snapshot-dir", "s2", check=True)
    run_cli(*flags, "--max-steps", "6", "--out", "half", "--snapshot-dir", "s2", "--resume", "auto", check=True)
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").open()] for d in ("straight", "half")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("straight", "half")]
    assert summaries[0]["test_loss"] == summaries[1]["test_loss"] and summaries[1]["resumed_from"]
    assert summaries[0]["tokenizer"] == "bpe:300" and (tmp_path / "straight" / "tokenizer.json").exists()


def test_a_mapped_corpus_moved_to_a_device_is_widened_to_int32_and_draws_the_same_windows(tmp_path):
    _corpus(tmp_path / "src")
    token_files.prepare(tmp_path / "src", tmp_path / "out", "bpe:300", progress=False)
    mapped = load_dataset(f"tokens:{tmp_path / 'out'}", "train", block_size=4)
    moved = mapped.to("cpu")  # what data_on_device does on a GPU (uint16 indexing is not there on every device)
    assert moved.tokens.dtype == torch.int32 and torch.equal(moved.tokens.long(), mapped.tokens.long())
    idx = torch.tensor([0, 3, len(mapped) - 1])
    assert all(torch.equal(a, b) for a, b in zip(moved.batch(idx), mapped.batch(idx)))


def test_a_mapped_corpus_is_evaluated_on_a_bounded_subset_by_default_and_the_header_says_so(run_cli, tmp_path):
    """A prepared corpus's test split may hold millions of windows: by default an evaluation scores 200
    global batches of them (nanoGPT's 200 batches), the same first ones every time; --eval-batches overrides."""
    for i in range(40):  # ~2 KB documents: the test split's 10 hold ~5,000 windows of 4 tokens
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"d{i:02d}.txt").write_text(" ".join(f"w{(i * 31 + j) % 97}" for j in range(500)))
    token_files.prepare(tmp_path / "src", tmp_path / "tok", "bytes", progress=False)
    flags = ["train", "--model", "gpt", "--dataset", f"tokens:{tmp_path / 'tok'}", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "8", "--block-size", "4", "--global-batch-size", "2", "--max-steps", "1", "--no-progress"]
    proc = run_cli(*flags, "--out", "run", check=True)
    test = load_dataset(f"tokens:{tmp_path / 'tok'}", "test", block_size=4)
    assert len(test) > 400
    assert f"each evaluation scores the first 400 of {len(test):,} test windows" in proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test_tokens"] == 400 * 4
    proc = run_cli(*flags, "--eval-batches", "3", "--eval-batch-size", "5", "--out", "three", check=True)
    assert "the first 15 of" in proc.stdout and "(--eval-batches 3)" in proc.stdout
    assert json.loads((tmp_path / "three" / "summary.json").read_text())["test_tokens"] == 15 * 4
