"""A snapshot's model as one plain file, and a run that starts from one.

:func:`export` reads every rank file of a snapshot (checksums checked, ``weights_only`` loads),
puts the shards back together by their placements (:mod:`distlab.train.reshard`) and writes the
whole model's ``state_dict`` -- the keys and shapes of the single-process model, whatever the
layout that trained it -- atomically, with ``torch.save``, or as safetensors (the format the
ecosystem exchanges weights in) when the file name ends in ``.safetensors``. Plain PyTorch reads it::

    model = distlab.models.build_model("mlp", (1, 28, 28), 10, widths=(512, 256))
    model.load_state_dict(torch.load("model.pt", weights_only=True))
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

:func:`load_init` is the other way: ``distlab train --init-from model.pt`` (or ``.safetensors``)
starts every rank from such a file (one distlab exported, or any ``torch.save(model.state_dict())``
or ``safetensors.torch.save_file`` of the same model).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from distlab.errors import ConfigError, check_place, first_line, with_article
from distlab.models import lora
from distlab.models.plans import with_tied
from distlab.train import loading
from distlab.train.loading import read_state
from distlab.train.metrics import atomic_write_text
from distlab.train.streamed import HashingFile, write_safetensors


def write_state(state: dict[str, torch.Tensor], meta: dict, out: str | Path) -> dict:
    """Write a whole-model ``state`` to ``out`` atomically -- ``.safetensors`` (with ``meta``'s facts:
    :func:`export_metadata`) or ``torch.save`` -- its SHA-256 beside it, and a text model's tokenizer
    (``meta["tokenizer_json"]``) as ``OUT.tokenizer.json``; returns what was written."""
    out = Path(out)
    check_place(out)
    if out.is_dir():
        raise ConfigError(f"-o {out} is a directory: give the file to write, e.g. {out / 'model.pt'}")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # streamed, hashed on the way: never the serialized state beside the state
            if _safetensors(out):
                written = write_safetensors(f, state, export_metadata(meta))
            else:
                written = HashingFile(f)
                try:
                    torch.save(state, written)
                except Exception:
                    if written.error is not None:  # a full disk: the OSError it was
                        raise written.error from None
                    raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as exc:  # a read-only or full disk: nothing partial is left, the reason in one line
        raise ConfigError(f"{out} could not be written: {exc.strerror or exc} (errno {exc.errno}); nothing was "
                          f"written") from None
    except RuntimeError as exc:  # torch.save reports a failed write (ENOSPC) as a RuntimeError
        raise ConfigError(f"{out} could not be written: {first_line(exc, 200)}; nothing was written") from None
    finally:
        with contextlib.suppress(OSError):  # on a read-only disk there is nothing to remove
            tmp.unlink(missing_ok=True)
    digest = written.sha.hexdigest()
    checksum = out.with_name(out.name + ".sha256")  # `sha256sum -c model.pt.sha256` checks it
    try:
        atomic_write_text(checksum, f"{digest}  {out.name}\n")
    except OSError as exc:
        raise ConfigError(f"wrote {out}, but not its checksum {checksum}: {exc.strerror or exc}") from None
    tokenizer = None
    if isinstance(meta.get("tokenizer_json"), str):  # a text model's tokenizer goes with it (generate reads it)
        tokenizer = out.with_name(out.name + ".tokenizer.json")
        try:
            atomic_write_text(tokenizer, meta["tokenizer_json"])
        except OSError as exc:
            raise ConfigError(f"wrote {out}, but not its tokenizer {tokenizer}: {exc.strerror or exc}") from None
    return {"tokenizer_file": str(tokenizer) if tokenizer else None,"out": str(out), "step": meta.get("step"), "model": meta.get("model"), "dataset": meta.get("dataset"),
            "build": build_call(meta), "world_size": meta.get("world_size"),
            "tensors": len(state), "parameters": _parameters(state, meta),
            "bytes": out.stat().st_size, "sha256": digest, "sha256_file": str(checksum)}


def export(path: str | Path, out: str | Path, best: bool = False, fmt: str = "auto", dtype: str | None = None,
           merge: bool = False) -> dict:
    """Write the whole model of ``path`` -- a snapshot, or a run directory (its last snapshot, else the
    final model it wrote) -- to ``out`` (atomically); returns what was written. ``fmt`` ``hf``: a
    Hugging Face directory ``out`` (:func:`export_hf`) in ``dtype`` (default: the checkpoint's own) -- of a
    run with low-rank adapters, with ``merge`` only (each adapted weight ``W + B A alpha / r``); ``peft``:
    the adapters alone, as PEFT keeps them (:func:`export_peft`)."""
    if fmt == "peft" and (dtype is not None or merge):
        raise ConfigError(f"--format peft writes the adapters as they trained, in float32, beside their base: "
                          f"{'--dtype' if dtype is not None else '--merge'} is for --format hf (drop it)")
    state, meta, where = loading.read(path, best, merge=False)
    adapted = bool(lora.adapter_keys(state))
    if merge and not adapted:
        raise ConfigError(f"--merge folds low-rank adapters into their layers: {where} has none (it trained "
                          f"without --lora)")
    if fmt == "peft":
        return export_peft(state, meta, out, where)
    if fmt == "hf" and adapted and not merge:
        raise ConfigError(f"{where} holds low-rank adapters: export --format peft (the adapters, for "
                          f"peft.PeftModel.from_pretrained on the base) or --format hf --merge (the merged model)")
    state = loading.merged(state, meta, where)
    if fmt == "hf":
        return export_hf(state, meta, out, dtype)
    if dtype is not None:
        raise ConfigError("--dtype is for --format hf (a state_dict file keeps the run's float32)")
    return write_state(state, meta, out)


def export_hf(state: dict[str, torch.Tensor], meta: dict, out: str | Path, dtype: str | None = None) -> dict:
    """A whole model as a Hugging Face directory (:func:`distlab.models.hf.write`): its family's options
    from ``meta`` (what the run recorded), the vocabulary from the token embedding, the model's context, the
    run's tokenizer as ``tokenizer.json`` where it has one (a BPE the run learned or read; a byte-level run
    has none to give) and, for a model started from a Hugging Face checkpoint, what that checkpoint said
    and the run kept (``meta["hf"]``: its bos/eos ids, generation_config.json, the tokenizer's
    tokenizer_config.json with its chat template and special tokens, its dtype -- the default ``dtype``)."""
    from distlab.models import hf, is_text_model
    from distlab.models.generation import recorded_options
    name = meta.get("model")
    if not (isinstance(name, str) and is_text_model(name)):
        raise ConfigError(f"--format hf writes a language model's checkpoint; this one is {with_article(str(name))} "
                          f"model")
    options = recorded_options(meta)
    carried = meta.get("hf") if isinstance(meta.get("hf"), dict) else {}
    files = dict(carried.get("files") or {})
    if isinstance(meta.get("tokenizer_json"), str):  # with the config transformers' AutoTokenizer reads it by
        files["tokenizer.json"] = meta["tokenizer_json"]
        files.setdefault("tokenizer_config.json",
                         json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
    root = hf.write(state, name, options, state["0.tok.weight"].shape[0], int(meta.get("block_size") or 64), out,
                    files=files, ids=carried.get("ids") or {}, dtype=dtype or carried.get("dtype") or "float32",
                    architecture=carried.get("architecture"))
    tokenizer = root / "tokenizer.json" if "tokenizer.json" in files else None
    return {"out": str(root), "step": meta.get("step"), "model": name, "files": sorted(p.name for p in root.iterdir()),
            "tokenizer_file": str(tokenizer) if tokenizer else None, "dtype": dtype or carried.get("dtype") or "float32",
            "tensors": len(state), "parameters": _parameters(state, meta)}


def export_peft(state: dict[str, torch.Tensor], meta: dict, out: str | Path, where: str) -> dict:
    """A run's low-rank adapters as a PEFT directory (:func:`distlab.models.peft_files.write`), under the
    module names of the Hugging Face architecture the run's model goes out as."""
    from distlab.models import peft_files
    from distlab.models.generation import recorded_options
    if not lora.adapter_keys(state):
        raise ConfigError(f"--format peft writes low-rank adapters: {where} has none (train with --lora)")
    carried = meta.get("hf") if isinstance(meta.get("hf"), dict) else {}
    layers = peft_files.module_names(meta["model"], recorded_options(meta), carried.get("architecture"))
    spec = lora.LoRASpec.of(meta["lora"])
    root = peft_files.write(state, spec, layers, out, carried.get("base"))
    return {"out": str(root), "step": meta.get("step"), "model": meta.get("model"), "lora": spec.text(),
            "tensors": len(lora.adapter_keys(state)), "files": sorted(p.name for p in root.iterdir()),
            "parameters": sum(state[k].numel() for k in lora.adapter_keys(state))}


def _parameters(state: dict[str, torch.Tensor], meta: dict) -> int:
    """The model's parameters: as its run counted them (a tied matrix once), else the state's floats."""
    counted = meta.get("num_parameters")
    return int(counted) if isinstance(counted, int) or str(counted).isdigit() else \
        sum(t.numel() for t in state.values() if t.is_floating_point())


def export_metadata(meta: dict) -> dict[str, str]:
    """What a ``.safetensors`` export records of its model (strings, as the format keeps them): enough
    for ``distlab generate FILE`` alone -- the heads, which no tensor's shape tells, among them."""
    keep = ["model", "step", "n_layer", "n_head", "n_embd", "block_size", "experts", "top_k", "dataset", "tokenizer",
            "hf", "lora"]
    from distlab.models import is_user_model, spec
    if isinstance(meta.get("model"), str) and not is_user_model(meta["model"]):
        try:
            keep += [k for k in spec(meta["model"]).options.names() if k not in keep]  # its family's options too
        except Exception:  # noqa: BLE001 - a family this version does not know: the common sizes only
            pass
    return {"format": "pt", **{k: json.dumps(meta[k]) if isinstance(meta[k], dict) else str(meta[k])
                               for k in keep if meta.get(k) is not None}}


def _safetensors(path: str | Path) -> bool:
    return Path(path).suffix == ".safetensors"


def build_call(meta: dict) -> str:
    """The ``build_model`` call that makes the model a snapshot's ``meta`` describes (as Python text)."""
    from distlab.data import dataset_shape
    try:
        shape, classes = dataset_shape(meta["dataset"], meta.get("block_size") or 64, meta.get("tokenizer") or "bytes",
                                       meta.get("vocab_size"))
    except Exception:  # noqa: BLE001 - a dataset name this version does not know: leave it to the user
        shape, classes = "INPUT_SHAPE", "CLASSES"
    if isinstance(meta.get("vocab_size"), int):  # a vocabulary padded past the data's
        classes = meta["vocab_size"]
    options = {"widths": tuple(meta["mlp_widths"])} if meta.get("mlp_widths") else _given_options(meta)
    args = "".join(f", {k}={v!r}" for k, v in options.items())
    return f"distlab.models.build_model({meta.get('model')!r}, {tuple(shape) if isinstance(shape, (list, tuple)) else shape}, {classes}{args})"


def _given_options(meta: dict) -> dict:
    """The family options ``meta`` records that differ from the family's defaults (sizes, kv heads, ties)."""
    from distlab.models import spec
    try:
        family = spec(meta.get("model"))
    except Exception:  # noqa: BLE001 - your own model, or one this version does not know: its sizes only
        return {k: meta[k] for k in ("n_layer", "n_head", "n_embd") if meta.get(k) is not None}
    from distlab.models.generation import recorded_options
    given, default = recorded_options(meta).to_dict(), family.make_options().to_dict()
    return {k: v for k, v in given.items() if v != default.get(k)
            or k in ("n_layer", "n_head", "n_embd")}


def check_init(path: str | None) -> None:
    """Before launching: ``--init-from`` must name a file that loads safely as a state_dict (read
    memory-mapped: a large file costs no copy)."""
    if path is not None and path.startswith("hf:"):
        from distlab.models import hf
        hf.tensor_files(path[3:])  # the config is read by the settings' check
    elif path is not None:
        _read_init(path, mmap=True)


def _read_init(path: str, mmap: bool = False) -> dict:
    return read_state(path, mmap)[0]


def load_init(model: nn.Module, path: str) -> None:
    """Load the whole-model ``state_dict`` file ``path`` -- or ``hf:DIR``, a Hugging Face directory's weights
    under distlab's names -- into ``model`` (safely: tensors only), or say what differs."""
    if path.startswith("hf:"):
        from distlab.models import hf
        state = hf.read(path[3:])[3]
    else:
        state = _read_init(path)
    model.load_state_dict(_fitting(model, state, path))


def init_slices(model: nn.Module, path: str) -> dict | None:
    """``--init-from hf:DIR`` of a family whose tensors map by name: the checkpoint's tensors checked against
    ``model`` and left unread (:class:`distlab.models.hf.Slices`), for each rank to read the pieces its
    layout holds once it is cut (:func:`~distlab.parallel.placement.state_from_full`); None otherwise (the
    whole file is read into the model before the cut: :func:`load_init`)."""
    if not path.startswith("hf:"):
        return None
    from distlab.models import hf
    slices = hf.sliced(path[3:])
    return None if slices is None else _fitting(model, slices, path)


def _fitting(model: nn.Module, state: dict, path: str) -> dict:
    """``state`` with a tied parameter under each of its names, if its names and shapes are ``model``'s."""
    from distlab.models.hf_files import check_tensors
    state = with_tied(model, state)  # a tied LM head: a Hugging Face checkpoint keeps the embedding only
    check_tensors({k: tuple(v.shape) for k, v in model.state_dict().items()},
                  {k: tuple(v.shape) for k, v in state.items()}, f"`init_from` {path} is for another model",
                  "this model's")
    return state
