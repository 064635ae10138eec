"""Gemma 3's text decoder (``gemma3``; Hugging Face's ``Gemma3ForCausalLM``).

The decoder of every text family (:mod:`distlab.models.decoder`) with Gemma's own parts:

* **RMSNorm with (1 + w)** (:class:`GemmaNorm`): its weight starts at zeros and scales by ``1 + w``, in
  float32; one before and one *after* the attention and the MLP of each block (the shared
  :class:`~distlab.models.decoder.Block` given its norms after), each branch's output normed before it joins
  the residual stream.
* **Scaled embedding**: token rows times ``sqrt(n_embd)`` (kept by sequence parallel's split embedding),
  the LM head tied to them.
* **Attention**: grouped-query heads of their own width (``head_dim``), each query and key head normed
  (:class:`GemmaNorm`) before the rotation, scores scaled by ``query_pre_attn_scalar ** -0.5``; **local
  layers** see a sliding window with their own rotary base (``rope_local_theta``), one **global** layer in
  ``global_every`` sees the whole context with the global base (and its scaling, Gemma 3 4B and up:
  ``linear,factor=8``).
* **GeGLU**: ``down(gelu_tanh(gate(x)) * up(x))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models import register, rope
from distlab.models.decoder import (Attention, Block, Decoder, Embedding, GatedMLP, Head,
                                    gated_mlp_plan)
from distlab.models.decoder_options import DecoderOptions
from distlab.models.spec import ModelSpec, option


class GemmaNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight`` (the weight starts at zeros), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GeGLU(GatedMLP):
    """``down(gelu_tanh(gate(x)) * up(x))``."""

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class Gemma3(Decoder):
    """``Gemma3(vocab, block_size, ...)``: the scaled embedding, ``n_layer`` blocks normed after each branch too (local
    sliding-window layers and every ``global_every``-th a global one), a final :class:`GemmaNorm` and the
    head tied to the embedding (module docstring)."""

    residual = ("attn.proj.weight", "mlp.down.weight")
    splits = "query heads, key/value heads, the MLP and the vocabulary"

    def __init__(self, vocab: int, block_size: int, o: GemmaOptions):
        heads_width = o.head_dim * o.n_head

        def block(i: int) -> Block:
            full = o.is_global(i)
            attn = Attention(o.n_embd, o.n_head, o.kv_heads, theta=o.rope_theta if full else o.rope_local_theta,
                             rope_scaling=rope.parse(o.rope_scaling) if full else None,
                             window=None if full else o.sliding_window, head_dim=o.head_dim,
                             qk_norm=lambda d: GemmaNorm(d, o.norm_eps), scale=o.query_pre_attn_scalar ** -0.5)
            return Block(GemmaNorm(o.n_embd, o.norm_eps), attn, GemmaNorm(o.n_embd, o.norm_eps),
                         GeGLU(o.n_embd, o.ffn_hidden), post_attn=GemmaNorm(o.n_embd, o.norm_eps),
                         post_mlp=GemmaNorm(o.n_embd, o.norm_eps))

        super().__init__(Embedding(vocab, o.n_embd, scale=o.n_embd ** 0.5), (block(i) for i in range(o.n_layer)),
                         Head(GemmaNorm(o.n_embd, o.norm_eps), o.n_embd, vocab), block_size=block_size,
                         n_head=o.n_head, kv_heads=o.kv_heads, n_embd=o.n_embd, tie_embeddings=o.tie_embeddings,
                         context=o.context)
        self.options, self.heads_width = o, heads_width

    def record(self) -> dict:
        return {**self.options.to_dict(), "block_size": self.block_size}

    def split_counts(self) -> tuple[tuple[str, int], ...]:
        return (("`ffn_hidden`", self.options.ffn_hidden),)

    def mlp_plan(self, i: int, style: str) -> dict[str, str]:
        """The GeGLU's gate and up column parallel, down row parallel; the norms after each branch see what
        the norms before do (this rank's positions under sequence parallel)."""
        # (in the order they run: the norm after the MLP needs its output recomputed)
        return {f"{i}.post_attn": "sequence", **gated_mlp_plan(i, style), f"{i}.post_mlp": "sequence"}


@dataclass(frozen=True)
class GemmaOptions(DecoderOptions):
    """Gemma 3's sizes and choices (``gemma3``): small ones by default (one global block and five local ones, as
    Gemma 3 alternates them); its checkpoints' own come from their config.json (1B: 26 blocks x 1152, 4 heads and
    1 key/value head of 256, GeGLU 6912)."""

    n_layer: int = option(6, "gemma3: transformer blocks (Gemma 3 1B: 26).")
    kv_heads: int = option(1, "gemma3: key/value heads (grouped-query attention; divides --n-head; 1B: 1).")
    head_dim: int = option(32, "gemma3: each attention head's width (1B: 256).")
    ffn_hidden: int = option(512, "gemma3: GeGLU hidden units (1B: 6912).")
    rope_theta: float = option(1_000_000.0, "gemma3: the global layers' rotary base.")
    rope_local_theta: float = option(10_000.0, "gemma3: the local (sliding-window) layers' rotary base.")
    rope_scaling: str | None = option(None, "gemma3: the global layers' rotary scaling (4B and up: linear,factor=8).")
    sliding_window: int = option(512, "gemma3: the local layers' window (1B: 512).")
    global_every: int = option(6, "gemma3: every N-th block (the 6th, 12th ...) is global, the rest local.")
    query_pre_attn_scalar: float = option(256.0, "gemma3: attention scores scaled by its inverse square root.")
    norm_eps: float = option(1e-6, "gemma3: the RMSNorms' epsilon.")
    tie_embeddings: bool = option(True, "gemma3: the LM head reuses the token embedding's matrix.")
    positive = ("n_layer", "n_head", "kv_heads", "n_embd", "head_dim", "ffn_hidden", "sliding_window", "global_every")

    def is_global(self, i: int) -> bool:
        """Whether block ``i`` (from 0) attends to the whole context."""
        return (i + 1) % self.global_every == 0

    def check(self) -> None:
        super().check()
        if self.head_dim % 2:
            raise ConfigError(f"`head_dim` {self.head_dim} must be even (rotary positions pair a head's dimensions)")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"`kv_heads` {self.kv_heads} must divide `n_head` {self.n_head}")
        rope.parse(self.rope_scaling)
        for name in ("rope_theta", "rope_local_theta", "query_pre_attn_scalar", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"`{name}` must be positive, not {getattr(self, name):g}")

    def describe(self) -> str:
        return (f"{self.n_layer} blocks ({sum(self.is_global(i) for i in range(self.n_layer))} global, the rest "
                f"local over a window of {self.sliding_window}), {self.n_head} heads ({self.kv_heads} key/value) of "
                f"{self.head_dim}, width {self.n_embd}, GeGLU {self.ffn_hidden}, rotary bases {self.rope_theta:g} / "
                f"{self.rope_local_theta:g}" + (f" ({rope.describe(rope.parse(self.rope_scaling))} globally)"
                                                 if self.rope_scaling else "")
                + (", tied embeddings" if self.tie_embeddings else ""))


def _build(shape, vocab, o: GemmaOptions) -> Gemma3:
    return Gemma3(vocab, shape[0], o)


register(ModelSpec("gemma3", _build, GemmaOptions, text=True, summary="Gemma 3's text decoder"))
