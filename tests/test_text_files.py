"""Your own text: ``text:PATH`` (a file or a directory of files, split by document) and the
tokenizers (bytes, or ``bpe:N`` learned from the training split) -- read, split, tokenized,
trained over two ranks equal to one process, kept in snapshots and used by ``generate``."""

import json
import random

import pytest
import torch

from distlab.data import dataset_shape, load_dataset
from distlab.data import textfiles
from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError
from distlab.train.config import TrainConfig

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls watch from the old oak tree and "
         "nobody knows why distributed training needs patience").split()


def _prose(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return " ".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + "."
                    for _ in range(sentences)) + "\n"


def _corpus(root, documents: int = 20, sentences: int = 8):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (root / f"doc{i:02d}.txt").write_text(_prose(i, sentences))
    return root


def test_a_directory_is_split_by_document_seeded_and_whole(tmp_path):
    root = _corpus(tmp_path / "texts")
    (root / ".hidden").write_text("never read")
    (root / "sub").mkdir()
    (root / "sub" / "more.txt").write_text(_prose(99, 3))  # files below it count too
    train, test = (load_dataset(f"text:{root}", s, block_size=16) for s in ("train", "test"))
    docs = {p.read_bytes().strip(b"\n") for p in root.rglob("*.txt")}
    train_text, test_text = bytes(train.tokens.tolist()), bytes(test.tokens.tolist())
    held = {d for d in docs if d in test_text}
    assert len(held) == round(21 * 0.1) and all(d not in train_text for d in held)  # whole documents, once
    assert all(d in train_text for d in docs - held) and b"never read" not in train_text + test_text
    again = load_dataset(f"text:{root}", "test", block_size=16)
    assert torch.equal(again.tokens, test.tokens)  # the same split every time (and on every rank)
    assert train.num_classes == 256 and train.tokens_per_byte == 1.0 and train.source == str(root)


def test_a_file_is_split_at_blank_lines_and_train_test_folders_are_taken_as_given(tmp_path):
    text = "\n\n".join(f"paragraph {i}\nline two of {i}" for i in range(30))
    (tmp_path / "book.txt").write_text(text)
    test = load_dataset(f"text:{tmp_path / 'book.txt'}", "test", block_size=8)
    assert bytes(test.tokens.tolist()).count(b"line two of") == 3  # 3 of 30 paragraphs, whole
    _corpus(tmp_path / "given" / "train", 3)
    (tmp_path / "given" / "test").mkdir()
    (tmp_path / "given" / "test" / "t.txt").write_text("a test document of its own, long enough for a window\n")
    given = load_dataset(f"text:{tmp_path / 'given'}", "test", block_size=8)
    assert bytes(given.tokens.tolist()) == b"a test document of its own, long enough for a window\n"


@pytest.mark.parametrize("case,message", [
    ("missing", "there is no file or directory"),
    ("one_document", "is one document"),
    ("binary", r"is not text \(it holds NUL bytes\)"),
    ("empty", "holds no text"),
])
def test_bad_text_is_one_line_naming_the_path(tmp_path, case, message):
    path = tmp_path / "t.txt"
    if case == "one_document":
        path.write_text("one paragraph without a blank line\nanywhere in it\n")
    elif case == "binary":
        path = _corpus(tmp_path / "d", 3)
        (path / "image.bin").write_bytes(b"\x89PNG\0\0\0")
    elif case == "empty":
        path.write_text("\n\n\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_dataset(f"text:{path}", "train")
    assert "\n" not in str(info.value) and (case == "missing" or "image.bin" in str(info.value)
                                            or str(path) in str(info.value))


def test_bpe_is_learned_from_the_training_split_deterministically_and_round_trips(tmp_path):
    root = _corpus(tmp_path / "texts")
    spec = f"text:{root}"
    train = load_dataset(spec, "train", block_size=16, tokenizer="bpe:300")
    test = load_dataset(spec, "test", block_size=16, tokenizer="bpe:300")
    tok = train.tokenizer
    assert tok is test.tokenizer and train.num_classes == 300 and tok.learned <= 300
    assert dataset_shape(spec, 16, "bpe:300") == ((16,), 300)  # known without reading the text
    assert int(train.tokens.max()) < tok.learned and train.tokens.dtype == torch.int32
    # merges make English shorter: fewer tokens than bytes (the rate: tokens / bytes of the split's text)
    test_text = textfiles.split_bytes(spec)[1]
    assert 0 < test.tokens_per_byte < 0.75 and test.tokens_per_byte == len(test.tokens) / len(test_text)
    assert tok.decode(test.tokens.tolist()).encode() == test_text
    sample = _prose(123, 2)
    assert tok.decode(tok.encode(sample.encode()).tolist()) == sample  # byte-level: nothing lost
    other = tokenizers.train_bpe.__wrapped__(bytes(tok.decode(train.tokens.tolist()), "utf-8"), 300)
    assert other.to_json() == tok.to_json() and other.sha256 == tok.sha256  # retrained: the same tokenizer


def test_tokenizer_settings_are_refused_where_they_cannot_work():
    for spec, message in (("bpe:12", "bpe:N with N from 257"), ("words", "unknown `tokenizer`")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_flags(model="gpt", dataset="synthetic-text", tokenizer=spec).validate(1)
    with pytest.raises(ConfigError, match="is for text"):
        TrainConfig.from_flags(model="mlp", dataset="synthetic:1x4x4:2", tokenizer="bpe:300").validate(1)
    with pytest.raises(ConfigError, match="random bytes"):
        TrainConfig.from_flags(model="gpt", dataset="synthetic-text", tokenizer="bpe:300").validate(1)


def test_tensor_parallel_splits_the_bpe_vocabulary(tmp_path):
    """A BPE of 301 tokens over `tp` 2: no longer refused (the vocabulary is cut 151 + 150 rows:
    tests/test_transformer_tp.py), its plan the vocabulary-parallel one."""
    from distlab.parallel.tensor_parallel.plan import plan_of
    root = _corpus(tmp_path / "texts", 4)
    cfg = TrainConfig.from_flags(model="gpt", dataset=f"text:{root}", tokenizer="bpe:301", n_embd=16, n_head=2,
                                 strategy=TrainConfig.from_flags().strategy.replace(tp=2)).validate(2)
    assert cfg._meta_model()[0].tok.num_embeddings == 301
    assert plan_of(cfg._meta_model(), tp=2, style="megatron", sequence_parallel=False)["0.tok"] == "vocab_embedding"


def _train(rank, world, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    trainer = Trainer(cfg, runtime.from_process_group())
    trainer.fit()
    return [p.detach().clone() for p in trainer.engine.full_parameters()]


def test_bpe_text_over_two_ranks_equals_one_process(tmp_path):
    from distlab.launch.spawn import run_ranks
    from distlab.tools.verify import reference_run, tolerance
    root = _corpus(tmp_path / "texts")
    cfg = TrainConfig.from_flags(model="gpt", dataset=f"text:{root}", tokenizer="bpe:300", n_layer=1, n_embd=16, n_head=2,
                      block_size=16, max_steps=4, global_batch_size=8, lr=0.1, lr_schedule="constant", momentum=0.9,
                      seed=3, progress=False, out=str(tmp_path / "run")).validate(2)
    params = run_ranks(_train, 2, cfg, timeout=180)[0]
    ref, _ = reference_run(cfg)
    assert params[0].shape[0] == 300  # the embedding has the BPE's vocabulary
    assert max((a - b).abs().max().item() for a, b in zip(params, ref)) <= tolerance(cfg)


def test_a_bpe_run_keeps_its_tokenizer_for_generate_resume_and_export(refused_here, run_cli, tmp_path):
    root = _corpus(tmp_path / "texts")
    common = ["--model", "gpt", "--dataset", f"text:{root}", "--tokenizer", "bpe:300", "--n-layer", "1", "--n-embd",
              "16", "--n-head", "2", "--block-size", "16", "--global-batch-size", "8", "--lr-schedule", "constant",
              "--snapshot-dir", "s", "--snapshot-every", "3", "--out", "run", "--no-progress"]
    proc = run_cli("train", *common, "--max-steps", "3", "--nproc-per-node", "2", check=True, timeout=300)
    assert "bpe:300: byte-level BPE learned from the training split" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tokenizer"] == "bpe:300" and summary["vocab_size"] == 300
    assert summary["test_loss_per_byte"] == pytest.approx(summary["test_loss"] * summary["test_tokens_per_byte"])
    saved = (tmp_path / "run" / "tokenizer.json").read_text()
    meta = json.loads((tmp_path / "s" / "step-00000003" / "meta.json").read_text())
    assert meta["tokenizer_json"] == saved and meta["tokenizer"] == "bpe:300"
    out = run_cli("generate", "run", "--prompt", "The quick", "--max-new-tokens", "5", "--seed", "1", check=True)
    assert out.stdout.startswith("The quick") and "bpe:300 tokens" in out.stderr
    # the text changed since: its tokenizer would differ, and the snapshot says so
    (root / "doc00.txt").write_text(_prose(500, 30))
    proc = refused_here("train", *common, "--max-steps", "6", "--resume", "auto")
    assert proc.returncode == 2 and "tokenizer sha256" in proc.stderr, proc.stderr
    run_cli("export", "s/step-00000003", "-o", "m.pt", check=True)
    assert (tmp_path / "m.pt.tokenizer.json").read_text() == saved
    again = run_cli("generate", "m.pt", "--n-head", "2", "--prompt", "The quick", "--max-new-tokens", "5", "--seed",
                    "1", check=True)
    assert again.stdout == out.stdout
    (tmp_path / "m.pt.tokenizer.json").unlink()
    proc = refused_here("generate", "m.pt", "--n-head", "2")
    assert proc.returncode == 2 and "give its tokenizer with --tokenizer" in proc.stderr


@pytest.mark.parametrize("layout", ["file", "directory"])
def test_text_path_and_prepare_text_read_the_same_documents(tmp_path, layout):
    """One reader for a corpus on disk: ``text:PATH``'s documents (both splits) are ``prepare-text``'s, byte for
    byte -- CRLF lines, indented first lines, lines of spaces between paragraphs and a last line without its
    newline included; only which documents each holds out differs (a seeded tenth, every tenth)."""
    from distlab.data.prepare import documents
    texts = [f"{'  ' * (i % 2)}Para {i} line one.\r\n  indented line two of {i}.\r\n" for i in range(12)]
    if layout == "file":
        root = tmp_path / "corpus.txt"
        root.write_bytes(b"\n".join(t.encode() + (b"   \t\n" if i % 3 else b"\n\n") for i, t in enumerate(texts))
                         + b"Last paragraph, no newline")
        expected = [t.encode().replace(b"\r\n", b"\n").rstrip(b"\n") for t in texts] + [b"Last paragraph, no newline"]
    else:
        root = tmp_path / "corpus"
        root.mkdir()
        for i, t in enumerate(texts):
            (root / f"d{i:02d}.txt").write_bytes(b"\n\n" + t.encode() + b"\n\n\n")
        expected = [t.encode().replace(b"\r\n", b"\n").rstrip(b"\n") for t in texts]
    prepared = [b"".join(doc).rstrip(b"\n") for _, doc in documents(root)]
    assert prepared == expected
    train, test = textfiles.split_bytes(f"text:{root}")
    read = [d for part in (train, test) for d in part[:-1].split(textfiles.JOIN)]
    assert sorted(read) == sorted(expected)
