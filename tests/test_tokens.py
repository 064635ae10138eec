"""``distlab prepare-text`` and ``--dataset tokens:DIR``: a corpus tokenized once into flat token files
with a manifest, memory-mapped (never read whole), drawn by the same seeded sampler: the same tokens
as ``text:PATH``, documents held out whole, a resume bitwise equal to a straight run."""

import json

import numpy as np
import pytest
import torch

from distlab.data import load_dataset
from distlab.data import prepare as preparing
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
    manifest = preparing.prepare(tmp_path / "src", tmp_path / "out", tokenizer, progress=False)
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
    preparing.prepare(src, tmp_path / "out", progress=False)
    test = bytes(load_dataset(f"tokens:{tmp_path / 'out'}", "test", block_size=2).tokens.tolist())
    train = bytes(load_dataset(f"tokens:{tmp_path / 'out'}", "train", block_size=2).tokens.tolist())
    assert test == b"".join(f"paragraph {i} line one\nparagraph {i} line two\n".encode() + b"\n" for i in (9, 19))[:-1]
    assert b"paragraph 9 " not in train and train.count(b"line one") == 23


def test_wide_vocabularies_take_four_bytes_a_token():
    assert preparing.dtype_for(65536) == np.uint16 and preparing.dtype_for(65537) == np.uint32


def test_a_damaged_or_missing_corpus_is_refused_before_any_work(tmp_path, refused_here):
    _corpus(tmp_path / "src")
    preparing.prepare(tmp_path / "src", tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="already holds a prepared corpus"):
        preparing.prepare(tmp_path / "src", tmp_path / "out", progress=False)
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
    preparing.prepare(tmp_path / "src", tmp_path / "out", "bpe:300", progress=False)
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
    preparing.prepare(tmp_path / "src", tmp_path / "tok", "bytes", progress=False)
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


def test_prepare_text_never_writes_over_files_it_did_not_make(refused_here, tmp_path):
    """A nanoGPT directory (train.bin and val.bin, no manifest) -- or any directory holding anything -- is
    refused as OUT, its files untouched."""
    _corpus(tmp_path / "src")
    nano = tmp_path / "nano"
    nano.mkdir()
    for name in ("train.bin", "val.bin", "meta.pkl"):
        (nano / name).write_bytes(b"theirs")
    proc = refused_here("prepare-text", str(tmp_path / "src"), str(nano))
    assert "already holds 3 entries (meta.pkl, train.bin, val.bin)" in proc.stderr
    assert "prepare-text writes only into a new or empty directory" in proc.stderr
    assert all((nano / n).read_bytes() == b"theirs" for n in ("train.bin", "val.bin", "meta.pkl"))
    assert sorted(p.name for p in nano.iterdir()) == ["meta.pkl", "train.bin", "val.bin"]


@pytest.mark.parametrize("out_exists", [False, True])
def test_a_failed_preparation_leaves_nothing_behind(tmp_path, out_exists):
    _corpus(tmp_path / "src", docs=40)
    (tmp_path / "src" / "train" / "zz-binary.txt").write_bytes(b"text\0more")  # read last: everything else is written
    out = tmp_path / "out"
    if out_exists:
        out.mkdir()
    with pytest.raises(ConfigError, match="NUL bytes"):
        preparing.prepare(tmp_path / "src", out, "bpe:300", progress=False)
    assert (sorted(out.iterdir()) == []) if out_exists else not out.exists()  # no hidden temporaries either


def test_a_one_line_file_is_read_in_pieces_with_the_same_tokens(tmp_path):
    """A line of 3 MiB is read a MiB at a time (the whole line is never held), a CRLF that a piece cuts
    after its CR included: the token files hold exactly the documents' bytes, every CRLF a LF."""
    long = b"abc def " * (3 * 2**20 // 8)
    cut = b"y" * (2**20 - 1)  # with its CR a whole piece: the LF comes in the next read
    paragraphs = [b"first", long, cut, *[f"paragraph {i}".encode() for i in range(9)]]
    (tmp_path / "one.txt").write_bytes(b"\r\n\r\n".join(paragraphs) + b"\r\n")
    preparing.prepare(tmp_path / "one.txt", tmp_path / "out", "bytes", progress=False)
    for split, held in (("train", False), ("test", True)):  # every 10th document is held out: the 10th here
        docs = [p + b"\n" for i, p in enumerate(paragraphs) if (i % 10 == 9) == held]
        mapped = load_dataset(f"tokens:{tmp_path / 'out'}", split, block_size=4)
        assert bytes(mapped.tokens.numpy().astype("u1")) == b"\n".join(docs), split


def test_what_a_bpe_could_not_do_as_asked_is_said(run_cli, tmp_path):
    (tmp_path / "src.txt").write_bytes(b"hello \xff\xfe world\n\n" * 30 + b"caf\xc3\xa9 ok\n\n" * 30)
    proc = run_cli("prepare-text", "src.txt", "out", "--tokenizer", "bpe:5000", "--no-progress", check=True)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["non_utf8_bytes"] == 27 * 2 and manifest["tokens_learned"] < 5000  # 27 of 30 paragraphs train
    assert f"the BPE learned {manifest['tokens_learned']:,} of the 5,000 tokens asked" in proc.stderr
    assert "54 bytes of the training text are not UTF-8" in proc.stderr


def test_linked_directories_are_read_like_any_other_and_a_loop_once(tmp_path):
    (tmp_path / "real").mkdir()
    for i in range(15):
        (tmp_path / "real" / f"d{i:02d}.txt").write_text(f"document {i}\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "linked").symlink_to(tmp_path / "real")
    (tmp_path / "real" / "back").symlink_to(tmp_path / "src")  # a loop: each directory is read once
    manifest = preparing.prepare(tmp_path / "src", tmp_path / "out", "bytes", progress=False)
    assert sum(manifest["splits"][s]["documents"] for s in ("train", "test")) == 15
    text = load_dataset(f"text:{tmp_path / 'src'}", "train", block_size=4)
    assert b"document 14" in bytes(text.tokens.tolist()) or b"document 14" in bytes(
        load_dataset(f"text:{tmp_path / 'src'}", "test", block_size=4).tokens.tolist())


def _prepared(tmp_path) -> str:
    _corpus(tmp_path / "src")
    preparing.prepare(tmp_path / "src", tmp_path / "out", "bytes", progress=False)
    return f"tokens:{tmp_path / 'out'}"


def test_a_token_the_vocabulary_lacks_or_any_changed_byte_is_refused_before_the_first_step(tmp_path, refused_here):
    spec = _prepared(tmp_path)
    train = tmp_path / "out" / "train.bin"
    good = train.read_bytes()
    base = ["train", "--model", "gpt", "--block-size", "4", "--max-steps", "1", "--dataset", spec]
    train.write_bytes(good[:10] + (300).to_bytes(2, "little") + good[12:])  # token 5: id 300 of a 256-byte vocabulary
    proc = refused_here(*base)
    assert "train.bin holds token id 300 at token 5, outside the vocabulary of 256" in proc.stderr
    train.write_bytes(good[:10] + bytes([good[12], good[13], good[10], good[11]]) + good[14:])  # two tokens swapped
    proc = refused_here(*base)
    assert "train.bin is not the file its manifest describes (its SHA-256" in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_checked_corpus_is_not_read_again_until_a_file_changes(tmp_path, monkeypatch):
    """What was checked is remembered in the user's cache, never in the corpus (a forged record there
    skipped the checks); a file rewritten with its modification time set back is read again."""
    import os
    monkeypatch.setenv("DISTLAB_CACHE", str(tmp_path / "cache"))
    spec = _prepared(tmp_path)
    manifest = token_files.manifest_of(spec)
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    token_files.verify(spec, manifest)
    assert (tmp_path / "cache" / token_files.VERIFIED).is_file()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before  # nothing written into the input
    real = token_files.hashlib.sha256
    monkeypatch.setattr(token_files.hashlib, "sha256", lambda: 1 / 0)  # any read would hash
    token_files.verify(spec, manifest)  # remembered: nothing read
    train = tmp_path / "out" / "train.bin"
    st = train.stat()
    train.write_bytes(train.read_bytes())  # the same bytes, the modification time put back: read again
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ZeroDivisionError):
        token_files.verify(spec, manifest)
    monkeypatch.setattr(token_files.hashlib, "sha256", real)
    (tmp_path / "out" / ".verified.json").write_text(json.dumps({"train.bin": "forged"}))  # read by nobody
    good = train.read_bytes()
    train.write_bytes(good[:10] + (300).to_bytes(2, "little") + good[12:])
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ConfigError, match="holds token id 300"):
        token_files.verify(spec, manifest)


@pytest.mark.parametrize("field,value,says", [
    ("tokens", "abc", "the train split's tokens 'abc' is not a count"),
    ("sha256", None, "the train split's sha256 None is not a SHA-256"),
    ("file", 5, "the train split's file 5 is not a file name"),
    ("vocab_size", "x", "vocab_size 'x' is not a positive count"),
    ("vocab_size", 70000, "vocab_size 70,000 does not fit uint16"),
    ("unigram_entropy", "nan", "unigram_entropy 'nan' is not a number"),
    ("tokenizer", 3, "tokenizer 3 is not a tokenizer's name"),
])
def test_a_malformed_manifest_is_one_line_naming_the_field(tmp_path, refused_here, field, value, says):
    spec = _prepared(tmp_path)
    path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(path.read_text())
    (manifest["splits"]["train"] if field in ("tokens", "sha256", "file") else manifest)[field] = value
    path.write_text(json.dumps(manifest))
    proc = refused_here("train", "--model", "gpt", "--block-size", "4", "--max-steps", "1", "--dataset", spec)
    assert f"manifest.json is damaged: {says}; prepare the corpus again" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


def test_a_nanogpt_directory_is_read_given_its_vocabulary_and_its_pickle_never(run_cli, refused_here, tmp_path):
    """nanoGPT's train.bin/val.bin (uint16 ids, no manifest): --vocab-size says what the ids address, val.bin
    is the test split, the ids are checked against the vocabulary; meta.pkl (a pickle) is never read, and
    a run says its tokens are bare ids (no tokenizer: no generated samples, no loss per byte)."""
    root = tmp_path / "nano"
    root.mkdir()
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 300, 2000, dtype=np.uint16), rng.integers(0, 300, 400, dtype=np.uint16)
    train.tofile(root / "train.bin")
    val.tofile(root / "val.bin")
    (root / "meta.pkl").write_bytes(b"\x80\x04 not a pickle: it would fail if it were read")
    spec = f"tokens:{root}"
    base = ["train", "--model", "gpt", "--dataset", spec, "--n-layer", "1", "--n-head", "2", "--n-embd", "8",
            "--block-size", "8", "--global-batch-size", "4", "--max-steps", "2", "--no-progress"]
    proc = refused_here(*base)
    assert "give their vocabulary with --vocab-size N" in proc.stderr and "meta.pkl is a pickle, never read" in proc.stderr
    assert "outside the vocabulary of 256" in refused_here(*base, "--vocab-size", "256").stderr
    assert "uint16 ids address at most 65,536" in refused_here(*base, "--vocab-size", "70000").stderr
    assert "token ids without their tokenizer" in refused_here(*base, "--vocab-size", "320", "--sample-every", "1").stderr
    test = load_dataset(spec, "test", block_size=8, vocab_size=320)
    x, y = test.batch(torch.tensor([1]))
    assert test.num_classes == 320 and len(test) == (400 - 1) // 8 and x[0].tolist() == val[8:16].tolist()
    assert y[0].tolist() == val[9:17].tolist()
    proc = run_cli(*base, "--vocab-size", "320", "--out", "run", check=True)
    assert "(token ids of a vocabulary of 320, no tokenizer)" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["vocab_size"] == 320 and summary["tokenizer"] == "none" and summary["test_loss_per_byte"] is None
    assert summary["num_parameters"] == load_state_size(tmp_path / "run")
    assert "--vocab-size 100 is smaller than synthetic-text:3000's vocabulary of 256" in refused_here(
        "train", "--model", "gpt", "--dataset", "synthetic-text:3000", "--vocab-size", "100").stderr


def load_state_size(run) -> int:
    from safetensors.torch import load_file
    state = load_file(str(run / "model.safetensors"))
    assert state["0.tok.weight"].shape[0] == 320  # the model's vocabulary is --vocab-size's
    return sum(t.numel() for t in state.values())
