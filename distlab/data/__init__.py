"""Datasets by name: images -- ``fashion-mnist``, ``mnist``, ``cifar10``, ``cifar100``,
``synthetic:CxHxW:K[:N]`` -- text -- ``fortunes``, ``synthetic-text[:N]`` (:mod:`distlab.data.text`)
-- and your own: inputs and labels, ``tensors:FILE`` (a ``.pt`` or ``.npz``: :mod:`distlab.data.tensors`);
images in class subfolders, ``imagefolder:DIR`` (:mod:`distlab.data.imagefolder`); text, ``text:PATH``
(a file or a directory of files: :mod:`distlab.data.textfiles`). Text is tokenized as bytes or with
a BPE learned from its training split (``tokenizer``: :mod:`distlab.data.tokenizer`); a corpus
larger than memory is tokenized once by ``distlab prepare-text`` and memory-mapped as ``tokens:DIR``
(:mod:`distlab.data.tokens`).

Real data is read from its standard on-disk format and never downloaded. Each name is looked for
in ``--data-dir`` if given, else ``$DISTLAB_DATA`` if set, else where its Debian package installs it
(``/usr/share/datasets``, or ``$DISTLAB_SYSTEM_DATASETS``, for ``dataset-fashion-mnist``;
``/usr/share/games/fortunes`` for ``fortunes``).
A directory the user named is the only one searched: one that lacks the data is an error, never
a silent fall-back elsewhere. A missing dataset is a :class:`~distlab.errors.DataNotFoundError`
naming the paths searched, how to get the data, and a synthetic stand-in of its shape and size.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from distlab.data.cifar import LAYOUTS as CIFAR_LAYOUTS
from distlab.data.cifar import read_cifar
from distlab.data.dataset import ImageDataset
from distlab.data.idx import find_idx_pair, read_idx
from distlab.data.imagefolder import PREFIX as FOLDER, imagefolder_shape, load_imagefolder, root_of
from distlab.data.synthetic import make_synthetic, parse_spec
from distlab.data.tensors import PREFIX as TENSORS, load_tensors, path_of, tensors_shape
from distlab.data import tokenizer as tokenizers
from distlab.data import preference, rl, sft, textfiles, tokens
from distlab.data.text import FORTUNES_SYSTEM_DIR, TextDataset, fortunes_present, make_synthetic_text, parse_synthetic, \
    read_fortunes
from distlab.errors import ConfigError, DataNotFoundError, did_you_mean

SYSTEM_DIR = "/usr/share/datasets"  # where Debian's dataset-* packages install; $DISTLAB_SYSTEM_DATASETS overrides


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    subdirs: tuple[str, ...]       # where under a root the files may sit ("" = the root itself)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool
    how_to_get: str
    find: Callable[[Path], bool]
    read: Callable[[Path, str], tuple]
    text: bool = False               # a token stream (TextDataset), not images
    system: str | None = None        # where its Debian package installs it, if not under SYSTEM_DIR


def _idx_present(d: Path) -> bool:
    return find_idx_pair(d, "train") is not None and find_idx_pair(d, "t10k") is not None


def _idx_read(d: Path, split: str):
    images, labels = find_idx_pair(d, "train" if split == "train" else "t10k")
    x, y = read_idx(images), read_idx(labels)
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise ConfigError(f"{images} / {labels}: shapes {x.shape} and {y.shape} do not make a dataset")
    return x[:, None, :, :], y.astype("int64"), 10


def _cifar(name: str):
    dirname, train, test, _, k = CIFAR_LAYOUTS[name]
    present = lambda d: all((d / f).is_file() for f in train + test)  # noqa: E731
    return present, lambda d, split: (*read_cifar(d, name, split), k)


REGISTRY: dict[str, DatasetInfo] = {
    "fashion-mnist": DatasetInfo(
        "fashion-mnist", ("fashion-mnist", "FashionMNIST/raw", "fashion_mnist", ""), (0.2860,), (0.3530,),
        False, "install Debian's package (apt-get install dataset-fashion-mnist) or put the four IDX "
        "files (train-images-idx3-ubyte.gz, ...) in --data-dir", _idx_present, _idx_read),
    "mnist": DatasetInfo(
        "mnist", ("mnist", "MNIST/raw", ""), (0.1307,), (0.3081,), False,
        "put the four MNIST IDX files (train-images-idx3-ubyte.gz, ...) in --data-dir", _idx_present, _idx_read),
    "cifar10": DatasetInfo(
        "cifar10", ("cifar-10-batches-py",), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True,
        "unpack cifar-10-python.tar.gz into --data-dir (giving --data-dir/cifar-10-batches-py/data_batch_1 ...)",
        *_cifar("cifar10")),
    "cifar100": DatasetInfo(
        "cifar100", ("cifar-100-python",), (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), True,
        "unpack cifar-100-python.tar.gz into --data-dir (giving --data-dir/cifar-100-python/train, test)",
        *_cifar("cifar100")),
}
REGISTRY["fortunes"] = DatasetInfo(
    "fortunes", ("fortunes", ""), (), (), False,
    "install Debian's package (apt-get install fortunes) or put fortune files (each with its .dat index) in "
    "--data-dir/fortunes", fortunes_present, read_fortunes, text=True, system=FORTUNES_SYSTEM_DIR)
ALIASES = {"fashion_mnist": "fashion-mnist", "fmnist": "fashion-mnist", "cifar-10": "cifar10",
           "cifar-100": "cifar100"}


def dataset_names() -> list[str]:
    return [*REGISTRY, "synthetic:CxHxW:K[:N]", "synthetic-text[:N]", "tensors:FILE", "imagefolder:DIR", "text:PATH",
            "tokens:DIR", "sft:FILE.jsonl", "dpo:FILE.jsonl", "synthetic-pairs[:N]",
            "rl:FILE.jsonl", "synthetic-rl[:N]"]


def is_text(name: str) -> bool:
    """Whether dataset ``name`` is a token stream (next-token prediction) rather than labelled images."""
    name = canonical_name(name)
    return name.startswith(("synthetic-text", textfiles.PREFIX, tokens.PREFIX, sft.PREFIX)) or \
        preference.is_preference(name) or rl.is_rl(name) or \
        (name in REGISTRY and REGISTRY[name].text)


def canonical_name(name: str) -> str:
    if name.startswith(TENSORS):
        path_of(name)
        return name
    if name.startswith(FOLDER):
        root_of(name)
        return name
    if name.startswith(textfiles.PREFIX):
        textfiles.path_of(name)
        return name
    if name.startswith(tokens.PREFIX):
        tokens.path_of(name)
        return name
    if name.startswith(sft.PREFIX):
        sft.path_of(name)
        return name
    if preference.is_preference(name):
        return preference.check_name(name)
    if rl.is_rl(name):
        return rl.check_name(name)
    if name.startswith("synthetic-text"):
        parse_synthetic(name)
        return name
    if name.startswith("synthetic"):
        parse_spec(name)
        return name
    name = ALIASES.get(name.lower(), name.lower())
    if name not in REGISTRY:
        raise ConfigError(f"unknown dataset {name!r}{did_you_mean(name, [*REGISTRY, *ALIASES])}; choose one of: "
                          f"{', '.join(dataset_names())}")
    return name


def system_root() -> Path:
    return Path(os.environ.get("DISTLAB_SYSTEM_DATASETS") or SYSTEM_DIR)


def search_roots(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where to look: the directory the user named (``data_dir``, else ``$DISTLAB_DATA``), or the system's."""
    named = data_dir or os.environ.get("DISTLAB_DATA")
    return [Path(named)] if named else [system_root()]


def stand_in(name: str) -> str:
    """The synthetic dataset of ``name``'s shape, classes and training-set size."""
    if REGISTRY[name].text:
        return f"synthetic-text:{TRAIN_SIZES[name]}"
    (c, h, w), k = SHAPES[name]
    return f"synthetic:{c}x{h}x{w}:{k}:{TRAIN_SIZES[name]}"


def locate(name: str, data_dir: str | os.PathLike | None = None) -> Path:
    """The directory holding dataset ``name``'s files, or a DataNotFoundError saying where we looked."""
    info = REGISTRY[canonical_name(name)]

    def find(root: Path) -> tuple[Path | None, list[str]]:
        searched = []
        for sub in info.subdirs:
            d = root / sub if sub else root
            searched.append(str(d))
            if d.is_dir() and info.find(d):
                return d, searched
        return None, searched

    named = "--data-dir" if data_dir else "$DISTLAB_DATA" if os.environ.get("DISTLAB_DATA") else None
    system = Path(info.system) if info.system else system_root()
    root = search_roots(data_dir)[0] if named else system
    found, searched = find(root)
    if found is not None:
        return found
    hint = ""
    if named and not root.is_dir():
        hint = f"{named} {root} does not exist; "
    if named and find(system)[0] is not None:
        hint += f"the system's copy in {system} would be used without {named}; "
    raise DataNotFoundError(
        f"dataset {info.name} not found (searched: {', '.join(dict.fromkeys(searched))}); {hint}"
        f"{info.how_to_get}; or train on generated data of its shape and size with --dataset {stand_in(info.name)}"
    )


def load_dataset(name: str, split: str, data_dir: str | os.PathLike | None = None,
                 seed: int = 0, block_size: int = 64, tokenizer: str = "bytes",
                 vocab_size: int | None = None, pack: bool = False,
                 chat_turns: str = "all") -> ImageDataset | TextDataset:
    """Load ``split`` ("train" or "test") of dataset ``name`` into memory (text: as windows of
    ``block_size`` tokens of ``tokenizer``, bytes or ``bpe:N`` learned from the training split;
    ``vocab_size``: the vocabulary of a corpus of bare token ids, nanoGPT's ``train.bin``/``val.bin``;
    ``chat_turns``: which assistant replies of an sft: chat are targets, all or the last)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    name = canonical_name(name)
    if tokenizer != tokenizers.BYTES and not is_text(name):
        raise ConfigError(f"`tokenizer` {tokenizer} is for text; dataset {name} is images")
    if name.startswith(TENSORS):
        return load_tensors(name, split)
    if name.startswith(FOLDER):
        return load_imagefolder(name, split)
    if name.startswith(tokens.PREFIX):
        return tokens.load_tokens(name, split, block_size, vocab_size)
    if name.startswith(sft.PREFIX):
        return sft.load_sft(name, split, block_size, tokenizer, pack, chat_turns)
    if preference.is_preference(name) and not pack:
        return preference.load_pairs(name, split, block_size, tokenizer)
    if rl.is_rl(name) and not pack:
        return rl.load_prompts(name, split, block_size, tokenizer)
    if pack:
        raise ConfigError(f"`pack` lays fine-tuning records (sft:FILE.jsonl) into windows; {name} is not records")
    if name.startswith("synthetic-text"):
        if tokenizer != tokenizers.BYTES:
            raise ConfigError(f"{name} is random bytes, not text a tokenizer can learn from: keep `tokenizer` bytes")
        return make_synthetic_text(name, split, seed, block_size)
    if name.startswith("synthetic"):
        return make_synthetic(name, split, seed)
    if is_text(name):
        stream, tok, nbytes, where = _tokenized(name, str(data_dir) if data_dir else None, split, tokenizer)
        return TextDataset.from_tokens(name, split, stream, block_size, where, tokenizer=tok, text_bytes=nbytes)
    info = REGISTRY[name]
    where = locate(name, data_dir)
    images, labels, k = info.read(where, split)
    return ImageDataset(name, split, torch.from_numpy(images.copy()), torch.from_numpy(labels.copy()), k,
                        info.mean, info.std, augment=info.augment and split == "train", source=str(where),
                        class_names=CLASS_NAMES.get(name))


def _text(name: str, data_dir: str | None) -> tuple[bytes, bytes, str]:
    """(training text, test text, where it came from) of a text data set."""
    if name.startswith(textfiles.PREFIX):
        train, test = textfiles.split_bytes(name)
        return train, test, str(textfiles.path_of(name))
    where = locate(name, data_dir)
    read = REGISTRY[name].read
    return read(where, "train").tobytes(), read(where, "test").tobytes(), str(where)


@functools.lru_cache(maxsize=4)
def _tokenized(name: str, data_dir: str | None, split: str, spec: str):
    """(tokens, tokenizer, bytes of text, source) of one split; the tokenizer learns from the training split."""
    train, test, where = _text(name, data_dir)
    tok = tokenizers.build(spec, train)
    text = train if split == "train" else test
    return torch.from_numpy(tok.encode(text)), tok, len(text), where


CLASS_NAMES = {
    "fashion-mnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                      "Ankle boot"),
    "mnist": tuple(str(d) for d in range(10)),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}
SHAPES = {"mnist": ((1, 28, 28), 10), "fashion-mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
          "cifar100": ((3, 32, 32), 100)}
TRAIN_SIZES = {"mnist": 60000, "fashion-mnist": 60000, "cifar10": 50000, "cifar100": 50000, "fortunes": 2313988}


def dataset_shape(name: str, block_size: int = 64, tokenizer: str = "bytes",
                  vocab_size: int | None = None) -> tuple[tuple[int, ...], int]:
    """``(input shape, number of classes)`` of dataset ``name`` without reading it (text: a window
    of ``block_size`` tokens and the tokenizer's vocabulary)."""
    name = canonical_name(name)
    if name.startswith(TENSORS):
        return tensors_shape(name)
    if name.startswith(FOLDER):
        return imagefolder_shape(name)
    if name.startswith(tokens.PREFIX):
        return tokens.shape(name, block_size, vocab_size)
    if name.startswith(sft.PREFIX):
        return sft.shape(name, block_size, tokenizer)
    if preference.is_preference(name):
        return preference.shape(name, block_size, tokenizer)
    if rl.is_rl(name):
        return rl.shape(name, block_size, tokenizer)
    if is_text(name):
        return (block_size,), tokenizers.vocab_size(tokenizer)
    if name.startswith("synthetic"):
        shape, k, _ = parse_spec(name)
        return shape, k
    return SHAPES[name]


__all__ = ["ImageDataset", "REGISTRY", "TextDataset", "canonical_name", "dataset_names", "dataset_shape", "is_text",
           "load_dataset", "locate", "search_roots", "stand_in"]
