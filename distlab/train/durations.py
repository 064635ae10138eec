"""Durations as people write them: ``2h``, ``90m``, ``3600s``, ``1h30m`` or a number of seconds."""

from __future__ import annotations

import re

from distlab.errors import ConfigError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str | float | None) -> float | None:
    """``"2h"``, ``"90m"``, ``"3600s"``, ``"1h30m"`` or a number of seconds -> seconds."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    value = text.strip().lower()
    try:
        return float(value)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhd])", value)
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*([smhd])", "", value).strip():
        raise ConfigError(f"cannot read the duration {text!r}: write e.g. 2h, 90m, 3600s or 1h30m")
    return sum(float(n) * _UNITS[u] for n, u in parts)
