"""What a run takes from ``--init-from hf:DIR``: the checkpoint's family, options, vocabulary and positions, checked
against the run's settings -- or, for a resumed run whose directory is gone, what its snapshot kept of it."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from distlab.data import is_text
from distlab.errors import ConfigError
from distlab.models import spec


def found(cfg) -> tuple[str, object, int, int] | None:
    """``--init-from hf:DIR``: its family, options, vocabulary and positions (config.json only) -- or, for a
    resumed run whose directory is gone, the config its snapshot kept (:func:`kept`); else None."""
    if not (cfg.init_from or "").startswith("hf:"):
        return None
    from distlab.models import hf
    directory, held = cfg.init_from[3:], kept(cfg)
    if held is not None:
        name, _, options, vocab = hf.options_of(held["config"], f"{cfg.init_from} (as its snapshot kept it)")
        return name, options, vocab, hf.context_of(held["config"])
    name, _, options, vocab = hf.checked_options(directory)
    return name, options, vocab, hf.context_of(hf.config_of(directory))


def kept(cfg) -> dict | None:
    """What the snapshot this run resumes from kept of its ``init_from`` hf:DIR (its config, token ids,
    files) where that directory is gone: the snapshot holds every weight, so the run goes on without it.
    None where the directory is there, or no snapshot keeps it."""
    if not (cfg.init_from or "").startswith("hf:") or cfg.resume is None or \
            (Path(cfg.init_from[3:]) / "config.json").is_file():
        return None
    from distlab.train import snapshot
    paths = snapshot.snapshots(cfg.snapshot_dir) if cfg.resume == "auto" and cfg.snapshot_dir else \
        [Path(cfg.resume)] if cfg.resume != "auto" else []
    for path in paths:
        try:
            held = snapshot.read_meta(path).get("hf")
        except ConfigError:
            continue
        return held if isinstance(held, dict) and isinstance(held.get("config"), dict) else None
    return None


def weights_from(cfg) -> str | None:
    """Where the model's starting weights are read: ``init_from``, unless a snapshot it resumes holds them
    all and the directory is gone (:func:`kept`)."""
    return None if kept(cfg) is not None else cfg.init_from


def check(cfg) -> None:
    """``--init-from hf:DIR`` builds the directory's model: its family (`model`), its options (left at the
    family's defaults here, or equal), a context within its positions, data within its vocabulary."""
    got = found(cfg)
    if got is None:
        return
    name, options, vocab, positions = got
    if cfg.model != name and cfg.model == type(cfg).model:  # no model named: the checkpoint's family
        cfg.model, cfg.options = name, spec(name).make_options()
    if cfg.model != name:
        raise ConfigError(f"`init_from` {cfg.init_from} is a {name} model: give `model` {name}")
    default = spec(name).make_options()
    if cfg.options != options:  # (flags given on the command line were compared one by one: from_flags)
        given = [f.name for f in fields(options) if getattr(cfg.options, f.name) != getattr(default, f.name)]
        field = next((n for n in given if getattr(options, n) != getattr(cfg.options, n)), None)
        if field is not None:
            raise ConfigError(f"`{field}` {getattr(cfg.options, field)} differs from {cfg.init_from}'s "
                              f"{getattr(options, field)}: drop `{field}` (the checkpoint's config sets it)")
        cfg.options = options
    own = Path(cfg.init_from[3:]) / "tokenizer.json"
    bytes_in = cfg.tokenizer == "bytes" and is_text(cfg.dataset) and not cfg.dataset.startswith("tokens:")
    if own.is_file() and bytes_in:
        raise ConfigError(f"{cfg.init_from} reads text with its own tokenizer ({own}); this run would feed it "
                          f"bytes: give `tokenizer` {cfg.init_from}")
    if bytes_in and vocab != 256 and not own.is_file() and kept(cfg) is None:
        raise ConfigError(f"{cfg.init_from} has a vocabulary of {vocab:,} tokens and no tokenizer.json: this run "
                          f"would feed it bytes as token ids; give the tokenizer it was trained with as "
                          f"`tokenizer` hf:DIR")
    if positions and cfg.block_size > positions:
        raise ConfigError(f"`block_size` {cfg.block_size} is longer than the {positions} positions "
                          f"{cfg.init_from} was made for (its config's positions): use at most {positions}")
    data_vocab = cfg.data_shape()[1]
    if data_vocab > vocab:
        raise ConfigError(f"{cfg.dataset}'s vocabulary of {data_vocab:,} tokens is larger than {cfg.init_from}'s "
                          f"{vocab:,}: tokenize the data with the model's own tokenizer "
                          f"(prepare-text --tokenizer hf:DIR)")

