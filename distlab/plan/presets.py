"""Published models the planner knows by name: each preset is its ``config.json``'s numbers (the file it came
from cited beside them), read by the same family adapters as a downloaded checkpoint's
(:func:`distlab.models.hf.options_of`)."""

from __future__ import annotations

import json
from pathlib import Path

from distlab.errors import ConfigError

PRESETS_DIR = Path(__file__).with_name("presets")


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def preset(name: str) -> tuple[dict, str]:
    """``(config.json's fields, where they were published)`` of preset ``name``."""
    path = PRESETS_DIR / f"{name}.json"
    if name not in preset_names():  # by listed name only: never a path (../../x) to another .json
        raise ConfigError(f"--preset {name}: no such preset; choose one of {', '.join(preset_names())} (or give "
                          f"--model hf:DIR with a checkpoint's config.json)")
    d = json.loads(path.read_text())
    return d["config"], d["source"]


def options(name: str) -> tuple[str, object, int]:
    """``(family, options, vocabulary)`` of preset ``name``."""
    from distlab.models import hf
    config, _ = preset(name)
    family, _, opts, vocab = hf.options_of(config, f"preset {name}")
    return family, opts, vocab
