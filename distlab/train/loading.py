"""One loader: the model and its tokenizer from wherever a model is -- ``hf:DIR`` (a Hugging Face
checkpoint), a run directory (its last snapshot, else the final model it wrote), a snapshot of any
layout (its shards put back together), or an exported file (``.safetensors`` with its metadata, or a
plain ``.pt`` state_dict). ``distlab generate``, ``distlab export`` and the library read through it.

* :func:`read` -- ``(state, meta, where)``: the whole model's ``state_dict`` under distlab's names and what
  was recorded with it (the family, its options, the context, the step, the tokenizer's JSON);
* :func:`load` -- a :class:`Loaded`: that model built (on the meta device, then given the tensors: no
  random initialisation) with its tokenizer -- the run's, the directory's, bytes, or the token ids
  themselves for a run on a corpus of ids without a tokenizer (nanoGPT's ``train.bin``).

Every file is read safely: safetensors, or ``torch.load(weights_only=True)``; checksums of snapshots
checked; nothing from a file is executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError, confined, first_line, with_article
from distlab.train import reshard, snapshot, snapshot_load
from distlab.train.snapshot import SnapshotError

FINAL_MODEL = "model.safetensors"  # a text model's run without snapshots leaves its final model here, in OUT


@dataclass
class Loaded:
    """A whole model (``eval()``), its tokenizer, what was recorded with it, and where it came from."""

    model: nn.Module
    tokenizer: object
    meta: dict = field(default_factory=dict)
    where: str = ""

    def __iter__(self):  # model, tokenizer, where = load(...)
        return iter((self.model, self.tokenizer, self.where))


def whole_state(path: str | Path, best: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """The whole model's ``state_dict`` in snapshot ``path`` (``best``: the best validation model), and its meta."""
    path = Path(path)
    snapshot_load.check_path(path, "snapshot")
    meta = snapshot.read_meta(path)
    payloads = [snapshot_load.load_rank_file(path, meta, r) for r in range(len(meta["files"]))]
    key = "best_model" if best else "model"
    if not any(key in p for p in payloads):
        raise SnapshotError(f"snapshot {path} holds no best validation model (the run had no --val-fraction)")
    if any("placement" not in p for p in payloads):
        if len(payloads) == 1 or not _sharded(meta):
            return dict(payloads[0][key]), meta  # one replicated model: rank 0's is the whole one
        raise SnapshotError(f"snapshot {path} was written before snapshots recorded where each tensor sits, by a "
                            f"sharded layout: resume it with the settings that wrote it and snapshot again")
    try:
        return reshard.full_model(payloads, key), meta
    except reshard.ReshardError as exc:
        raise SnapshotError(f"snapshot {path}: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:  # checksums fine, contents not
        raise snapshot.DamagedSnapshot(f"snapshot {path} is damaged: its {key.replace('_', ' ')} cannot be put "
                                       f"together from its rank files ({type(exc).__name__}: {first_line(exc, 120)})"
                                       ) from None


def _sharded(meta: dict) -> bool:
    strategy = meta.get("strategy") or {}
    return bool(strategy.get("zero")) or strategy.get("tp", 1) > 1 or strategy.get("pp", 1) > 1


def read_state(path: str, mmap: bool = False, what: str = "`init_from`") -> tuple[dict, dict]:
    """A whole-model ``state_dict`` file, read safely (tensors only), and what it records of the model
    (a ``.safetensors`` export's metadata: ``model``, ``step``, ``n_head`` ...; empty for ``.pt``).
    ``what`` names the file in messages (the flag or argument it came from)."""
    if not Path(path).is_file():
        raise ConfigError(f"{what} {path}: no such file (give a whole-model state_dict, e.g. one "
                          f"`distlab export SNAPSHOT -o model.pt` wrote)")
    meta = {}
    try:
        if Path(path).suffix == ".safetensors":  # memory-mapped by design, and tensors only
            from safetensors import safe_open
            from safetensors.torch import load_file
            state = load_file(path)
            with safe_open(path, "pt") as f:
                meta = dict(f.metadata() or {})
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not loadable"
        why = (snapshot_load.refusal(exc) if Path(path).suffix != ".safetensors" else f"{type(exc).__name__}: {first_line(exc, 200)}") \
            if Path(path).stat().st_size else "the file is empty"
        raise ConfigError(f"{what} {path} cannot be loaded safely as a state_dict ({why})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()):
        kind = type(state).__name__ if not isinstance(state, dict) else "dict with other values than tensors"
        raise ConfigError(f"{what} {path} holds {with_article(kind)}, not a state_dict (names to tensors)")
    for key, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ConfigError(f"{what} {path}: {key} holds non-finite values (nan or inf): a run from it "
                              f"would train nothing; export a good snapshot instead")
    return state, meta


def run_source(path: str | Path, best: bool = False) -> tuple[str, Path]:
    """What a run directory (one with ``summary.json`` and no ``meta.json``) holds a model in: its last
    snapshot (``("snapshot", dir)``), else the final model it wrote (``("file", OUT/model.safetensors)``);
    a snapshot directory or a model file as given. A run with neither is one line saying how to get one."""
    import json
    path = Path(path)
    if not (path.is_dir() and (path / "summary.json").is_file() and not (path / "meta.json").is_file()):
        return ("file" if path.is_file() else "snapshot"), path
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"run {path}: its summary.json cannot be read ({first_line(exc, 120)})") from None
    where = summary.get("snapshot") if isinstance(summary, dict) else None
    if isinstance(where, str) and Path(where).is_dir():
        return "snapshot", Path(where)
    if (path / FINAL_MODEL).is_file() and not best:
        return "file", path / FINAL_MODEL
    raise ConfigError(f"run {path} kept no model: it wrote no snapshot and no {FINAL_MODEL} (a language model's "
                      f"run without --snapshot-dir writes one at its end); run it again with --snapshot-dir DIR, whose "
                      f"snapshots hold the model" if not best else
                      f"run {path} kept no snapshot, so no best validation model: run it with --snapshot-dir")


def read(source: str | Path, best: bool = False, merge: bool = True) -> tuple[dict[str, torch.Tensor], dict, str]:
    """``(state, meta, where)`` of any source (module docstring): the whole model's tensors under distlab's
    names, what was recorded with them (``model``, the family's options, ``block_size``, ``step``,
    ``tokenizer_json`` ...; a plain ``.pt`` records nothing), and a few words naming it."""
    if str(source).startswith("hf:"):
        from distlab.models import hf
        directory = str(source)[3:]
        name, options, vocab, state = hf.read(directory)
        context = options.to_dict().get("context") or hf.context_of(hf.config_of(directory)) or 2048
        meta = {"model": name, **options.to_dict(), "block_size": context, "vocab": vocab, "tokenizer_dir": directory}
        if (Path(directory) / "tokenizer.json").is_file():  # an export of it ships its tokenizer and what it said
            tok = tokenizers.HFTokenizer.from_dir(directory)
            meta |= {"tokenizer_json": tok.to_json(), "hf": hf.carried(directory, [directory], tok.sha256)}
        else:
            meta["hf"] = hf.carried(directory, [], None)
        return state, meta, f"{source} ({name})"
    kind, path = run_source(source, best)
    if kind == "snapshot" and path.is_dir():
        state, meta = whole_state(path, best)
        where = f"snapshot {path} (step {meta.get('step')})"
        return (merged(state, meta, where) if merge else state), meta, where
    if not path.is_file():
        raise ConfigError(f"{source}: no run directory, snapshot or model file there")
    state, meta = read_state(str(path), what="the model file")
    meta = {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in meta.items()}  # as recorded
    if isinstance(meta.get("hf"), str):  # what a Hugging Face checkpoint said, kept for the export (JSON)
        import json
        try:
            meta["hf"] = json.loads(meta["hf"])
        except ValueError:
            meta.pop("hf")
    beside = path.with_name("tokenizer.json" if path.name == FINAL_MODEL else path.name + ".tokenizer.json")
    if beside.is_file():
        meta["tokenizer_json"] = confined(beside, f"model file {path}").read_text(encoding="utf-8")
    return (merged(state, meta, f"model file {path}") if merge else state), meta, f"model file {path}"


def merged(state: dict[str, torch.Tensor], meta: dict, where: str) -> dict[str, torch.Tensor]:
    """A run with low-rank adapters (``--lora``) as the plain model computing the same function: each
    adapted weight ``W + (B A) * alpha / r``, by the spec recorded with it; any other state as it is."""
    from distlab.models import lora
    if not lora.adapter_keys(state):
        return state
    if not isinstance(meta.get("lora"), str):
        raise ConfigError(f"{where} holds low-rank adapters (lora_a, lora_b) but not the spec they were trained with "
                          f"(their scale alpha / r): export it from its run directory or snapshot")
    return lora.merge(state, lora.LoRASpec.of(meta["lora"]).scale)


def load(source: str | Path, n_head: int | None = None, tokenizer_file: str | None = None,
         best: bool = False) -> Loaded:
    """The language model ``source`` holds, built as it was recorded, and its tokenizer (module docstring);
    ``n_head`` for a plain ``.pt`` GPT (its other sizes are its tensors' shapes), ``tokenizer_file`` to
    give a tokenizer.json instead of the one found with the model."""
    from distlab.models import is_text_model
    from distlab.models.generation import gpt_from_state, model_from_state
    state, meta, where = read(source, best)
    name = meta.get("model")
    if name is not None and not (isinstance(name, str) and is_text_model(name)):
        raise ConfigError(f"{where} holds {with_article(str(name))} model; generate needs a language model")
    try:
        if name is None:  # a plain state_dict: a GPT, its sizes from its tensors' shapes
            heads = n_head or meta.get("n_head")
            if heads is None:
                raise ConfigError(f"{source} is a plain state_dict: give the model's --n-head (its other sizes are "
                                  f"read from the tensors' shapes; a .safetensors export records it)")
            layers = len({k.split(".")[0] for k in state if k.split(".")[0].isdigit()}) - 2
            model = gpt_from_state(state, layers, int(heads), top_k=int(meta.get("top_k", 2)))
        elif n_head is not None:
            raise ConfigError(f"--n-head is for a plain model file (a bare state_dict); {where} records its "
                              f"{name} model's sizes: drop --n-head")
        else:  # any family: as its options were recorded with it
            model = model_from_state(state, meta)
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"{where} does not hold {with_article(name or 'gpt')} model of distlab's layout: "
                          f"{str(exc).splitlines()[0][:200]}") from None
    vocab = state["0.tok.weight"].shape[0]
    return Loaded(model.eval(), tokenizer_of(meta, vocab, where, tokenizer_file), meta, where)


def tokenizer_of(meta: dict, vocab: int, where: str, tokenizer_file: str | None = None):
    """The tokenizer recorded with a model: ``tokenizer_file`` when given, a Hugging Face directory's, the
    run's BPE, bytes for a vocabulary of 256, or the ids themselves for a run whose corpus had no tokenizer;
    refused in one line where none fits."""
    if tokenizer_file:
        tokenizer = tokenizers.load(tokenizer_file)
    elif meta.get("tokenizer_dir"):
        directory = Path(meta["tokenizer_dir"])
        tokenizer = tokenizers.HFTokenizer.from_dir(str(directory)) if (directory / "tokenizer.json").is_file() \
            else None
        if tokenizer is None and vocab != 256:
            raise ConfigError(f"{where} has no tokenizer.json and a vocabulary of {vocab:,}: give --tokenizer")
    elif isinstance(meta.get("tokenizer_json"), str) and isinstance(meta.get("hf"), dict):
        tokenizer = _kept_hf_tokenizer(meta["tokenizer_json"], meta["hf"], where)
    elif isinstance(meta.get("tokenizer_json"), str):
        tokenizer = tokenizers.BPETokenizer.from_json(meta["tokenizer_json"], where=f"{where}'s tokenizer")
    elif str(meta.get("dataset", "")).startswith("tokens:") and vocab != 256:
        return tokenizers.IdsTokenizer(vocab)  # a corpus of ids (nanoGPT's): no text to read or print
    elif vocab == 256:
        tokenizer = None
    else:
        raise ConfigError(f"{where} has a vocabulary of {vocab:,} tokens, not bytes: give its tokenizer with "
                          f"--tokenizer (the run's OUT/tokenizer.json)")
    if tokenizer is None:
        return tokenizers.ByteTokenizer()
    if tokenizer.learned > vocab:
        raise ConfigError(f"the tokenizer has {tokenizer.learned:,} tokens, {where}'s model only {vocab:,}: give "
                          f"the tokenizer it was trained with")
    return tokenizer


def _kept_hf_tokenizer(text: str, kept: dict, where: str) -> "tokenizers.HFTokenizer":
    """The Hugging Face tokenizer a run started from, as the run kept it (its tokenizer.json's text, the
    checkpoint's token ids and the files beside it): its end of text and every end of turn generation stops
    at, as the directory itself gives them."""
    import json
    files = kept.get("files") if isinstance(kept.get("files"), dict) else {}

    def parsed(text, name: str) -> dict:
        try:
            value = json.loads(text) if isinstance(text, str) else {}
        except (ValueError, RecursionError):
            raise ConfigError(f"{where}: the {name} it kept is not JSON") from None
        return value if isinstance(value, dict) else {}

    ids = kept.get("ids") if isinstance(kept.get("ids"), dict) else {}
    return tokenizers.HFTokenizer.from_files(parsed(text, "tokenizer.json"), ids,
                                             parsed(files.get("tokenizer_config.json"), "tokenizer_config.json"),
                                             parsed(files.get("generation_config.json"), "generation_config.json"),
                                             f"{where}'s tokenizer")


__all__ = ["FINAL_MODEL", "Loaded", "load", "read", "read_state", "run_source", "tokenizer_of", "whole_state"]
