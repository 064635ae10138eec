"""Rotary positions scaled to a longer context, as the checkpoints people download scale them.

A rotary table turns position ``p`` into angles ``p * f_i``, one frequency ``f_i = theta^(-2i/D)`` per pair
of a head's dimensions. A model trained on ``L`` positions and stretched to ``factor x L`` keeps the
frequencies whose wavelength is short and slows those whose wavelength exceeds what it was trained on:

* ``linear`` (position interpolation): every frequency divided by ``factor``.
* ``llama3`` (Llama 3.1-3.3): wavelengths shorter than ``L / high_freq_factor`` kept, longer than
  ``L / low_freq_factor`` divided by ``factor``, a smooth blend between.
* ``yarn`` (Qwen2.5's and Qwen3's long-context configs): a ramp between kept and interpolated frequencies
  over the dimensions that turn between ``beta_fast`` and ``beta_slow`` times in ``L`` positions, and the
  angles' cosines and sines scaled by an attention factor (``0.1 ln(factor) + 1`` unless given).

A scaling is written as the ``--rope-scaling`` flag takes it -- ``TYPE,KEY=VALUE,...`` with the keys of
Hugging Face's ``rope_scaling`` (``llama3,factor=8,low_freq_factor=1,high_freq_factor=4,
original_max_position_embeddings=8192``) -- and its frequencies are computed in float32 with the same
operations in the same order as ``transformers``' ``modeling_rope_utils``, so a checkpoint's logits agree.
``dynamic`` (frequencies that change with the length of each inference call) and ``longrope`` are refused:
a trained model's frequencies are fixed.
"""

from __future__ import annotations

import math

import torch

from distlab.errors import ConfigError

# each kind: its required keys, then its optional ones with their defaults
KINDS: dict[str, tuple[tuple[str, ...], dict[str, float | int | bool | None]]] = {
    "linear": (("factor",), {}),
    "llama3": (("factor", "original_max_position_embeddings"), {"low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
              "truncate": True}),
}
REFUSED = {"dynamic": "dynamic NTK scaling changes the frequencies with each call's length at inference; a trained "
                      "model's are fixed",
           "longrope": "longrope's per-dimension factors are not built in distlab"}
INTEGER = ("original_max_position_embeddings",)


def parse(text: str | None) -> dict | None:
    """``TYPE,KEY=VALUE,...`` -> ``{"rope_type": TYPE, KEY: VALUE, ...}`` (defaults filled in, checked), or
    ``None`` for no scaling (``None``, ``""``, ``default``); one line naming what is wrong."""
    if text is None or str(text).strip() in ("", "default", "none"):
        return None
    kind, *pairs = [p.strip() for p in str(text).split(",") if p.strip()]
    values: dict = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise ConfigError(f"--rope-scaling {text}: {pair!r} is not KEY=VALUE")
        values[key.strip()] = value.strip()
    return checked({"rope_type": kind, **values}, f"--rope-scaling {text}")


def checked(scaling: dict, where: str) -> dict:
    """A scaling's keys and values checked and typed (numbers finite and positive, the original context a
    whole number), its defaults filled in; one line naming what is wrong."""
    kind = scaling.get("rope_type")
    if kind in REFUSED:
        raise ConfigError(f"{where}: rope_type {kind!r}: {REFUSED[kind]}; give linear, llama3 or yarn")
    if kind not in KINDS:
        raise ConfigError(f"{where}: rope_type {kind!r} is not a rotary scaling distlab computes (linear, llama3, "
                          f"yarn)")
    required, optional = KINDS[kind]
    unknown = sorted(set(scaling) - {"rope_type", *required, *optional})
    if unknown:
        raise ConfigError(f"{where}: {kind} scaling takes no {unknown[0]!r} (its keys: "
                          f"{', '.join([*required, *optional])})")
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: {kind} scaling needs {missing[0]}")
    out: dict = {"rope_type": kind}
    for key in (*required, *optional):
        value = scaling.get(key, optional.get(key))
        if value is None:
            out[key] = None
        elif key == "truncate":
            if str(value).lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"{where}: truncate must be true or false, not {value!r}")
            out[key] = str(value).lower() in ("true", "1")
        else:
            out[key] = _number(value, key, where, whole=key in INTEGER)
    if kind == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError(f"{where}: high_freq_factor ({out['high_freq_factor']:g}) must exceed low_freq_factor "
                          f"({out['low_freq_factor']:g})")
    return out


def _number(value, key: str, where: str, whole: bool) -> float | int:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0) or (whole and number != int(number)):
        raise ConfigError(f"{where}: {key} must be a finite positive {'whole number' if whole else 'number'}, "
                          f"not {value!r}")
    return int(number) if whole else number


def text(scaling: dict | None) -> str | None:
    """The flag's form of a checked scaling (the inverse of :func:`parse`), keys set to their defaults left out."""
    if not scaling:
        return None
    optional = KINDS[scaling["rope_type"]][1]
    pairs = [f"{k}={_show(v)}" for k, v in scaling.items()
             if k != "rope_type" and not (k in optional and v == optional[k])]
    return ",".join([scaling["rope_type"], *pairs])


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def describe(scaling: dict | None) -> str:
    """A few words for the run's header: ``llama3 scaling x8 of 8192 positions``."""
    if not scaling:
        return ""
    original = scaling.get("original_max_position_embeddings")
    return f"{scaling['rope_type']} scaling x{scaling['factor']:g}" + (f" of {original} positions" if original else "")


def frequencies(head_dim: int, theta: float, scaling: dict | None,
                device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scale)``: the ``head_dim / 2`` rotary frequencies (float32) and the factor the
    angles' cosines and sines are multiplied by, as ``transformers`` computes them for this scaling."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if not scaling:
        return base, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return base / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > original / low, base / factor, base)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(head_dim, theta, scaling, device)


def _yarn(dim: int, theta: float, s: dict, device) -> tuple[torch.Tensor, float]:
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s["attention_factor"]
    if attention is None:
        attention = (float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
                     if s["mscale"] and s["mscale_all_dim"] else mscale(factor))

    def correction(rotations):  # the dimension that turns ``rotations`` times over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(s["beta_fast"]), correction(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    powers = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation
    return inv, attention


def to_hf(scaling: dict | None) -> dict | None:
    """The ``rope_scaling`` a ``config.json`` holds for a checked scaling (its unset optional keys left out)."""
    return None if not scaling else {k: v for k, v in scaling.items() if v is not None}
