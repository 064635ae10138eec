"""What every layer may ask of a model: one documented base, :class:`ModelContract`, with a default
for each member -- the way a component kind is a typed contract (:class:`distlab.parallel.protocols.ComponentKind`).

distlab's families inherit it (:class:`distlab.models.decoder.Decoder`). A model of your own need not:
:func:`contract` makes any ``nn.Module`` one in place, with the methods its class defines winning over
the defaults (its class gains the base after its own, in Python's method order) -- so a plain
``nn.Sequential`` checkpoints and pipelines child by child, and a class that writes its own
``tensor_parallel_plan`` is split by it. Code in ``parallel/``, ``plan/``, ``train/`` and ``models/``
calls the members directly, never ``getattr``/``hasattr`` by name (``tests/test_architecture.py``).

The whole model:

=================================================  ================================================================
member                                             default, and what it means
=================================================  ================================================================
``block_size``                                     0: the sequence length the model is trained on (a language
                                                   model's window; 0: it does not read sequences)
``context``                                        0: the longest sequence it can read (its positions: a
                                                   checkpoint's ``max_position_embeddings``); 0: its block size
``decode(idx, cache, start)``                      generation with a key/value cache; refused by default
``cacheable``                                      False: whether :meth:`decode` gives what the whole window gives
``packable``                                       False: whether it reads packed windows (``--pack``)
``kv_share(tp)``                                   None: the share of the key/value heads one of ``tp`` ranks holds
                                                   where it is not ``1 / tp`` (heads kept whole, see ``tensor_rank``)
``snapshot_record()``                              ``{}``: the sizes a snapshot must agree on to be resumed
``flops_per_token()``                              None: training FLOPs per token (what tokens/s becomes MFU with)
``checkpoint_blocks()``                            an ``nn.Sequential``'s children, else those of each
                                                   ``nn.Sequential`` it holds directly
``pipeline_layers()``                              an ``nn.Sequential``'s children, in order
``tensor_parallel_plan(tp, style, sp)``            an ``nn.Sequential``'s Linear layers paired
                                                   (:func:`distlab.models.plans.linear_plan`), else none
``context_parallel_plan(cp, style, tp)``           none
``expert_parallel_plan(ep)``                       none
=================================================  ================================================================

A module a plan names (made one by :func:`contract` where the parallelism asks):

=================================  ============================================================================
``causal``                         True: an attention core (``context_attention``) masks the future
``window``                         None: an attention core's query sees every earlier key; N: itself and the
                                   N - 1 keys before it (a sliding window; :func:`attend` computes it)
``scale``                          None: an attention core scales scores by ``1 / sqrt(head width)``; else by it
``reads_positions``                False: a module called with positions ``0..t-1`` (a rotary table) for
                                   ``context_positions`` (an ``nn.Embedding`` always is one)
``packing``                        None: a module that reads a packed batch's structure holds the
                                   :class:`~distlab.models.packing.Packing` slot it reads (``bind`` fills it)
``tensor_rank(rank, size)``        a ``tensor_rank`` module takes its share of the group; refused by default
=================================  ============================================================================

Every plan method may raise :class:`~distlab.errors.ConfigError` naming the numbers that do not fit
(the settings check calls them on the model built on the meta device, before launch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError


class ModelContract:
    """The members of the module docstring, each with its default; a family overrides what is its own."""

    block_size: int = 0
    context: int = 0
    cacheable: bool = False
    causal: bool = True
    window: int | None = None
    scale: float | None = None
    reads_positions: bool = False
    packing = None  # the Packing slot it reads a packed batch's structure from (distlab.models.packing)
    packable: bool = False  # it reads packed windows (several records, each at its own positions, attending to
    # itself only: distlab.models.packing)

    def decode(self, idx, cache, start: int):
        raise ConfigError(f"{type(self).__name__} has no decode(idx, cache, start): generate without the cache")

    def kv_share(self, tp: int) -> float | None:
        return None

    def snapshot_record(self) -> dict:
        return {}

    def flops_per_token(self) -> float | None:
        return None

    def checkpoint_blocks(self) -> list:
        if isinstance(self, nn.Sequential):
            return [(self, [(i, i + 1) for i in range(len(self))])]
        held = [m for m in self.children() if isinstance(m, nn.Sequential) and len(m)]
        if held:
            return [(m, [(i, i + 1) for i in range(len(m))]) for m in held]
        raise ConfigError(f"activation checkpointing recomputes blocks: {type(self).__name__} is not an nn.Sequential, "
                          f"holds none and has no checkpoint_blocks() listing them")

    def pipeline_layers(self) -> list:
        if isinstance(self, nn.Sequential):
            return [(str(i), layer) for i, layer in enumerate(self)]
        raise ConfigError(f"a pipeline cuts a model into consecutive layers: {type(self).__name__} is not an "
                          f"nn.Sequential and has no pipeline_layers() listing its layers in order")

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        return linear_plan(self, "", style) if isinstance(self, nn.Sequential) else {}

    def context_parallel_plan(self, cp: int, style: str, tp: int = 1) -> dict[str, str]:
        return {}

    def expert_parallel_plan(self, ep: int) -> dict[str, str]:
        return {}

    def tensor_rank(self, rank: int, size: int) -> None:
        raise ConfigError(f"tensor-parallel plan: {type(self).__name__} is tensor_rank but has no "
                          f"tensor_rank(rank, size) method")


class SplitEmbedding(nn.Module):
    """A ``sequence_embedding`` module: its token rows come from ``tok`` (which tensor parallel splits by
    vocabulary) and its forward places them (scale, positions) at ``part x rows`` onwards -- 0 on one
    process; under sequence parallel ``tok`` returns this rank's piece of the sequence and ``part`` is the
    rank, so the family's own forward gives that piece's positions."""

    part: int = 0


class SequenceStatistics(nn.Module):
    """A module that computes statistics of whole sequences (a mixture of experts' routing counts): where a
    parallelism splits a sequence (context, sequence parallel) it sets ``sequence_group`` to the ranks
    holding the other parts, over which the module completes them, and ``sequence_grad`` to how its
    parameters' gradients are reduced there ("sum" under sequence parallel)."""

    sequence_group = None
    sequence_grad = "mean"


def _reduce_ex(self, protocol):
    """Pickled as the class it was before :func:`contract` (an adopted class is made at run time and
    cannot be found by name), adopted again when loaded."""
    plain = object.__new__(type(self).__mro__[1])
    plain.__dict__.update(self.__dict__)
    return contract, (plain,)


def linear_plan(container: nn.Sequential, prefix: str, style: str, keep_last: bool = True) -> dict[str, str]:
    """The plan of the ``nn.Linear`` layers of ``container`` (named ``prefix.i``), with only
    element-wise layers between them. Megatron: consecutive Linears pair up as (``colwise``,
    ``rowwise``): one all-reduce per pair forward; naive: each Linear ``colwise_gather``. With
    ``keep_last`` the last Linear that is left over -- a classifier head -- stays whole."""
    linears = [i for i, m in enumerate(container) if isinstance(m, nn.Linear)]
    name = (lambda i: f"{prefix}.{i}") if prefix else str
    if style == "megatron":
        pairs = list(zip(linears[0::2], linears[1::2]))
        return {k: v for a, b in pairs for k, v in ((name(a), "colwise"), (name(b), "rowwise"))}
    return {name(i): "colwise_gather" for i in (linears[:-1] if keep_last else linears)}



_ADOPTED: dict[type, type] = {}


def contract(module: nn.Module) -> nn.Module:
    """``module`` as a :class:`ModelContract` -- itself where it is one, else the same object with its class
    given the base after its own (its own methods first, the defaults for the rest); idempotent."""
    if isinstance(module, ModelContract):
        return module
    cls = type(module)
    if cls not in _ADOPTED:
        _ADOPTED[cls] = type(cls.__name__, (cls, ModelContract), {"__module__": cls.__module__,
                                                                   "__qualname__": cls.__qualname__,
                                                                   "__reduce_ex__": _reduce_ex})
    module.__class__ = _ADOPTED[cls]
    return module


def declares(module: nn.Module, member: str) -> bool:
    """Whether ``module``'s own class (not the base) defines ``member`` -- a plan it wrote, not the default."""
    return any(member in vars(k) for k in type(contract(module)).__mro__ if k is not ModelContract and k is not object)


__all__ = ["ModelContract", "SequenceStatistics", "SplitEmbedding", "contract", "declares", "linear_plan"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
           window: int | None = None, scale: float | None = None, records: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``(B, H, tq, D)`` over ``k``, ``v`` ``(B, H_kv, tk, D)`` (each
    key/value head serving ``H / H_kv`` query heads), the queries the last ``tq`` of the ``tk`` positions
    (a key/value cache before them): causal, each query seeing itself and the keys before it -- only the
    ``window - 1`` nearest where a sliding ``window`` is given (transformers' ``kv_idx > q_idx - window``)
    -- or, not ``causal``, every key; scores scaled by ``scale`` (default ``1 / sqrt(D)``); in a packed
    window (``records`` ``(B, t)``: which record each position is in) only its own record's keys. Without a
    window that cuts anything or records, the fused causal kernel."""
    tq, tk = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if records is not None:  # a document-causal mask: the record's own keys only
        i = torch.arange(tk - tq, tk, device=q.device)[:, None]
        j = torch.arange(tk, device=q.device)[None, :]
        seen = (records[:, None, -tq:, None] == records[:, None, None, :]) & ((j <= i) if causal else True)
        if window is not None:
            seen = seen & (j > i - window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=gqa, scale=scale)
    if window is None or tk <= window:
        if causal and tq not in (tk, 1):
            raise ValueError(f"attend: {tq} queries over {tk} keys (a cache before them): give one query at a time")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and tq == tk, enable_gqa=gqa, scale=scale)
    if not causal:
        raise ConfigError("a sliding window is a causal attention's: this attention sees every key")
    i = torch.arange(tk - tq, tk, device=q.device)[:, None]
    j = torch.arange(tk, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window), enable_gqa=gqa,
                                          scale=scale)
