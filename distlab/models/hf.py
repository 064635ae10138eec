"""Hugging Face checkpoints in and out: a directory with ``config.json`` and the weights in
``model.safetensors`` or shards listed by ``model.safetensors.index.json`` (``save_pretrained``'s
layout), read and written without ``transformers``.

A family reads and writes such a directory through its registered adapter
(:class:`~distlab.models.hf_adapter.HFAdapter`, :func:`register_adapter`): the architectures it takes
(``LlamaForCausalLM`` ...), its options from a config (refusing, in one line, a config key that changes
the math distlab does not do), the config it writes, and its tensors both ways. Reading is safetensors only --
no pickle, no code from the directory (``trust_remote_code`` has no equivalent here).

* :func:`read` -- ``(family, options, vocab, state)`` of a directory: what ``--init-from hf:DIR``
  and ``distlab generate hf:DIR`` build;
* :func:`write` -- a whole model's state as such a directory (``distlab export --format hf``), with
  the run's tokenizer files beside it when it has them.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from pathlib import Path

import torch

from distlab.errors import ConfigError, check_place, first_line
from distlab.models.hf_files import INDEX, SINGLE, Config, check_layers, check_tensors, confined, config_of, finite, \
    headers, tensor_files
from distlab.models.plans import assign_state, with_tied
from distlab.runtime.meta import on_meta_device

SHARD_BYTES = 2 * 2**30  # save_pretrained's default largest shard (5 GB in transformers; 2 GB keeps files movable)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


_ADAPTERS: dict[str, type] = {}  # a family's adapter: the one it is written with by default
_READERS: dict[str, type] = {}  # an architecture's adapter


def register_adapter(adapter: type) -> type:
    """Make ``adapter`` (an :class:`~distlab.models.hf_adapter.HFAdapter`) read its architectures and write its
    ``family``'s Hugging Face directories."""
    _ADAPTERS[adapter.family] = adapter
    _READERS.update(dict.fromkeys(adapter.architectures, adapter))
    return adapter


def adapters() -> dict[str, type]:
    """``{family: adapter}``: distlab's own (the first of a family's is its default), and any registered since."""
    from distlab.models.hf_gemma3 import HFGemma3
    from distlab.models.hf_gpt2 import HFGPT2
    from distlab.models.hf_llama import HFLlama
    from distlab.models.hf_mixtral import HFMixtral
    from distlab.models.hf_phi3 import HFPhi3
    for adapter in (HFLlama, HFGPT2, HFMixtral, HFPhi3, HFGemma3):  # (the first of a family's is its default)
        _ADAPTERS.setdefault(adapter.family, adapter)
        for arch in adapter.architectures:
            _READERS.setdefault(arch, adapter)
    return _ADAPTERS


def adapter_of(name: str, architecture: str | None = None):
    """Family ``name``'s adapter -- the one that reads ``architecture`` where one of the family's does (a model
    started from a Phi-3 checkpoint goes out as Phi-3) --; one line naming those that have one where it has none."""
    if name not in adapters():
        raise ConfigError(f"model {name} has no Hugging Face layout to export to (families with one: "
                          f"{', '.join(sorted(adapters()))})")
    reader = _READERS.get(architecture or "")
    return reader if reader is not None and reader.family == name else adapters()[name]


def family_of(config: dict, directory: str | Path = "") -> tuple[str, object]:
    """The registered family (its name and adapter) that reads ``config``'s architecture."""
    arch = Config(config, f"hf:{directory}").architecture()
    adapters()
    if arch not in _READERS:
        raise ConfigError(f"hf:{directory}: architecture {arch!r} is not supported (distlab reads "
                          f"{', '.join(sorted(_READERS)) or 'none'})")
    return _READERS[arch].family, _READERS[arch]


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
LAYER_LIMIT = 1 << 20  # layers a config may claim at all (its tensors then hold it to fewer)


def _layers_within(config: dict, where: str, most: int) -> None:
    for key in LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            raise ConfigError(f"{where}: config.json's {key} {value:,} is more than any model's (at most {most:,} "
                              f"here)")


def options_of(config: dict, where: str) -> tuple[str, object, object, int]:
    """``(family name, adapter, options, vocabulary)`` of a ``config.json``: the family that reads its
    architecture, its options checked (one line naming a key whose math distlab does not do)."""
    from distlab.models import spec
    _layers_within(config, where, LAYER_LIMIT)  # before anything per layer is made of it
    name, adapter = family_of(config, where.removeprefix("hf:"))
    values, vocab = adapter.options_from(config, where)
    options = spec(name).make_options(values)
    options.check()
    return name, adapter, options, vocab


def checked_options(directory: str | Path) -> tuple[str, object, object, int]:
    """:func:`options_of` the directory's config, its weight files' headers checked and the layers it claims
    held by its tensors -- before a model of that config is built, even on the meta device."""
    where = f"hf:{directory}"
    found = options_of(config_of(directory), where)
    check_layers(found[2].n_layer, headers(directory), where)
    return found


# The largest sizes a config alone may claim for a plan (no tensors to hold them to): well past every published
# model (126 layers, width 16,384, a 262,144-token vocabulary, 256 experts).
PLANNED_LIMITS = {"n_layer": 1024, "n_embd": 1 << 18, "ffn_hidden": 1 << 20, "n_head": 1 << 12, "kv_heads": 1 << 12,
                  "head_dim": 1 << 12, "experts": 1 << 14}
VOCAB_LIMIT = 1 << 24


def plannable(directory: str | Path) -> tuple[str, object, object, int]:
    """:func:`options_of` a directory's config for a plan: where it has weights, the layers it claims held by
    their tensors (:func:`checked_options`); a config alone, each size within :data:`PLANNED_LIMITS` -- a config
    that claims 10^9 layers or a width of 2^30 would otherwise be traced (or overflow) as if it were a model."""
    where = f"hf:{directory}"
    if (Path(directory) / SINGLE).is_file() or (Path(directory) / INDEX).is_file():
        return checked_options(directory)
    config = config_of(directory)
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > VOCAB_LIMIT:
        raise ConfigError(f"{where}: config.json's vocab_size {vocab:,} is more than any model's (at most "
                          f"{VOCAB_LIMIT:,} here)")
    _layers_within(config, where, PLANNED_LIMITS["n_layer"])
    found = options_of(config, where)
    for key, most in PLANNED_LIMITS.items():
        value = getattr(found[2], key, None)
        if isinstance(value, int) and value > most:
            raise ConfigError(f"{where}: config.json makes {key} {value:,}, more than any model's (at most {most:,} "
                              f"here); a plan of it would not describe a model that exists")
    return found


def check_flags(directory: str | Path, model: str | None, given: dict) -> str:
    """Model flags given with ``--init-from hf:DIR``: its config.json sets every option, so a flag may only say
    what it says -- one that differs is refused, even one equal to the family's default (it would be silently
    overridden). Returns the family the flags belong to (the checkpoint's, where ``model`` is None)."""
    name, _, options, _ = checked_options(directory)
    model = model or name
    for key, value in given.items():
        theirs = getattr(options, key, None) if model == name else None
        if theirs is not None and tuple(value if isinstance(value, (list, tuple)) else [value]) != \
                tuple(theirs if isinstance(theirs, tuple) else [theirs]):
            raise ConfigError(f"`{key}` {value} differs from hf:{directory}'s {theirs}: drop `{key}` (the "
                              f"checkpoint's config sets it)")
    return model


def read(directory: str | Path) -> tuple[str, object, int, dict[str, torch.Tensor]]:
    """``(family name, options, vocabulary, state)``: the directory's model as distlab builds it, its
    weights under distlab's names (float32, as distlab trains; a config's own dtype is a storage choice)."""
    from safetensors import safe_open
    where = f"hf:{directory}"
    name, adapter, options, vocab = options_of(config_of(directory), where)
    found = headers(directory)  # every file's header checked before the library opens it
    check_layers(options.n_layer, found, where)
    tensors: dict[str, torch.Tensor] = {}
    for path in dict.fromkeys(p for p, _, _ in found.values()):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                tensors[key] = finite(f.get_tensor(key).to(torch.float32), key, where)
    state = adapter.to_mine(tensors, options, where)
    model = _on_meta(name, options, vocab)  # what the config describes, compared with what the tensors hold
    check_tensors({k: tuple(v.shape) for k, v in model.state_dict().items()},
                  {k: tuple(v.shape) for k, v in with_tied(model, state).items()}, f"{where} does not match its config")
    return name, options, vocab, state


def _on_meta(name: str, options, vocab: int, block: int = 8):
    from distlab.models import build_model
    with on_meta_device():
        return build_model(name, (block,), vocab, options)


class Slices:
    """One tensor of a checkpoint, read when a piece of it is asked for: a rank of a layout reads the rows or
    columns its placement holds (safetensors' slices), never the rest (float32, as :func:`read` gives).
    ``rows``: distlab's tensor is these rows of a fused one; ``transposed``: of the file's tensor transposed
    (GPT-2's ``Conv1D`` matrices are ``(in, out)``: distlab's rows are their columns)."""

    def __init__(self, path: Path, key: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
                 transposed: bool = False):
        # its file's header checked (hf_files.headers)
        self.path, self.key, self.transposed = path, key, transposed
        shape = tuple(reversed(shape)) if transposed else tuple(shape)
        self.first = rows[0] if rows else 0
        self.shape = (rows[1] - rows[0], *shape[1:]) if rows else shape

    def _read(self, rows: slice, cols: slice = slice(None)) -> torch.Tensor:
        """``self[rows, cols]`` (rows within this tensor's), float32, read from the file alone."""
        from safetensors import safe_open
        rows = slice(self.first + rows.start, self.first + rows.stop)
        with safe_open(str(self.path), "pt") as f:
            whole = f.get_slice(self.key)
            if not self.shape:
                got = whole[:]
            elif self.transposed:
                got = whole[cols, rows].t().contiguous()
            else:
                got = whole[rows] if len(self.shape) == 1 else whole[rows, cols]
        return finite(got.to(torch.float32), self.key, str(self.path.parent))

    def piece(self, dim: int | None, parts: int, part: int) -> torch.Tensor:
        """Part ``part`` of ``parts`` along ``dim`` (as ``torch.chunk`` cuts it; None: the whole tensor)."""
        every = slice(0, self.shape[0]) if self.shape else slice(0, 0)
        if dim is None:
            return self._read(every)
        size = -(-self.shape[dim] // parts)
        mine = slice(min(part * size, self.shape[dim]), min((part + 1) * size, self.shape[dim]))
        return self._read(mine) if dim == 0 else self._read(every, mine)

    def flat(self, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened tensor, reading only the rows that hold them."""
        row = math.prod(self.shape[1:]) if len(self.shape) > 1 else 1
        first, last = start // row, -(-(start + length) // row)
        rows = self._read(slice(first, last)) if self.shape else self._read(slice(0, 0))
        return rows.reshape(-1)[start - first * row:start - first * row + length]

    def detach(self) -> torch.Tensor:  # a buffer or a replicated parameter: the whole tensor
        return self.piece(None, 1, 0)


def sliced(directory: str | Path) -> dict[str, Slices] | None:
    """The directory's tensors under distlab's names, each read only in the pieces asked for
    (:class:`Slices`); None where the family's adapter converts whole state dicts (Mixtral's stacked experts:
    :func:`read` them whole)."""
    where = f"hf:{directory}"
    name, adapter, options, _ = options_of(config_of(directory), where)
    if not adapter.sliced:
        return None
    found = headers(directory)  # every file's header checked before the library opens it
    check_layers(options.n_layer, found, where)
    names, out = adapter.names(options), {}
    for key, (path, _, shape) in found.items():
        if names.get(key) is None and key not in names:
            raise ConfigError(f"{where} holds {key}, which distlab's {name} has no place for")
        if isinstance(names.get(key), tuple):  # a fused tensor: each of distlab's its rows (of it transposed)
            rows = shape[-1] if names[key][0].transposed else shape[0]
            if rows != names[key][-1].stop:
                raise ConfigError(f"{where}: {key} has {rows} {'columns' if names[key][0].transposed else 'rows'}; "
                                  f"its config's make {names[key][-1].stop}")
            out |= {r.mine: Slices(path, key, shape, (r.start, r.stop), r.transposed) for r in names[key]}
        elif names.get(key) is not None:
            out[names[key]] = Slices(path, key, shape)
    return out


def context_of(config: dict) -> int:
    """The longest context a config was made for (0: it does not say)."""
    return Config(config, "hf:").size("max_position_embeddings", 0, "n_positions", least=0)


def build(directory: str | Path, block_size: int | None = None):
    """The directory's model, built and holding its weights; and its record (family, options, vocab)."""
    name, options, vocab, state = read(directory)  # its tensors checked against its config
    block = block_size or context_of(config_of(directory)) or 2048
    model = _on_meta(name, options, vocab, block)
    assign_state(model, with_tied(model, state))  # a tied LM head: the checkpoint keeps the embedding only
    return model, {"model": name, **options.to_dict(), "vocab": vocab, "block_size": block}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CARRIED = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # with its tokenizer.json
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def name_of(model_dir: str | Path) -> str:
    """What names a Hugging Face directory to ``from_pretrained`` (PEFT's ``base_model_name_or_path``): the hub's
    ``ORG/NAME`` for a snapshot of its cache (``models--ORG--NAME/snapshots/<revision>``), else its absolute path."""
    root = Path(model_dir).resolve()
    repo = root.parent.parent.name if root.parent.name == "snapshots" else ""
    if repo.startswith("models--") and repo.count("--") >= 2:
        return repo[len("models--"):].replace("--", "/", 1)
    return str(root)


def carried(model_dir: str | None, tokenizer_dirs: list[str], tokenizer_sha: str | None) -> dict:
    """What an export of a model started from Hugging Face directory ``model_dir`` must say again to be shipped:
    its config's ``ids`` (bos/eos/pad token ids), its ``generation_config.json``, its storage ``dtype``, its
    ``base`` name (:func:`name_of`: what a PEFT adapter of it names as its base), its ``config``; and the
    ``files`` beside the run's tokenizer -- its tokenizer_config.json (chat template, special tokens),
    special_tokens_map.json -- from the first of ``tokenizer_dirs`` whose tokenizer.json is the run's
    (``tokenizer_sha``: its :attr:`~distlab.data.tokenizer.BPETokenizer.sha256`). Plain JSON values."""
    import hashlib
    out: dict = {"ids": {}, "files": {}, "dtype": None, "architecture": None, "base": None, "config": None}
    if model_dir:
        config = config_of(model_dir)
        out["architecture"] = Config(config, f"hf:{model_dir}").architecture()
        out["base"] = name_of(model_dir)
        out["config"] = config  # what a resumed run builds its model by, should the directory be gone
        out["ids"] = {k: config[k] for k in TOKEN_IDS if config.get(k) is not None}
        dtype = config.get("torch_dtype") or config.get("dtype")
        out["dtype"] = dtype if dtype in DTYPES else None
        if (Path(model_dir) / "generation_config.json").is_file():
            out["files"]["generation_config.json"] = confined(Path(model_dir) / "generation_config.json",
                                                              f"hf:{model_dir}").read_text("utf-8")
    for directory in tokenizer_dirs if tokenizer_sha else ():
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            continue
        from tokenizers import Tokenizer
        if hashlib.sha256(Tokenizer.from_file(str(confined(path, f"hf:{directory}"))).to_str().encode()).hexdigest() \
                != tokenizer_sha:
            continue
        out["files"] |= {f: confined(Path(directory) / f, f"hf:{directory}").read_text("utf-8") for f in CARRIED
                         if (Path(directory) / f).is_file()}
        break
    return out


def check_out(out: str | Path) -> Path:
    """``out`` for a new directory: refused in one line where it holds anything (files of another model would
    be mixed with these and read in their place) or lies inside a snapshot (rotation deletes snapshots)."""
    check_place(out)
    root = Path(out).resolve()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"-o {out} is a file: give a new or empty directory for the Hugging Face checkpoint")
    if root.is_dir() and any(root.iterdir()):
        held = sorted(p.name for p in root.iterdir())
        raise ConfigError(f"-o {out} already holds {len(held)} entr{'y' if len(held) == 1 else 'ies'} "
                          f"({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): a checkpoint's files beside "
                          f"another's would be read in their place; give a new or empty directory")
    return root


def write(state: dict[str, torch.Tensor], name: str, options, vocab: int, block_size: int, out: str | Path,
          tokenizer_dir: str | Path | None = None, shard_bytes: int = SHARD_BYTES, *, files: dict | None = None,
          ids: dict | None = None, dtype: str = "float32", architecture: str | None = None) -> Path:
    """``state`` (a whole model's, distlab's names) as a new Hugging Face directory ``out`` (:func:`check_out`):
    config.json (with ``ids``: the checkpoint's bos/eos/pad token ids), safetensors shards in ``dtype`` (with an
    index when more than one), the text ``files`` given (a tokenizer's tokenizer.json, tokenizer_config.json,
    generation_config.json ...) and the tokenizer files found in ``tokenizer_dir``. Written into a
    temporary directory beside ``out`` and renamed at the end: a kill mid-write leaves no ``out``."""
    from safetensors.torch import save_file
    adapter = adapter_of(name, architecture)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: write float32, bfloat16 or float16")
    with new_directory(out) as root:
        state = {k: v.detach().to("cpu") for k, v in state.items() if k not in adapter.tied(options)}
        tensors = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() else v).contiguous()
                   for k, v in adapter.to_theirs(state, options).items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for key in sorted(tensors):
            nbytes = tensors[key].numel() * tensors[key].element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][key] = tensors[key]
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(root / SINGLE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(root / file), metadata={"format": "pt"})
                weight_map.update({k: file for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n", encoding="utf-8")
        config = {**adapter.config_for(options, vocab, block_size), **(ids or {}), "torch_dtype": dtype,
                  "dtype": dtype}
        (root / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for file in TOKENIZER_FILES if tokenizer_dir else ():
            if (Path(tokenizer_dir) / file).is_file():
                shutil.copyfile(confined(Path(tokenizer_dir) / file, f"hf:{tokenizer_dir}"), root / file)
        for file, text in (files or {}).items():
            (root / Path(file).name).write_text(text, encoding="utf-8")
    return Path(out).resolve()


@contextlib.contextmanager
def new_directory(out: str | Path):
    """A new directory ``out`` (:func:`check_out`), written as ``.OUT.incomplete-PID-*`` beside it -- the body
    fills the path it is given -- then synced, given the mode a new directory gets (not the 0700 of a
    temporary one) and renamed: a kill mid-write leaves no ``out``, and the next export there removes what
    such a kill left. A full or read-only disk, or a mount point in the way, is one line; nothing is left."""
    import os
    import tempfile

    from safetensors import SafetensorError
    final = check_out(out)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_incomplete(final)
        root = Path(tempfile.mkdtemp(prefix=f".{final.name}.incomplete-{os.getpid()}-", dir=final.parent))
    except OSError as exc:
        raise ConfigError(f"-o {out} could not be written: {exc.strerror or exc} (errno {exc.errno}); nothing was "
                          f"written") from None
    try:
        yield root
        for path in root.iterdir():  # on disk before the directory takes its name
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(root, 0o777 & ~umask)
        if final.is_dir():
            final.rmdir()  # empty (check_out): its place is taken whole
        os.replace(root, final)
    except (OSError, SafetensorError) as exc:  # a full or read-only disk; a mount point that cannot be replaced
        shutil.rmtree(root, ignore_errors=True)
        why = f"{exc.strerror or exc} (errno {exc.errno})" if isinstance(exc, OSError) else first_line(exc, 200)
        mount = " (a mount point: give a new directory inside it)" if final.is_dir() and final.is_mount() else ""
        raise ConfigError(f"-o {out} could not be written: {why}{mount}; nothing was written") from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def _remove_incomplete(final: Path) -> None:
    """What an export to ``final`` killed mid-write left beside it (``.NAME.incomplete-PID-*`` of a process
    that is gone)."""
    import os
    for left in final.parent.glob(f".{final.name}.incomplete-*"):
        pid = left.name[len(f".{final.name}.incomplete-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(left, ignore_errors=True)
