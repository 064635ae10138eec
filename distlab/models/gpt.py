"""A decoder-only transformer (GPT-2's layout, Radford et al. 2019) small enough for CPU cores.

Token and position embeddings, ``n_layer`` blocks of pre-LayerNorm causal self-attention and MLP
with residual connections, a final LayerNorm and the LM head. Input: token ids ``(B, T)``;
output: logits ``(B, T, vocab)`` (loss: cross-entropy of position ``t``'s logits against token
``t + 1``, see :func:`distlab.models.task_loss`).

The skeleton -- embedding, blocks, head, attention, generation's cache, the parallel plans -- is every
decoder's (:mod:`distlab.models.decoder`); this file gives GPT's own parts: LayerNorms, a learned
position table, GELU MLPs (or mixtures of GELU experts), biases on the output projections.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from distlab.errors import ConfigError
from distlab.models import register
from distlab.models.contract import linear_plan
from distlab.models.decoder import Attention, Block, Decoder, Embedding, Head
from distlab.models.decoder_options import DecoderOptions
from distlab.models.moe import ExpertOptions, MoE
from distlab.models.spec import ModelSpec, option


class GPT(Decoder):
    """``GPT(vocab, block_size, n_layer, n_head, n_embd)``: token and learned position embeddings,
    ``n_layer`` pre-LayerNorm blocks (GELU MLPs of 4 x width), a final LayerNorm and the head.
    With ``experts`` E > 0 every block's MLP is a mixture of E experts, each token sent to
    ``top_k`` of them (:class:`~distlab.models.moe.MoE`; ``capacity_factor`` None is dropless)."""

    residual = ("attn.proj.weight", "mlp.2.weight", "experts.down_weight")
    splits = "attention heads, widths and the vocabulary"

    def __init__(self, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 128,
                 experts: int = 0, top_k: int = 2, capacity_factor: float | None = None, aux_coef: float = 0.01,
                 drop_policy: str = "position", qkv_bias: bool = False, gelu: str = "exact",
                 tie_embeddings: bool = False, context: int | None = None):
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, not {value}")
        moe = dict(experts=experts, top_k=top_k, capacity_factor=capacity_factor, aux_coef=aux_coef,
                   # named only when not the default: a snapshot of before it existed still resumes
                   **({"drop_policy": drop_policy} if drop_policy != "position" else {})) if experts else None
        approximate = "tanh" if gelu == "tanh" else "none"

        def block() -> Block:
            # No biases on q, k, v by default: a key bias shifts every score of a query equally, which softmax
            # ignores, so its gradient is pure rounding noise that Adam would blow up into lr-sized steps
            # (GPT-2's checkpoints have them: `qkv_bias`).
            return Block(nn.LayerNorm(n_embd), Attention(n_embd, n_head, n_head, qkv_bias, proj_bias=True),
                         nn.LayerNorm(n_embd), MoE(n_embd, **moe) if moe else nn.Sequential(
                             nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate=approximate),
                             nn.Linear(4 * n_embd, n_embd)))

        positions = max(context or block_size, block_size)  # the position table: the model's whole context
        super().__init__(Embedding(vocab, n_embd, positions=positions), (block() for _ in range(n_layer)),
                         Head(nn.LayerNorm(n_embd), n_embd, vocab), block_size=block_size, n_head=n_head,
                         kv_heads=n_head, n_embd=n_embd, moe=moe, tie_embeddings=tie_embeddings, context=positions)
        # GPT-2's own choices, recorded only when made (a snapshot of before they existed still resumes)
        self.choices = {k: v for k, v in (("qkv_bias", qkv_bias), ("gelu", gelu), ("tie_embeddings", tie_embeddings))
                        if v != {"gelu": "exact"}.get(k, False)}

    def record(self) -> dict:
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd, "block_size": self.block_size,
                **self.moe_options, **self.choices}

    def split_counts(self) -> tuple[tuple[str, int], ...]:
        return (("`n_embd`", self.n_embd),)

    def mlp_plan(self, i: int, style: str) -> dict[str, str]:
        """The MLP as :func:`~distlab.models.plans.linear_plan` splits it (Megatron: up column-, down
        row-parallel; naive: each gathered)."""
        return linear_plan(self[i].mlp, f"{i}.mlp", style)


@dataclass(frozen=True)
class GPTOptions(DecoderOptions):
    """The decoder's sizes (``gpt``)."""

    qkv_bias: bool = option(False, "gpt, llama: biases on the query, key and value projections (GPT-2's, Qwen2's).")
    gelu: str = option("exact", "gpt: the MLP's GELU, exact or tanh (GPT-2's approximation, its gelu_new).")

    def check(self) -> None:
        super().check()
        if self.gelu not in ("exact", "tanh"):
            raise ConfigError(f"`gelu` is exact or tanh (GPT-2's approximation), not {self.gelu!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"`n_embd` {self.n_embd} must be divisible by `n_head` {self.n_head} (each head gets "
                              f"n_embd / n_head dimensions)")

    def describe(self) -> str:
        return (f"{self.n_layer} blocks, {self.n_head} heads, width {self.n_embd}"
                + (", q/k/v biases" if self.qkv_bias else "") + (", tanh GELU" if self.gelu == "tanh" else "")
                + (", tied embeddings" if self.tie_embeddings else ""))

    def experts_options(self) -> dict:
        """:class:`GPT`'s mixture-of-experts arguments (none: dense MLPs)."""
        return {}


@dataclass(frozen=True)
class GPTMoEOptions(ExpertOptions, GPTOptions):
    """``gpt-moe``'s: the decoder's sizes and its mixture-of-experts MLPs."""


def _build(shape, vocab, o: GPTOptions) -> GPT:
    return GPT(vocab, shape[0], o.n_layer, o.n_head, o.n_embd, **o.experts_options(), qkv_bias=o.qkv_bias, gelu=o.gelu,
               tie_embeddings=o.tie_embeddings, context=o.context)


register(ModelSpec("gpt", _build, GPTOptions, text=True))
register(ModelSpec("gpt-moe", _build, GPTMoEOptions, text=True, summary="mixture of experts"))
