"""A downloaded Hugging Face directory is checked before it is used: one crafted directory per way it can be
wrong, the command a user types, a refusal of one line naming the file and what is wrong -- no traceback, no
file outside the directory read, no allocation or build the tensors do not back."""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.conftest import invoke

TRAIN = ["train", "--dataset", "synthetic-text:400", "--block-size", "8", "--global-batch-size", "2", "--max-steps",
         "1", "--no-progress"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A 2-layer Llama written by distlab's own exporter in 3 shards with an index (no transformers needed)."""
    from distlab.models import build_model, hf, spec
    options = spec("llama").make_options(dict(n_layer=2, n_embd=16, n_head=2, kv_heads=1, ffn_hidden=32))
    torch.manual_seed(0)
    model = build_model("llama", (16,), 256, options)
    out = tmp_path_factory.mktemp("base") / "llama"
    hf.write(model.state_dict(), "llama", options, 256, 16, out, shard_bytes=8000)
    assert len(list(out.glob("*.safetensors"))) >= 3 and (out / hf.INDEX).is_file()
    return out


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


def _index(d: Path, edit) -> None:
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def _config(d: Path, **changes) -> None:
    config = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    (d / "config.json").write_text(json.dumps(config))


def _header(path: Path, edit) -> None:
    """Rewrite a safetensors file's header with ``edit`` applied (the data bytes kept)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    edit(head)
    text = json.dumps(head).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def _first(head: dict) -> dict:
    return head[next(k for k in head if k != "__metadata__")]


def _outside(d: Path, name: str) -> None:
    """The index points one shard's tensors at ``name``; a readable copy of that shard lies there."""
    first = _shards(d)[0]
    target = (d / name) if not name.startswith("/") else Path(name)
    if not name.startswith("/"):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(first, target)
    _index(d, lambda ix: ix["weight_map"].update({k: name for k, v in ix["weight_map"].items() if v == first.name}))


def _twice(d: Path) -> None:
    """A tensor of the first shard also in the second (zeroed): which one loads must not depend on file order."""
    from safetensors.torch import load_file, save_file
    a, b = _shards(d)[:2]
    first, second = load_file(a), load_file(b)
    key = sorted(first)[0]
    second[key] = torch.zeros_like(first[key])
    save_file(second, b)


def _nan(d: Path) -> None:
    from safetensors.torch import load_file, save_file
    path = _shards(d)[0]
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})


def _link_out(d: Path, name: str, content: bytes) -> None:
    """``d/name`` a symbolic link to a file beside the directory holding ``content`` (a secret of the user's)."""
    secret = d.parent / f"secret-{name}"
    secret.write_bytes(content)
    (d / name).unlink(missing_ok=True)
    (d / name).symlink_to(secret)


def _deep(d: Path) -> None:
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)


CASES = [
    # the index: nothing outside the directory is read, or asked whether it exists
    ("index-parent", lambda d: _outside(d, "../outside/x.safetensors"), "outside the directory"),
    ("index-absolute", lambda d: _outside(d, "/etc/passwd"), "outside the directory"),
    ("index-nonexistent", lambda d: _outside(d, "/nonexistent/x"), "outside the directory"),
    ("index-not-json", lambda d: (d / "model.safetensors.index.json").write_text("{"), "is not JSON"),
    ("index-list", lambda d: (d / "model.safetensors.index.json").write_text("[1]"), "a JSON list"),
    ("index-values", lambda d: _index(d, lambda ix: ix["weight_map"].update(dict.fromkeys(ix["weight_map"], 3))),
     "not a file name"),
    ("tensor-twice", _twice, "is in both"),
    # the weights files, read from their headers before the library opens them
    ("truncated", lambda d: _shards(d)[0].write_bytes(_shards(d)[0].read_bytes()[:-100]), "cut short"),
    ("header-2^63", lambda d: _shards(d)[0].write_bytes(struct.pack("<Q", 2**63) + b"{}"), "not a safetensors file"),
    ("header-99MB", lambda d: _shards(d)[0].write_bytes(struct.pack("<Q", 99_000_000) + b"{}" * 10),
     "not a safetensors file"),
    ("dtype-unknown", lambda d: _header(_shards(d)[0], lambda h: _first(h).update(dtype="XYZ")), "are floats"),
    ("dtype-relabelled", lambda d: _header(_shards(d)[0], lambda h: _first(h).update(dtype="I32")), "are floats"),
    ("dtype-bool", lambda d: _header(_shards(d)[0], lambda h: _first(h).update(dtype="BOOL")), "are floats"),
    ("shape-huge", lambda d: _header(_shards(d)[0], lambda h: _first(h).update(shape=[10**9, 10**9])),
     "cut short or its header is wrong"),
    ("offsets-past-end", lambda d: _header(_shards(d)[0], lambda h: _first(h).update(data_offsets=[0, 10**12])),
     "cut short or its header is wrong"),
    ("empty-file", lambda d: _shards(d)[0].write_bytes(b""), "not a safetensors file (0 bytes)"),
    ("pickle", lambda d: torch.save({"x": torch.ones(2)}, _shards(d)[0]), "not a safetensors file"),
    ("header-not-json", lambda d: _shards(d)[0].write_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}" + b"\0" * 8),
     "header is not JSON"),
    # a symbolic link out of the directory is refused before the file is opened
    ("config-link-out", lambda d: _link_out(d, "config.json", (d / "config.json").read_bytes()),
     "config.json is a link to a file outside the directory"),
    ("index-link-out", lambda d: _link_out(d, "model.safetensors.index.json",
                                           (d / "model.safetensors.index.json").read_bytes()),
     "model.safetensors.index.json is a link to a file outside the directory"),
    ("shard-link-out", lambda d: _link_out(d, _shards(d)[0].name, _shards(d)[0].read_bytes()),
     "is a link to a file outside the directory"),
    # a file that is not safetensors: nothing of its bytes is said (here its first 8 would be a "length")
    ("header-is-text", lambda d: _shards(d)[0].write_bytes(b"root:$6$secret-hash:19000:0:99999:7:::\n" * 4),
     "is not a safetensors file, or is cut short"),
    # config.json: every value a family reads is the type and range it must be
    ("config-missing-key", lambda d: _config(d, hidden_size=...), "has no hidden_size"),
    ("config-zero-heads", lambda d: _config(d, num_attention_heads=0), "must be at least 1"),
    ("config-size-string", lambda d: _config(d, hidden_size="16"), "must be a whole number"),
    ("config-size-float", lambda d: _config(d, intermediate_size=32.0), "must be a whole number"),
    ("config-theta-text", lambda d: _config(d, rope_theta="abc"), "finite positive number"),
    ("config-theta-inf", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().replace('"rope_theta": 10000.0', '"rope_theta": Infinity')),
     "finite positive number"),
    ("config-layer-types", lambda d: _config(d, layer_types=5), "layer_types must list full_attention"),
    ("config-tied-string", lambda d: _config(d, tie_word_embeddings="false"), "must be true or false"),
    ("config-architectures-string", lambda d: _config(d, architectures="LlamaForCausalLM"), "list of class names"),
    ("config-deep", _deep, "nested too deeply"),
    ("config-binary", lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00\x01"), "is not text"),
    ("config-list", lambda d: (d / "config.json").write_text("[]"), "a JSON list"),
    ("config-million-layers", lambda d: _config(d, num_hidden_layers=10**6), "its tensors number at most 2"),
    # sizes the tensors do not back: built on the meta device and compared, nothing of that size allocated
    # (every rank built and initialised 4096-wide layers before comparing)
    ("config-sizes-lie", lambda d: _config(d, hidden_size=4096, intermediate_size=16384, num_attention_heads=32,
                                           num_key_value_heads=16, head_dim=128), "is for another model: "),
]


@pytest.mark.parametrize("mutate,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_directory_is_refused_in_one_line_before_it_is_used(base, tmp_path, mutate, expected):
    """``distlab train --init-from hf:DIR`` refuses it before launching (exit 2), naming what is wrong."""
    d = tmp_path / "in" / "model"
    shutil.copytree(base, d)
    mutate(d)
    code, out, err = invoke([*TRAIN, "--init-from", f"hf:{d}"], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert "secret" not in err and "{:,}".format(struct.unpack("<Q", b"root:$6$")[0]) not in err, err


def test_the_hubs_cache_layout_of_links_to_its_blobs_is_read(base, tmp_path):
    """`~/.cache/huggingface/hub/models--org--name/snapshots/<revision>/` holds links to `../../blobs/<hash>`:
    the one way out of a directory that is followed -- the model trains from it."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(base.iterdir())):
        shutil.copy(f, blobs / f"{i:040x}")
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f"{i:040x}")
    code, out, err = invoke([*TRAIN, "--init-from", f"hf:{snap}", "--out", str(tmp_path / "run")], tmp_path)
    assert code == 0, err


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer_config.json", "tokenizer.json"])
def test_a_tokenizer_file_that_links_out_of_its_directory_is_neither_read_nor_shipped(tmp_path, name):
    """A chat template (or tokenizer file) that is a link to a file of the user's (a token, a key): chat SFT
    from that directory is refused in one line before anything is rendered, so nothing of it reaches a
    snapshot's meta.json or an export."""
    from tests.test_sft import _chats, chat_model
    chat_model(tmp_path / "model")
    target = tmp_path / "model" / name
    secret = tmp_path / "hf-token"
    secret.write_text(target.read_text() if target.is_file() else "hf_SECRETTOKEN {{ bos_token }}")
    if name == "chat_template.jinja":  # the template read from the .jinja file (tokenizer_config.json has none)
        config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
        config.pop("chat_template")
        (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config))
    target.unlink(missing_ok=True)
    target.symlink_to(secret)
    code, out, err = invoke(["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                             "--dataset", _chats(tmp_path / "chat.jsonl"), "--tokenizer", f"hf:{tmp_path / 'model'}",
                             "--block-size", "40", "--global-batch-size", "4", "--max-steps", "1", "--snapshot-dir",
                             str(tmp_path / "snaps")], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert f"{name} is a link to a file outside the directory" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "snaps").exists() or not any((tmp_path / "snaps").iterdir())


@pytest.mark.parametrize("mutate,expected", [(_nan, "NaN or infinite"),
                                             (lambda d: _config(d, vocab_size=10**9), "its config says")],
                         ids=["nan-weights", "vocab-1e9"])
def test_what_only_the_tensors_reveal_is_refused_before_it_is_used(base, tmp_path, mutate, expected):
    """``distlab generate hf:DIR`` reads the tensors: a NaN weight, or a config whose vocabulary of 10^9 the
    tensors do not back (built on the meta device and compared: nothing of that size allocated)."""
    d = tmp_path / "model"
    shutil.copytree(base, d)
    mutate(d)
    code, out, err = invoke(["generate", f"hf:{d}", "--prompt", "ab", "--max-new-tokens", "1"], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("changes", [dict(num_hidden_layers=10**6), dict(vocab_size=10**9)],
                         ids=["million-layers", "vocab-1e9"])
def test_sizes_a_config_claims_are_refused_within_bounded_memory(base, tmp_path, run_cli, changes):
    """The command a user types, in a process whose address space is capped at 2 GiB (the CLI with torch
    needs ~0.7 GiB): a config whose sizes would take 128 GB (or grow without end, 10^6 layers) is
    refused in one line -- before, each was built (and initialised) first, and here ended in a MemoryError."""
    import resource
    d = tmp_path / "model"
    shutil.copytree(base, d)
    _config(d, **changes)
    cap = 2 * 2**30
    proc = run_cli("generate", f"hf:{d}", "--prompt", "ab", "--max-new-tokens", "1",
                   preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc
    assert len(proc.stderr.strip().splitlines()) == 1 and "config" in proc.stderr, proc.stderr


TEMPLATES = [
    ("memory", "{{ 'x' * 10**9 }}", "a repetition of 1,000,000,000 items"),
    ("power", "{{ 2 ** 100000000 }}", "a power of 100000000"),
    ("endless", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "did not render a conversation within"),
    ("division", "{{ 1/0 }}", "ZeroDivisionError"),
    ("recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
    ("huge-range", "{% for i in range(10**9) %}{% endfor %}", "Range too big"),
    ("include", "{% include 'x' %}", "no loader"),
    ("import", "{% import 'x' as y %}", "no loader"),
    ("extends", "{% extends 'x' %}", "no loader"),
    ("lipsum", "{{ lipsum(10**9) }}", "'lipsum' is undefined"),
    # a constant expression Jinja's optimizer would fold while compiling (a MemoryError there, before any budget)
    ("center-folded", "{{ ''|center(3000000000) }}", "|center would write 3,000,000,000 characters"),
    ("center", "{{ messages[0]['content']|center(10**9) }}", "|center would write"),
    ("printf-filter", "{{ '%1000000000s'|format('x') }}", "|format would write"),
    ("printf", "{{ '%1000000000d' % 3 }}", "a format of '%1000000000d' would write"),
    ("indent", "{{ 'x'|indent(10**9) }}", "|indent would write"),
    ("replace-nested", "{{ 'ab'" + "|replace('', 'xxxxxxxxxx')" * 6 + " }}", "|replace would write"),
    ("ljust", "{{ 'x'.ljust(10**9) }}", "ljust() of a string would write"),
    ("str-format", "{{ '{:1000000000}'.format(1) }}", "format() of a string would write"),
]


@pytest.mark.parametrize("template,expected", [t[1:] for t in TEMPLATES], ids=[t[0] for t in TEMPLATES])
def test_a_chat_template_renders_within_a_budget_or_is_refused_in_one_line(tmp_path, monkeypatch, template, expected):
    """Chat SFT renders every record through the model's template before launching: a template that would take
    all memory or time, or fails in any way, is refused in one line (a render gets 1 s here, 10 s by default)."""
    from distlab.data import chat
    from tests.test_sft import _chats, chat_model
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    chat_model(tmp_path / "model", template=template)
    code, out, err = invoke(["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                             "--dataset", _chats(tmp_path / "chat.jsonl"), "--tokenizer", f"hf:{tmp_path / 'model'}",
                             "--block-size", "40", "--global-batch-size", "4", "--max-steps", "1"], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("write,expected", [
    (lambda d: (d / "tokenizer_config.json").write_text("{"), "tokenizer_config.json is not JSON"),
    (lambda d: (d / "tokenizer_config.json").write_text("[]"), "tokenizer_config.json holds a JSON list"),
    (lambda d: (d / "tokenizer_config.json").write_bytes(b"\xff\xfe\x00"), "tokenizer_config.json is not text"),
    (lambda d: ((d / "tokenizer_config.json").write_text("{}"), (d / "chat_template.jinja").write_bytes(b"\xff\xfe")),
     "chat_template.jinja is not text"),
    (lambda d: (d / "tokenizer.json").write_text("{"), "tokenizer.json is not JSON"),
    (lambda d: (d / "tokenizer.json").write_text(""), "tokenizer.json is not JSON"),
    (lambda d: (d / "tokenizer.json").write_bytes(b"\x80\x81"), "tokenizer.json is not text"),
    (lambda d: (d / "tokenizer.json").write_text("[1, 2]"), "tokenizer.json holds a JSON list"),
    (lambda d: (d / "tokenizer.json").write_text("[" * 200_000 + "]" * 200_000), "nested too deeply"),
    (lambda d: (d / "tokenizer.json").write_text(json.dumps({**json.loads((d / "tokenizer.json").read_text()),
                                                             "model": {"type": "BPE", "vocab": {"a": -1},
                                                                       "merges": []}})),
     "tokenizer.json is not a tokenizer")],
    ids=["config-not-json", "config-list", "config-binary", "template-binary", "tokenizer-not-json", "tokenizer-empty",
         "tokenizer-binary", "tokenizer-list", "tokenizer-deep", "tokenizer-negative-id"])
def test_a_bad_tokenizer_configuration_is_refused_in_one_line(tmp_path, write, expected):
    from tests.test_sft import _chats, chat_model
    chat_model(tmp_path / "model")
    write(tmp_path / "model")
    code, out, err = invoke(["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                             "--dataset", _chats(tmp_path / "chat.jsonl"), "--tokenizer", f"hf:{tmp_path / 'model'}",
                             "--block-size", "40", "--global-batch-size", "4", "--max-steps", "1"], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert expected in err and len(err.strip().splitlines()) == 1, err


def _records(n=20, **record):
    return "".join(json.dumps({"prompt": f"q{i} ", "completion": "a b", **record}) + "\n" for i in range(n))


SFT_FILES = [
    ("utf-16", lambda p: p.write_text(_records(), encoding="utf-16"), "not UTF-8 text"),
    ("latin-1", lambda p: p.write_bytes(_records().replace("a b", "caf\u00e9").encode("latin-1")), "not UTF-8 text"),
    ("binary", lambda p: p.write_bytes(bytes(range(256)) * 4), "not UTF-8 text"),
    ("lone-surrogate", lambda p: p.write_text(_records().replace('"a b"', '"a \\ud800"')), "lone surrogate"),
    ("deep", lambda p: p.write_text("[" * 100_000 + "]" * 100_000 + "\n" + _records()), "nested too deeply"),
    ("long-line", lambda p: p.write_text(json.dumps({"prompt": "x" * 300_000, "completion": "y"}) + "\n" + _records()),
     "a record of more than 250,000 characters"),
    ("no-completion", lambda p: p.write_text(_records(completion="")), "no record has a completion token"),
]


@pytest.mark.parametrize("write,expected", [c[1:] for c in SFT_FILES], ids=[c[0] for c in SFT_FILES])
def test_a_bad_record_file_is_refused_in_one_line_before_launch(tmp_path, monkeypatch, write, expected):
    """`distlab train --dataset sft:FILE` reads every record before launching; a file that is not UTF-8, a lone
    surrogate (it passed the check and failed on rank 0), a line nested 100,000 deep or longer than the record
    limit (250,000 characters here; 8 Mi by default: a record is never held unbounded), records with nothing to
    learn (it trained, reporting loss 0): one line each, exit 2."""
    from distlab.data import sft
    monkeypatch.setattr(sft, "RECORD_LIMIT", 250_000)
    write(tmp_path / "records.jsonl")
    code, out, err = invoke(["train", "--model", "llama", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                             "--dataset", f"sft:{tmp_path / 'records.jsonl'}", "--block-size", "16",
                             "--global-batch-size", "4", "--max-steps", "1"], tmp_path)
    assert code == 2 and "Traceback" not in out + err, (code, out, err)
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flags", [["--temperature", "1e-300"], ["--top-p", "1e-300"],
                                   ["--temperature", "1e-300", "--top-p", "1e-300", "--top-k", "1"]],
                         ids=["temperature", "top-p", "all"])
def test_sampling_settings_near_zero_sample_the_most_likely_token(base, tmp_path, flags):
    """A temperature or top-p of 1e-300 (below float32's range: inf - inf and an empty nucleus crashed
    multinomial) is greedy decoding in the limit, and gives its text."""
    args = ["generate", f"hf:{base}", "--prompt", "ab", "--max-new-tokens", "4"]
    greedy = invoke([*args, "--temperature", "0"], tmp_path)
    code, out, err = invoke([*args, *flags], tmp_path)
    assert code == 0 and "Traceback" not in err, (code, out, err)
    assert out == greedy[1], (out, greedy)


@pytest.mark.parametrize("flags,expected", [
    (["--kv-heads", "2"], "--kv-heads 2 differs from"),  # the family's default: it was silently overridden by 1
    (["--n-layer", "3"], "--n-layer 3 differs from"),  # no --model: it was "model mlp has no such option"
    (["--model", "llama", "--n-embd", "32"], "--n-embd 32 differs from")])
def test_a_model_flag_that_contradicts_the_checkpoint_is_refused(base, tmp_path, flags, expected):
    """The checkpoint's config.json sets the model's options: a flag may repeat what it says (accepted), never
    contradict it -- even with the family's default value, which it silently overrode."""
    code, out, err = invoke([*TRAIN, "--init-from", f"hf:{base}", *flags], tmp_path)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (code, out, err)


def test_a_trace_that_could_not_be_written_is_refused_before_training(tmp_path):
    """`--trace` into an OUT whose trace.json is a directory failed only after training (advising to free
    space); it is refused before launch."""
    (tmp_path / "run" / "trace.json").mkdir(parents=True)
    code, out, err = invoke(["train", "--model", "mlp", "--dataset", "synthetic:1x4x4:2:64", "--global-batch-size",
                             "8", "--max-steps", "2", "--trace", "1:2", "--out", str(tmp_path / "run")], tmp_path)
    assert code == 2 and "trace.json, which is a directory" in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(scope="module")
def finished_run(base, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("finished")
    code, out, err = invoke([*TRAIN, "--init-from", f"hf:{base}", "--out", str(where / "run")], where)
    assert code == 0, err
    return where / "run"


@pytest.mark.parametrize("flags,place,expected", [
    (["--format", "hf"], "afile/sub", "afile is a file, not a directory"),  # was a FileExistsError traceback
    ([], "afile/model.pt", "afile is a file, not a directory"),  # was "File exists (errno 17)"
    ([], "snapshot/meta.json", "lies inside snapshot"),  # overwrote a snapshot's own file
    (["--format", "hf"], "snapshot/hf", "lies inside snapshot")])
def test_an_export_where_a_file_is_in_the_way_is_refused_in_one_line(finished_run, tmp_path, flags, place, expected):
    """`export -o OUT`: a file where OUT needs a directory, or an OUT inside a snapshot (a run's rotation deletes
    it, and a file of the snapshot it replaces is lost), is refused in one line; nothing is written."""
    (tmp_path / "afile").write_text("mine")
    snapshot = tmp_path / "snapshot"
    shutil.copytree(finished_run.parent / "run", snapshot)
    (snapshot / "meta.json").write_text("{}")
    (snapshot / "rank0").mkdir(exist_ok=True)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, out, err = invoke(["export", str(finished_run), "-o", str(tmp_path / place), *flags], tmp_path)
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (code, out, err)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A tmpfs mounted at ``path`` (root only; the test skips elsewhere)."""
    import os
    import subprocess
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("where", ["full", "read-only", "mount-point"])
def test_an_export_to_a_disk_that_cannot_take_it_is_one_line_and_leaves_nothing(finished_run, tmp_path, where):
    """`export --format hf` (and peft) to a full disk, a read-only one, or a mount point that cannot be
    replaced: one line saying why (it was a 36-41-line traceback), no directory left half-written."""
    target = tmp_path / where
    options = {"full": "size=64k", "read-only": "ro,size=1m", "mount-point": "size=1m"}[where]
    with _tmpfs(target, options):
        if where == "full":
            with open(target / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"x" * 4096)
        out = target / "hf" if where != "mount-point" else target
        code, _, err = invoke(["export", str(finished_run), "--format", "hf", "-o", str(out)], tmp_path)
        assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        why = {"full": "No space left on device", "read-only": "Read-only file system",
               "mount-point": "(a mount point: give a new directory inside it)"}[where]
        assert f"-o {out} could not be written: " in err and why in err and "nothing was written" in err, err
        assert [p.name for p in out.parent.iterdir() if p.name.startswith((".hf", f".{where}", "hf"))] == []


def test_an_export_killed_mid_write_is_cleaned_at_the_next_and_its_directory_gets_a_directorys_mode(
        finished_run, tmp_path):
    """A kill -9 mid-export leaves `.OUT.incomplete-PID-*` (so named: nothing in it looks like a finished
    checkpoint); the next export to OUT removes it once that process is gone. The directory written has the
    mode a new directory gets (umask applied), not a temporary directory's 0700. `--format peft` refuses
    --dtype and --merge, which it would ignore."""
    import os
    import stat
    import subprocess
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = tmp_path / f".out.incomplete-{gone.pid}-abcd"
    left.mkdir()
    (left / "config.json").write_text("{}")
    mine = tmp_path / f".out.incomplete-{os.getpid()}-live"  # a process still writing: left alone
    mine.mkdir()
    code, _, err = invoke(["export", str(finished_run), "--format", "hf", "-o", str(tmp_path / "out")], tmp_path)
    assert code == 0, err
    assert not left.exists() and mine.exists()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask
    for flags in (["--dtype", "bfloat16"], ["--merge"]):
        code, _, err = invoke(["export", str(finished_run), "--format", "peft", "-o", str(tmp_path / "p"), *flags],
                              tmp_path)
        assert code == 2 and f"{flags[0]} is for --format hf" in err and len(err.strip().splitlines()) == 1, err
