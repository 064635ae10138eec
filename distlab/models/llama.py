"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2's layout): rotary positions, RMSNorm, SwiGLU MLPs
and grouped-query attention.

Token embedding, ``n_layer`` blocks of pre-RMSNorm causal self-attention and SwiGLU MLP with
residual connections, a final RMSNorm and the LM head (no biases anywhere). Input: token ids
``(B, T)``; output: logits ``(B, T, vocab)``.

* **Rotary positions** (Su et al. 2021) rotate each query and key head by its token's position, in
  the "rotate half" layout Hugging Face's checkpoints use (dimension ``i`` pairs with ``i + D/2``).
  The angles come from a :class:`RotaryTable` that every attention calls with its tokens' positions
  -- ``0..t-1``, or under context parallel the global positions of the rank's chunks (the table is
  the plan's ``context_positions``: forgetting that offset is the classic context-parallel bug).
* **Grouped-query attention**: ``kv_heads`` key/value heads, each shared by ``n_head / kv_heads``
  query heads (``scaled_dot_product_attention(enable_gqa=True)``; the ring and all-to-all attentions
  of context parallel take the groups as they are, so keys and values travel unrepeated).
* **SwiGLU**: ``down(silu(gate(x)) * up(x))`` with ``ffn_hidden`` units.

The skeleton -- embedding, blocks, head, the attention with its rotary table, generation's cache, the
parallel plans -- is every decoder's (:mod:`distlab.models.decoder`); this file gives the family's own
parts: RMSNorms, SwiGLU MLPs (or mixtures of SwiGLU experts), no biases but where a checkpoint has them
(Qwen2's on q, k and v; a Llama config's ``attention_bias`` and ``mlp_bias``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models import register, rope
from distlab.models.decoder import (Attention, Block, Decoder, Embedding, GatedMLP, Head,
                                    gated_mlp_plan)
from distlab.models.decoder_options import DecoderOptions
from distlab.models.moe import ExpertOptions
from distlab.models.spec import ModelSpec, option


class SwiGLU(GatedMLP):
    """``down(silu(gate(x)) * up(x))``."""

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)


class Llama(Decoder):
    """``Llama(vocab, block_size, n_layer, n_head, kv_heads, n_embd, ffn_hidden, ...)``: token embedding,
    ``n_layer`` pre-RMSNorm blocks (rotary grouped-query attention, SwiGLU MLPs or mixtures of SwiGLU
    experts), a final RMSNorm and the head."""

    residual = ("attn.proj.weight", "mlp.down.weight", "experts.down_weight")
    splits = "query heads, key/value heads, the MLP and the vocabulary"

    def __init__(self, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 4, kv_heads: int = 2,
                 n_embd: int = 128, ffn_hidden: int | None = None, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, qkv_bias: bool = False, moe: dict | None = None,
                 tie_embeddings: bool = False, context: int | None = None, rope_scaling: str | None = None,
                 sliding_window: int | None = None, full_layers: tuple[int, ...] = (), head_dim: int | None = None,
                 qk_norm: bool = False, proj_bias: bool = False, mlp_bias: bool = False):
        hidden = ffn_hidden or default_hidden(n_embd)
        scaling = rope.parse(rope_scaling)

        def mlp() -> nn.Module:
            if moe:  # a mixture of SwiGLU experts (Mixtral's layout)
                from distlab.models.moe import MoE, SwiGLUExperts
                return MoE(n_embd, hidden=hidden, expert_kind=SwiGLUExperts, **moe)
            return SwiGLU(n_embd, hidden, mlp_bias)

        blocks = (Block(nn.RMSNorm(n_embd, eps=norm_eps),
                        Attention(n_embd, n_head, kv_heads, qkv_bias, proj_bias=proj_bias, theta=rope_theta,
                                  rope_scaling=scaling, window=None if i in full_layers else sliding_window,
                                  head_dim=head_dim, qk_norm=(lambda d: nn.RMSNorm(d, eps=norm_eps)) if qk_norm else None),
                        nn.RMSNorm(n_embd, eps=norm_eps), mlp()) for i in range(n_layer))
        super().__init__(Embedding(vocab, n_embd), blocks, Head(nn.RMSNorm(n_embd, eps=norm_eps), n_embd, vocab),
                         block_size=block_size, n_head=n_head, kv_heads=kv_heads, n_embd=n_embd, moe=moe,
                         tie_embeddings=tie_embeddings, context=context)
        self.ffn_hidden, self.rope_theta, self.norm_eps, self.qkv_bias = hidden, rope_theta, norm_eps, qkv_bias
        self.rope_scaling = rope.text(scaling)
        self.sliding_window, self.full_layers = sliding_window, tuple(full_layers)
        self.head_dim, self.qk_norm, self.proj_bias, self.mlp_bias = head_dim, qk_norm, proj_bias, mlp_bias

    def record(self) -> dict:
        return {"n_layer": self.n_layer, "n_head": self.n_head, "kv_heads": self.kv_heads, "n_embd": self.n_embd,
                "ffn_hidden": self.ffn_hidden, "rope_theta": self.rope_theta, "norm_eps": self.norm_eps,
                "block_size": self.block_size, **({"qkv_bias": True} if self.qkv_bias else {}),
                **({"rope_scaling": self.rope_scaling} if self.rope_scaling else {}),
                **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
                **({"full_layers": list(self.full_layers)} if self.full_layers else {}),
                **({"head_dim": self.head_dim} if self.head_dim else {}), **({"qk_norm": True} if self.qk_norm else {}),
                **({"proj_bias": True} if self.proj_bias else {}), **({"mlp_bias": True} if self.mlp_bias else {}),
                **({"tie_embeddings": True} if self.tie_embeddings else {}), **self.moe_options}

    def split_counts(self) -> tuple[tuple[str, int], ...]:
        return (("`ffn_hidden`", self.ffn_hidden),) if not self.experts else ()

    def mlp_plan(self, i: int, style: str) -> dict[str, str]:
        """The SwiGLU's gate and up column parallel, down row parallel (naive: each column parallel, gathered)."""
        return gated_mlp_plan(i, style)


def default_hidden(n_embd: int) -> int:
    """Llama's MLP width for ``n_embd``: 2/3 of 4 x width, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


@dataclass(frozen=True)
class LlamaOptions(DecoderOptions):
    """The decoder's sizes and its choices (``llama``)."""

    kv_heads: int = option(2, "llama: key/value heads (grouped-query attention; divides --n-head).")
    ffn_hidden: int | None = option(None, "llama: SwiGLU hidden units (default: 8/3 x --n-embd, rounded up to a "
                                    "multiple of 64).")
    rope_theta: float = option(10000.0, "llama: rotary positions' base (Llama 2: 10000, Llama 3: 500000).")
    rope_scaling: str | None = option(None, "llama: rotary positions stretched to a longer context, as a "
                                      "checkpoint's rope_scaling: TYPE,KEY=VALUE,... with its keys -- llama3,factor=8,"
                                      "original_max_position_embeddings=8192 (Llama 3.1+), linear,factor=4, or yarn,"
                                      "factor=4,original_max_position_embeddings=32768 (Qwen2.5).")
    sliding_window: int | None = option(None, "llama: each token attends to itself and the N - 1 before it "
                                        "(Mistral 7B v0.1: 4096; default: the whole context).")
    full_layers: tuple[int, ...] = option((), "llama: with --sliding-window, the blocks (from 0) that attend to the "
                                          "whole context, comma-separated (Qwen2's below max_window_layers).",
                                          csv=True)
    head_dim: int | None = option(None, "llama: each attention head's width where it is not --n-embd / --n-head "
                                  "(Qwen3's: 128 at every size).")
    qk_norm: bool = option(False, "llama: an RMSNorm of each query and key head before the rotation (Qwen3's).")
    norm_eps: float = option(1e-5, "llama: RMSNorm's epsilon.")
    qkv_bias: bool = option(False, "gpt, llama: biases on the query, key and value projections (GPT-2's, Qwen2's).")
    proj_bias: bool = option(False, "llama: a bias on the attention's output projection (a Llama config's "
                             "attention_bias puts one on q, k, v and o).")
    mlp_bias: bool = option(False, "llama: biases on the SwiGLU's gate, up and down projections (mlp_bias).")
    positive = ("n_layer", "n_head", "kv_heads", "n_embd")

    def check(self) -> None:
        super().check()
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ConfigError(f"`head_dim` must be even and at least 2, not {self.head_dim} (rotary positions pair a "
                              f"head's dimensions)")
        if self.head_dim is None and (self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2):
            raise ConfigError(f"`n_embd` {self.n_embd} must split into `n_head` {self.n_head} heads of an even width "
                              f"(rotary positions pair a head's dimensions), or give `head_dim`")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"`kv_heads` {self.kv_heads} must divide `n_head` {self.n_head} (each key/value head "
                              f"serves the same number of query heads)")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ConfigError(f"`ffn_hidden` must be at least 1, not {self.ffn_hidden}")
        rope.parse(self.rope_scaling)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"`sliding_window` must be at least 1, not {self.sliding_window}")
        if self.full_layers and self.sliding_window is None:
            raise ConfigError("`full_layers` names the blocks a sliding window spares: give `sliding_window` too")
        if any(not 0 <= i < self.n_layer for i in self.full_layers):
            raise ConfigError(f"`full_layers` {','.join(map(str, self.full_layers))}: the blocks are 0 to "
                              f"{self.n_layer - 1}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError(f"`rope_theta` ({self.rope_theta:g}) and `norm_eps` ({self.norm_eps:g}) must be "
                              f"positive")

    @property
    def hidden(self) -> int:
        """The SwiGLU's hidden units: ``ffn_hidden``, or the default for the width."""
        return self.ffn_hidden or default_hidden(self.n_embd)

    def describe(self) -> str:
        return (f"{self.n_layer} blocks, {self.n_head} heads ({self.kv_heads} key/value)"
                + (f" of {self.head_dim}" if self.head_dim else "") + (", q/k norms" if self.qk_norm else "")
                + f", width {self.n_embd}, "
                f"SwiGLU {self.ffn_hidden or default_hidden(self.n_embd)}, rotary base {self.rope_theta:g}"
                + (f" ({rope.describe(rope.parse(self.rope_scaling))})" if self.rope_scaling else "")
                + (f", sliding window {self.sliding_window} (masked only where a sequence is longer"
                   + (f"; blocks {','.join(map(str, self.full_layers))} see it whole" if self.full_layers else "")
                   + ")" if self.sliding_window else "")
                + (", q/k/v biases" if self.qkv_bias else "") + (", output bias" if self.proj_bias else "")
                + (", MLP biases" if self.mlp_bias else "") + (", tied embeddings" if self.tie_embeddings else ""))


@dataclass(frozen=True)
class LlamaMoEOptions(ExpertOptions, LlamaOptions):
    """``llama-moe``: the Llama family with every block's MLP a mixture of SwiGLU experts (Mixtral's layout);
    the mixture's options and their checks are every family's (:class:`~distlab.models.moe.ExpertOptions`)."""


def _build(shape, vocab, o: LlamaOptions) -> Llama:
    moe = o.experts_options() if isinstance(o, LlamaMoEOptions) else None
    return Llama(vocab, shape[0], o.n_layer, o.n_head, o.kv_heads, o.n_embd, o.ffn_hidden, o.rope_theta, o.norm_eps,
                 o.qkv_bias, moe, o.tie_embeddings, o.context, o.rope_scaling, o.sliding_window, o.full_layers,
                 o.head_dim, o.qk_norm, o.proj_bias, o.mlp_bias)


register(ModelSpec("llama", _build, LlamaOptions, text=True, summary="rotary, RMSNorm, SwiGLU, grouped-query"))
register(ModelSpec("llama-moe", _build, LlamaMoEOptions, text=True, summary="with mixture-of-experts MLPs"))
