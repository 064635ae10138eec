"""Resume a snapshot under another layout: world size, ZeRO stage, ``tp`` or ``pp``.

Every rank file of a snapshot carries its :func:`~distlab.parallel.placement.placement_of` -- where each
of its tensors sits in the whole model. To load it under another layout every new rank reads
every old rank's file (checked as always), puts the pieces together into the whole model's
tensors and the whole optimizer state per parameter (:func:`~distlab.parallel.placement.assemble`),
and cuts out its own pieces (:func:`~distlab.parallel.placement.state_from_full`). Exact:
the tensors are copied, never recomputed, so the gathered parameters and optimizer state equal the
old run's bit for bit. Each new rank holds the whole state briefly while it loads (the price of
reading any layout without the old one's process groups; torch's full-state-dict loading pays the same).

What is not per-rank comes from the old rank 0 (step, history, LR schedule); RNG states go round
robin (new rank ``r`` takes old rank ``r mod N``): a run continues on the same samples, since the
global batch is kept, but not bitwise -- summation order changes with the layout.
"""

from __future__ import annotations

import torch

from distlab.parallel import Engine
from distlab.parallel.parallelize import split_sharded_state
from distlab.parallel.placement import Placement, assemble, placement_of, state_from_full, take
from distlab.train.optim import optimizer_index


class ReshardError(ValueError):
    """The rank files do not describe one whole model (a rank missing, files from two layouts)."""


def _pieces(payloads: list[dict], key: str) -> tuple[list[tuple[Placement, torch.Tensor]], dict]:
    """Model ``key`` (``model`` or ``best_model``) of every payload that has it, as placed pieces and buffers."""
    pieces, buffers = [], {}
    for payload in payloads:
        if key not in payload:
            continue
        placement = payload["placement"]
        params, bufs = split_sharded_state(payload[key], placement)
        pieces += [(Placement.from_dict(p), t) for p, t in zip(placement["params"], params)]
        for name, t in bufs.items():
            buffers.setdefault(name, t)  # replicated on every rank
    return pieces, buffers


def full_model(payloads: list[dict], key: str = "model") -> dict[str, torch.Tensor]:
    """The whole model's ``state_dict`` (parameters and buffers) from every rank's payload."""
    pieces, buffers = _pieces(payloads, key)
    try:
        whole = {**assemble(pieces), **buffers}
    except ValueError as exc:
        raise ReshardError(str(exc)) from None
    for tie in payloads[0]["placement"].get("tied", ()):  # one parameter under two names: a copy each
        if tie["of"] in whole:
            whole[tie["name"]] = whole[tie["of"]].clone()
    return whole


def full_optimizer(payloads: list[dict]) -> tuple[dict[str, dict[str, torch.Tensor]], dict, list[dict]]:
    """The optimizer state of the whole model: ``{state key: {parameter: whole tensor}}`` for
    element-wise state, ``{parameter: {state key: value}}`` for the rest (Adam's step), and the
    old rank 0's ``param_groups``."""
    pieces: dict[str, list] = {}
    scalars: dict[str, dict] = {}
    for payload in payloads:
        placement = payload["placement"]
        params, _ = split_sharded_state(payload["model"], placement)
        state = payload["optimizer"]["state"]
        index = placement.get("optimizer_index") or range(len(params))  # snapshots of one group: the same order
        for i, (p, local) in zip(index, zip(placement["params"], params)):
            for k, v in state.get(i, {}).items():
                if isinstance(v, torch.Tensor) and v.shape == local.shape:
                    pieces.setdefault(k, []).append((Placement.from_dict(p), v))
                else:
                    scalars.setdefault(p["name"], {}).setdefault(k, v)
    try:
        elementwise = {k: assemble(v) for k, v in pieces.items()}
    except ValueError as exc:
        raise ReshardError(f"optimizer state: {exc}") from None
    return elementwise, scalars, payloads[0]["optimizer"]["param_groups"]


def optimizer_state(engine: Engine, optimizer: torch.optim.Optimizer, payloads: list[dict]) -> dict:
    """The ``optimizer.state_dict()`` this rank would hold had it run the old run's steps."""
    elementwise, scalars, old_groups = full_optimizer(payloads)
    placement = placement_of(engine)
    state = {}
    for i, (p, local) in zip(optimizer_index(optimizer, engine.parameters()),
                             zip(placement["params"], engine.parameters())):
        name = p["name"]
        entry = {k: take(full[name], Placement.from_dict(p), local.numel()) for k, full in elementwise.items()
                 if name in full}
        entry.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.get(name, {}).items()})
        if entry:
            state[i] = entry
    groups = optimizer.state_dict()["param_groups"]
    if len(groups) != len(old_groups):
        raise ReshardError(f"the snapshot's optimizer has {len(old_groups)} parameter groups, this run's {len(groups)}")
    groups = [{**old, "params": new["params"]} for old, new in zip(old_groups, groups)]
    return {"state": state, "param_groups": groups}


def load(engine: Engine, optimizer: torch.optim.Optimizer, payloads: list[dict]) -> dict | None:
    """Put every old rank's ``payloads`` into this rank's ``engine`` and ``optimizer``.

    Returns this rank's share of the best validation model (None where the snapshot has none).
    """
    if any("placement" not in p for p in payloads):
        raise ReshardError("the snapshot was written before snapshots recorded where each tensor sits: "
                           "resume it with the world size and strategy that wrote it")
    engine.load_sharded_state_dict(state_from_full(engine, full_model(payloads)))
    optimizer.load_state_dict(optimizer_state(engine, optimizer, payloads))
    if not any("best_model" in p for p in payloads):
        return None
    return state_from_full(engine, full_model(payloads, "best_model"))
