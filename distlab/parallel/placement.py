"""Where each tensor a rank holds sits in the whole model: what lets a snapshot change layout.

Every strategy cuts the single-process model's tensors the same three ways, in this order:

1. **pipeline parallel** keeps some layers on a stage, under other keys (``layers.3.weight`` is
   the model's ``net.3.weight``);
2. **tensor parallel** keeps part ``part`` of ``parts`` equal slices along one dimension
   (``torch.chunk``): rows of a column-parallel weight, columns of a row-parallel one, rows of a
   vocabulary-parallel embedding;
3. **ZeRO** flattens what is left and keeps elements ``[start, start + length)`` of it, padded with
   zeros to the shard size.

A :class:`Placement` records those three cuts for one local tensor -- enough to cut it out of
the full tensor (:func:`take`) and to put every rank's pieces back together (:func:`assemble`)
without the layout that made them. Element-wise optimizer state (momentum, Adam's moments) is
placed like its parameter, so the same placements move the optimizer state. A snapshot stores
each rank's placements beside its tensors; loading it at another world size, ZeRO stage, ``tp``
or ``pp`` assembles the full tensors and cuts this layout's pieces out of them (the layout-free
middle form is what ``distlab export`` writes).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import nn

from distlab.parallel.protocols import ShardedLayer, value_copy


@dataclass(frozen=True)
class Placement:
    """One local tensor's place in the whole model's tensor ``name`` of shape ``shape``."""

    name: str
    shape: tuple[int, ...]
    dim: int | None = None  # tensor parallel: the dimension split into ``parts`` (None: whole)
    parts: int = 1
    part: int = 0
    start: int = 0  # ZeRO: the flat range of the (tensor-parallel) piece this rank keeps
    length: int | None = None  # None: the whole piece, unflattened

    def to_dict(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls(**{**{k: v for k, v in d.items() if k != "tied_to"}, "shape": tuple(d["shape"])})

    def piece_shape(self) -> tuple[int, ...]:
        """The shape of the tensor-parallel piece (before ZeRO flattens it)."""
        shape = list(self.shape)
        if self.dim is not None:
            shape[self.dim] = torch.empty(shape[self.dim]).chunk(self.parts)[self.part].numel()
        return tuple(shape)


def take(full: torch.Tensor, p: Placement, numel: int | None = None) -> torch.Tensor:
    """This placement's piece of ``full`` (a copy); a flat ZeRO piece is zero-padded to ``numel``."""
    if tuple(full.shape) != tuple(p.shape):
        raise ValueError(f"{p.name}: the full tensor has shape {tuple(full.shape)}, the placement {p.shape}")
    if hasattr(full, "piece") and p.dim is None and p.length is not None:  # ZeRO's flat range of a checkpoint's
        flat = full.flat(p.start, p.length)  # tensor: only the rows that cover it are read
        out = torch.zeros(max(numel or 0, p.length), dtype=flat.dtype)
        out[:p.length].copy_(flat)
        return out
    if hasattr(full, "piece"):  # a checkpoint's tensor read in the piece asked for (distlab.models.hf.Slices)
        piece = full.piece(p.dim, p.parts, p.part)
    else:
        piece = full.chunk(p.parts, p.dim)[p.part] if p.dim is not None else full
    if p.length is None:
        return piece.detach().clone().contiguous()
    flat = piece.reshape(-1)[p.start:p.start + p.length]
    out = torch.zeros(max(numel or 0, p.length), dtype=piece.dtype, device=piece.device)
    out[:p.length].copy_(flat)
    return out


def assemble(pieces: list[tuple[Placement, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole tensors from every rank's ``(placement, piece)`` pairs (replicas are read once).

    Raises ``ValueError`` naming a tensor whose pieces do not cover it: a snapshot missing a rank.
    """
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    flats: dict[tuple, tuple[torch.Tensor, set]] = {}  # (name, parts, part) -> flattened TP piece, ranges seen
    seen = set()
    for p, t in pieces:
        if p.name not in full:
            full[p.name] = torch.zeros(p.shape, dtype=t.dtype, device=t.device)
            covered[p.name] = 0
        key = (p.name, p.dim, p.parts, p.part)
        if p.length is None:
            if key in seen:
                continue  # a replica (data parallel) of a piece already placed
            seen.add(key)
            region = full[p.name].chunk(p.parts, p.dim)[p.part] if p.dim is not None else full[p.name]
            region.copy_(t.reshape(region.shape))
            covered[p.name] += region.numel()
            continue
        flat, ranges = flats.setdefault(key, (torch.zeros(p.piece_shape(), dtype=t.dtype).reshape(-1), set()))
        if (p.start, p.length) in ranges:
            continue
        ranges.add((p.start, p.length))
        flat[p.start:p.start + p.length].copy_(t.reshape(-1)[:p.length])
        covered[p.name] += p.length
    for (name, dim, parts, part), (flat, _) in flats.items():
        region = full[name].chunk(parts, dim)[part] if dim is not None else full[name]
        region.copy_(flat.view(region.shape))
    short = [name for name, n in covered.items() if n != full[name].numel()]
    if short:
        name = short[0]
        raise ValueError(f"the pieces of {name} cover {covered[name]} of its {full[name].numel()} elements "
                         f"(a rank's file is missing, or two layouts were mixed)")
    return full


# --------------------------------------------------------------------------- whole state from shards


def full_parameters(model: nn.Module) -> list[torch.Tensor]:
    """``model``'s parameters in registration order, every :class:`~distlab.parallel.protocols.ShardedLayer`'s
    shards gathered into the full tensors the unsharded model would have (collective over each layer's
    group), the rest copied."""
    out: list[torch.Tensor] = []

    def visit(m: nn.Module) -> None:
        if isinstance(m, ShardedLayer):  # it gathers its own
            out.extend(m.full_parameters())
            return
        out.extend(value_copy(p) for p in m.parameters(recurse=False))
        for child in m.children():
            visit(child)

    visit(model)
    return out


def full_state_dict(model: nn.Module, gathered=None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as the unsharded model has it: every sharded layer's parameters gathered
    under their own keys (collective over each layer's group), everything else copied. ``gathered``: a
    context ``gathered([module])`` that puts one module's own parameters in place while they are copied
    (a gradient sync's, :meth:`~distlab.parallel.protocols.ShardedState.gathered`); None: they are."""
    out: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        prefix = f"{name}." if name else ""
        with gathered([m]) if gathered is not None else contextlib.nullcontext():
            if isinstance(m, ShardedLayer):
                names = [k for k, _ in m.named_parameters(recurse=False)]
                out.update(zip((prefix + k for k in names), m.full_parameters()))
                continue
            for key, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
                if t is not None:
                    out[prefix + key] = value_copy(t)
    return out


# --------------------------------------------------------------------------- an Engine's placements


def placement_of(engine) -> dict:
    """Where ``engine``'s state on this rank sits in the whole model (plain data; a snapshot stores
    it): ``keys`` and ``params`` -- the optimizer parameters' local keys and their :class:`Placement`
    dicts, in the optimizer's order -- and ``buffers`` (local key -> the whole model's key). Read from
    the protocols only: the sharded layers' declared splits (:class:`~distlab.parallel.protocols.ShardedLayer`:
    tensor-parallel layers, expert shards), the schedule's keys and the gradient sync's slots."""
    from distlab.runtime import group_rank, group_size
    split = {}
    for m in (m for m in engine.module.modules() if isinstance(m, ShardedLayer)):
        for pname, dim in m.tp_split.items():
            t = getattr(m, pname, None)
            if t is not None:
                split[id(t)] = (dim, group_size(m.group), group_rank(m.group), m.full_shape(pname))
    whole = engine.schedule.model_key
    keys, params = [], []
    for key, p, flat in engine.grad_sync.parameter_slots():
        dim, parts, part, shape = split.get(id(p), (None, 1, 0, tuple(p.shape)))
        start, length = flat if flat is not None else (0, None)
        keys.append(key)
        params.append(Placement(whole(key), tuple(shape), dim, parts, part, start, length).to_dict())
        if whole(key) in engine.schedule.tied:  # a pipeline's copy of a parameter the first stage holds
            params[-1]["tied_to"] = engine.schedule.tied[whole(key)]
    from distlab.models.plans import tied_names
    # a parameter under a second name (a tied LM head): not a buffer of its own; the whole state repeats it
    tied = {name: group[0] for group in tied_names(engine.module) for name in group[1:]}
    names = {*dict(engine.module.named_buffers()), *engine.module.state_dict(keep_vars=True)} - set(keys) - set(tied)
    return {"keys": keys, "params": params, "buffers": {k: whole(k) for k in sorted(names)},
            **({"tied": [{"key": k, "name": whole(k), "of": whole(v)} for k, v in tied.items()]} if tied else {})}


def placements_of(engine) -> dict[str, Placement]:
    """The whole model's parameter name -> where ``engine``'s optimizer parameter for it sits in it
    (tensor-parallel part, ZeRO's flat range): :func:`placement_of` as objects."""
    return {d["name"]: Placement.from_dict(d) for d in placement_of(engine)["params"]}


def state_from_full(engine, full: dict[str, torch.Tensor], placement: dict | None = None,
                    device: torch.device | None = None) -> dict:
    """This rank's :meth:`~distlab.parallel.Engine.sharded_state_dict` cut out of the whole model's
    ``state_dict`` (no communication: every rank cuts its own pieces), each piece on ``device`` if given."""
    placement = placement or placement_of(engine)
    missing = [p["name"] for p in placement["params"] if p["name"] not in full]
    missing += [k for k in placement["buffers"].values() if k not in full]
    if missing:
        raise KeyError(f"the state has no {missing[0]!r} ({len(missing)} missing)")
    names = {p["name"] for p in placement["params"]} | set(placement["buffers"].values())
    return state_from_stream(engine, (([name], full[name]) for name in names), placement, device)


def state_from_stream(engine, tensors, placement: dict | None = None, device: torch.device | None = None) -> dict:
    """:func:`state_from_full` from ``tensors``, an iterable of ``(names, whole tensor)`` (as
    :meth:`distlab.models.deferred.Initialisation.tensors` makes them): each is cut the moment it comes and
    may be dropped after, so this rank holds its own pieces and one whole tensor at a time, never the model."""
    placement = placement or placement_of(engine)
    locals_ = list(engine.parameters())
    wants: dict[str, list] = {}  # a whole name -> (parameter index or buffer key) that take from it
    for i, p in enumerate(placement["params"]):
        wants.setdefault(p["name"], []).append(i)
    for key, name in placement["buffers"].items():
        wants.setdefault(name, []).append(key)
    params: list[torch.Tensor | None] = [None] * len(placement["params"])
    buffers: dict[str, torch.Tensor] = {}
    for names, whole in tensors:
        for name in names:
            for want in wants.pop(name, ()):
                if isinstance(want, int):
                    piece = take(whole, Placement.from_dict(placement["params"][want]), locals_[want].numel())
                    params[want] = piece.to(device or piece.device, locals_[want].dtype)
                else:
                    buffers[want] = whole.detach().clone().to(device or whole.device)
    if wants:
        first = next(iter(wants))
        raise KeyError(f"the state has no {first!r} ({len(wants)} missing)")
    for tie in placement.get("tied", ()):  # the second name of a tied parameter loads the same tensor
        buffers[tie["key"]] = params[[p["name"] for p in placement["params"]].index(tie["of"])]
    return engine.grad_sync.state_from(params, buffers)

