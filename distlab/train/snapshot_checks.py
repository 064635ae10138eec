"""What a snapshot's rank file must hold for a resume to read it: the keys and types
:class:`~distlab.train.run_state.RunState` loads, the step its ``meta.json`` names, an optimizer's and a
scheduler's state as torch writes them (buffers tensors, hyperparameters numbers, step counts counts),
finite weights, RNG states the generators accept. :func:`payload_problem` says what is wrong before any
of it is loaded (:mod:`distlab.train.snapshot` sets such a snapshot aside and a resume falls back)."""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from distlab.errors import first_line, with_article


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def payload_problem(payload, step: int) -> str | None:
    """What makes a rank file's payload unusable by a resume (None: nothing): the keys and types
    :class:`~distlab.train.run_state.RunState` reads, the step of its ``meta.json``, RNG states
    that the generators accept."""
    if not isinstance(payload, dict):
        return f"{with_article(type(payload).__name__)}, not a dict"
    for key in ("model", "optimizer", "scheduler", "rng", "step", "window", "run"):
        if key not in payload:
            return f"no {key!r}"
    if not is_int(payload["step"]) or payload["step"] != step:
        return f"step {payload['step']!r}, meta.json says {step}"
    for key in ("model", "optimizer", "scheduler", "run") + tuple(k for k in ("best_model", "placement", "extra")
                                                                  if k in payload):
        if not isinstance(payload[key], dict):
            return f"{key!r} is {with_article(type(payload[key]).__name__)}, not a dict"
    window = payload["window"]
    if not (isinstance(window, (list, tuple)) and len(window) == 2 and is_number(window[0])
            and is_int(window[1]) and window[1] >= 0):
        return "'window' is not [loss sum, steps]"
    run = payload["run"]
    for key, ok in (("history", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v)),
                    ("evals", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v)),
                    ("best_val_loss", lambda v: v is None or is_number(v)),
                    ("best_val_step", lambda v: v is None or is_int(v)),
                    ("time_used_s", lambda v: is_number(v) and 0 <= v < float("inf")),
                    ("last_loss", is_number),
                    ("attempts", lambda v: is_int(v) and v >= 0),
                    ("layouts", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v))):
        if key == "layouts" and key not in run:  # written before runs recorded their layouts
            continue
        if key not in run or not ok(run[key]):
            return f"run.{key} is {'missing' if key not in run else repr(run[key])[:60]}"
    problem = _optimizer_problem(payload["optimizer"]) or _scheduler_problem(payload["scheduler"])
    if problem:
        return problem
    for key in ("model", "optimizer", "best_model"):  # a run never writes nan or inf weights: it stops first
        where = _non_finite(payload.get(key), key)
        if where:
            return f"{where} holds nan or inf"
    return _rng_problem(payload["rng"])


def _optimizer_problem(state: dict) -> str | None:
    """A torch optimizer's state_dict: ``state`` by parameter index, ``param_groups`` listing them."""
    groups, per_param = state.get("param_groups"), state.get("state")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                               and all(is_int(i) for i in g["params"]) for g in groups):
        return "'optimizer' has no param_groups listing parameter indices"
    if not isinstance(per_param, dict):
        return "'optimizer' has no per-parameter state"
    indices = {i for g in groups for i in g["params"]}
    for index, entry in per_param.items():
        if index not in indices or not isinstance(entry, dict):
            return f"'optimizer' state {str(index)[:20]!r} is not a dict of a listed parameter"
        for name, value in entry.items():  # buffers are tensors (SGD's may be None); the step count a number
            ok = (torch.is_tensor(value) and value.numel() == 1) or is_number(value) if name == "step" else \
                torch.is_tensor(value) or value is None
            if not ok:  # (a tensor of another shape than its parameter's: RunState's load says so)
                return f"'optimizer' state {name} of parameter {index} is {repr(value)[:40]}, not a tensor"
    for g in groups:
        for key, value in g.items():
            if key in NUMERIC_HYPERPARAMETERS and not (is_number(value) and math.isfinite(value) and value >= 0):
                return f"'optimizer' {key} {repr(value)[:40]} is not a number"
            if key == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2
                                       and all(is_number(b) for b in value)):
                return f"'optimizer' betas {repr(value)[:40]} are not two numbers"
            if key in FLAG_HYPERPARAMETERS and not (value is None or isinstance(value, bool)):
                return f"'optimizer' {key} {repr(value)[:40]} is not a flag"
    return None


NUMERIC_HYPERPARAMETERS = ("lr", "initial_lr", "momentum", "dampening", "weight_decay", "eps")
FLAG_HYPERPARAMETERS = ("nesterov", "maximize", "amsgrad", "foreach", "capturable", "differentiable", "fused")


def _scheduler_problem(state: dict) -> str | None:
    """torch's LR scheduler state: its step counts are counts, its learning rates numbers."""
    for key in ("last_epoch", "_step_count"):
        if key in state and not (is_int(state[key]) and state[key] >= -1):
            return f"'scheduler' {key} {repr(state[key])[:40]} is not a step count"
    for key in ("base_lrs", "_last_lr"):
        if key in state and not (isinstance(state[key], list) and all(is_number(v) for v in state[key])):
            return f"'scheduler' {key} {repr(state[key])[:40]} is not a list of learning rates"
    return None


def _non_finite(value, where: str, depth: int = 0) -> str | None:
    """The first floating tensor under ``value`` (nested dicts and lists) with a nan or inf, by its path."""
    if torch.is_tensor(value):
        return where if value.is_floating_point() and not bool(torch.isfinite(value).all()) else None
    if depth > 8:
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, v in items:
        found = _non_finite(v, f"{where}.{key}", depth + 1)
        if found:
            return found
    return None


def _rng_problem(state) -> str | None:
    """Whether fresh generators accept these states (the process's own are not touched)."""
    try:
        torch.Generator().set_state(state["torch"])
        n = state["numpy"]
        np.random.RandomState().set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                                           n["has_gauss"], n["gauss"]))
        p = state["python"]
        random.Random().setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
        for s in state.get("cuda", []):
            if not (torch.is_tensor(s) and s.dtype == torch.uint8):
                raise TypeError("a CUDA state is not a byte tensor")
    except Exception as exc:  # noqa: BLE001 - any failure: a generator would not take it
        return f"'rng' is not a generator state ({type(exc).__name__}: {first_line(exc, 100)})"
    return None
