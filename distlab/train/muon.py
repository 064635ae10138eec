"""Muon (``--optimizer muon``): momentum orthogonalised by a Newton-Schulz iteration for the weights of matrix
multiplications, AdamW for the rest -- embeddings, the output layer, norms and biases -- as the reference
implementations do (Keller Jordan's Muon, modded-nanogpt; Moonshot's scaling for AdamW's learning rate).

A matrix's step::

    m <- mu m + g                      (momentum, element by element: it lives on whatever piece a rank holds)
    u <- g + mu m                      (Nesterov)
    O <- NS5(U)                        (U the whole matrix u: its orthogonalised direction, U V^T of its SVD)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O    (0.2 sqrt(max(A, B)): O's RMS made AdamW's, ~0.2)

NS5 is the quintic iteration ``X <- a X + (b A + c A A) X``, ``A = X X^T``, five times from ``U / ||U||_F``, with
``(a, b, c) = (3.4445, -4.7750, 2.0315)``. Stacked experts (a 3-D weight) are a batch of matrices; a
convolution's filters are ``(out, in x k x k)``.

**The whole matrix.** Everything but NS5 acts element by element, so it runs on a ZeRO shard or a tensor-parallel
slice as it runs on the whole; NS5 does not: it needs each whole matrix. So each matrix has an *owner* among the
ranks holding its pieces -- the i-th matrix cut over ranks goes to rank ``i mod n`` of the group, round-robin --
and its step gathers
the pieces of ``u`` there, level by level (ZeRO's flat shards into the tensor-parallel slice, then the slices
along their split dimension into the matrix), the owner runs NS5 once, and the pieces of ``O`` are scattered back
the same way. Data parallel and a pipeline hold whole matrices: no communication. Expert parallel splits the batch
of experts, not a matrix: none either. Per matrix a rank sends its piece to the owner, and the owner the others'
pieces back: ``2 (n-1)/n`` of the matrix over the group, counted like every collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab import comm
from distlab.models.parameter_roles import matrix_names  # noqa: F401 (the parameters it steps)
from distlab.parallel.offload import stepped_off_device
from distlab.train.low_precision_optim import Adam16

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def zeropower(u: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of ``u``: a matrix, a batch of them (3-D), or filters (flattened to
    ``(out, -1)``), in float32; returns the same shape."""
    shape = u.shape
    x = u.reshape(shape[0], -1) if u.dim() != 3 else u
    x = x.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.reshape(shape)


def scale_of(shape: tuple[int, ...]) -> float:
    """``0.2 sqrt(max(A, B))`` of a matrix ``A x B`` (the last two dimensions of a batch): the orthogonalised
    update's RMS, ``1/sqrt(max(A, B))``, made AdamW's typical 0.2."""
    rows, cols = (shape[-2], shape[-1]) if len(shape) == 3 else (shape[0], math.prod(shape[1:]))
    return 0.2 * math.sqrt(max(rows, cols))


@dataclass(frozen=True)
class Level:
    """One way a matrix is cut over ``group``: ZeRO's flat shards (``dim`` None: the ``shape`` flattened, padded to
    a multiple of the group and split in equal parts) or a tensor-parallel split along ``dim`` of ``shape`` (the
    piece's shape there)."""
    group: object
    dim: int | None
    shape: tuple[int, ...]  # what the pieces come together into (flat: the tensor-parallel slice)


class Muon(Adam16):
    """Muon over the parameters marked as matrices, AdamW (float32 moments, or ``state_dtype``) over the rest.

    ``params``: two groups, ``{"params": [...], "muon": True}`` and the AdamW ones; ``levels``: per Muon
    parameter, how its whole matrix is cut (:class:`Level`, innermost first; [] for a whole one)."""

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, levels=None,
                 weight_decay: float = 0.0, state_dtype: torch.dtype | None = None, **adam):
        super().__init__(params, lr=lr, weight_decay=weight_decay, decoupled=True, state_dtype=state_dtype, **adam)
        for group in self.param_groups:
            group.setdefault("muon", False)
            group.setdefault("momentum", momentum)
            group.setdefault("nesterov", nesterov)
        self.levels = levels or {}

    def _step_group(self, group: dict) -> None:
        """AdamW's group as Adam16 steps it; Muon's each matrix in turn (every rank joins every cut matrix's
        gathers: a parameter without a gradient steps on zeros)."""
        if not group["muon"]:
            return super()._step_group(group)
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        cut = 0  # the matrices cut over ranks so far: the next one's owner (round-robin)
        for whole in group["params"]:
            state = self.state[whole]
            levels = self.levels.get(whole, [])
            with stepped_off_device(self.offload, whole, state, whole.grad) as (param, grad):  # (offloaded: on the host)
                grad = grad if grad is not None else torch.zeros_like(param)  # (every rank joins)
                if not state:
                    state["momentum_buffer"] = self._zeros(param)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(grad)
                u = grad.add(buf, alpha=mu) if group["nesterov"] else buf.clone()
                o = orthogonalised(u.to(whole.device), levels, cut).to(param.device)  # (collectives: the device's)
                cut += bool(levels)
                if wd:
                    param.mul_(1 - lr * wd)
                param.add_(o, alpha=-lr * scale_of(levels[-1].shape if levels else tuple(param.shape)))


def orthogonalised(u: torch.Tensor, levels: list[Level], index: int) -> torch.Tensor:
    """This rank's piece of NS5 of the whole matrix whose piece ``u`` is (``index``: the matrix's place among
    Muon's, which picks its owner): gathered level by level to the owner, orthogonalised there, scattered back.
    ``levels`` empty: ``u`` is the whole matrix."""
    pieces = [u]  # the piece at each level, innermost first; the owner's whole at each level after it
    owners = []
    for level in levels:
        n = dist.get_world_size(level.group) if level.group is not None else dist.get_world_size()
        rank = dist.get_rank(level.group) if level.group is not None else dist.get_rank()
        owner = index % n
        owners.append((owner, rank, n))
        piece = pieces[-1].contiguous()
        if level.dim is not None:  # (a ZeRO shard over one rank is the slice, flat)
            piece = piece.view(_part_shape(level, n))
        parts = [torch.empty_like(piece) for _ in range(n)] if rank == owner else None
        comm.gather(piece, parts, dst=owner, group=level.group)
        if rank != owner:  # (a non-owner is done with this matrix until the scatter back)
            pieces.append(None)
            break
        whole = torch.cat(parts)[:math.prod(level.shape)].view(level.shape) if level.dim is None \
            else torch.cat([p.view(piece.shape) for p in parts], dim=level.dim)
        pieces.append(whole)
    top = pieces[-1]  # the whole matrix where this rank owns it at every level (None where it does not)
    out = zeropower(top) if top is not None else None
    for depth in range(len(owners) - 1, -1, -1):  # back down: the owner of each level scatters its whole
        (owner, rank, n), level = owners[depth], levels[depth]
        piece = torch.empty(_part_shape(level, n) if level.dim is not None else pieces[depth].shape,
                            dtype=pieces[depth].dtype, device=pieces[depth].device)
        parts = None
        if rank == owner and out is not None:
            if level.dim is None:
                flat = torch.zeros(piece.numel() * n, dtype=out.dtype, device=out.device)
                flat[:out.numel()] = out.reshape(-1)
                parts = list(flat.view(n, -1).unbind())
            else:
                parts = [p.contiguous() for p in out.chunk(n, dim=level.dim)]
        comm.scatter(piece, parts, src=owner, group=level.group)
        out = piece.view(pieces[depth].shape)
    return out


def _part_shape(level: Level, n: int) -> list[int]:
    """A rank's slice of a tensor-parallel level's whole: its split dimension over ``n``."""
    shape = list(level.shape)
    shape[level.dim] //= n
    return shape


def levels_of(engine) -> dict:
    """Per optimizer parameter of ``engine`` (by identity), how its whole matrix is cut on this layout
    (:class:`Level`, innermost first): ZeRO's flat shards over its group, then a tensor-parallel split over the
    layer's group (a stacked batch of experts split along the batch is no cut of a matrix); groups of one rank
    left out. Read from the protocols: the gradient sync's slots and the sharded layers' declared splits."""
    from distlab.errors import ConfigError
    from distlab.parallel.protocols import ShardedLayer
    from distlab.runtime import group_size
    split = {}
    for m in (m for m in engine.module.modules() if isinstance(m, ShardedLayer)):
        for pname, dim in m.tp_split.items():
            t = getattr(m, pname, None)
            if t is not None:
                split[id(t)] = (dim, m.group, tuple(m.full_shape(pname)))
    sync = engine.grad_sync
    out = {}
    for (key, p, flat), q in zip(sync.parameter_slots(), engine.parameters()):
        levels = []
        if flat is not None and group_size(sync.group) > 1:
            levels.append(Level(sync.group, None, tuple(p.shape)))
        dim, group, whole = split.get(id(p), (None, None, None))
        if dim is not None and not (p.dim() == 3 and dim == 0) and group_size(group) > 1:
            if whole[dim] % group_size(group):
                raise ConfigError(f"--optimizer muon: {key} is split unevenly over {group_size(group)} ranks "
                                  f"({whole[dim]} along dimension {dim}); its pieces must be equal to be gathered")
            levels.append(Level(group, dim, whole))
        out[q] = levels
    return out
