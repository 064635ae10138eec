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

The model is one ``nn.Sequential`` (embedding, blocks, head), so a pipeline can cut it between any two
layers; attention keeps q, k and v as separate ``Linear`` layers so tensor parallel gives each rank
whole query heads and whole key/value groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, make_dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models import register
from distlab.models.gpt import EXPERT_FIELDS, check_experts, describe_experts, init_decoder
from distlab.models.plans import decoder_expert_plan, decoder_tensor_plan
from distlab.models.hf_families import HFLlama
from distlab.models.spec import ModelSpec, Options, option


class RotaryTable(nn.Module):
    """``forward(positions) -> (cos, sin)``, each ``(t, head_dim)``: the rotation angles of those
    positions (float32; no parameters, so every layout holds it whole)."""

    reads_positions = True  # context parallel's context_positions: called with the positions 0..t-1

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions pair a head's dimensions: head_dim {head_dim} must be even")
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=positions.device,
                                                      dtype=torch.float32) / self.head_dim))
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, t, D)`` rotated by the angles (rotate-half layout), in float32, back in ``x``'s dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class GroupedAttention(nn.Module):
    """Causal attention of ``(q, k, v)``, ``(B, H, t, D)`` and ``(B, H_kv, t, D)``, each key/value head
    serving ``H / H_kv`` query heads (context parallel puts its ring or all-to-all version here)."""

    causal = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class LlamaAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, kv_heads: int, theta: float, qkv_bias: bool = False):
        super().__init__()
        self.head_dim = n_embd // n_head
        self.enter = nn.Identity()  # where a parallel region begins when tensor parallel splits the heads
        self.q = nn.Linear(n_embd, n_head * self.head_dim, bias=qkv_bias)
        self.k = nn.Linear(n_embd, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(n_embd, kv_heads * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd, bias=False)
        self.rotary = RotaryTable(self.head_dim, theta)
        self.core = GroupedAttention()
        self.n_head, self.kv_heads = n_head, kv_heads
        self.kv_index: list[int] | None = None  # tensor parallel with the key/value heads whole: the ones used here

    def tensor_rank(self, rank: int, size: int) -> None:
        """Tensor parallel where ``size`` does not divide the key/value heads (they stay whole on every rank,
        :meth:`Llama.tensor_parallel_plan`): keep those this rank's query heads read (:func:`kv_heads_read`)."""
        self.kv_index = kv_heads_read(self.n_head, self.kv_heads, rank, size)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``'s queries, keys and values as ``(B, heads, t, D)``: this rank's heads (all, or its share)."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads, groups = q.shape[-1] // d, k.shape[-1] // d
        q = q.view(b, t, heads, d).transpose(1, 2)
        k, v = (z.view(b, t, groups, d).transpose(1, 2) for z in (k, v))
        if self.kv_index is not None:
            k, v = k[:, self.kv_index], v[:, self.kv_index]
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)  # under sequence parallel this gathers the whole sequence
        b, t, _ = x.shape
        q, k, v = self._heads(x)
        heads, d = q.shape[1], self.head_dim
        cos, sin = self.rotary(torch.arange(t, device=x.device))
        y = self.core(rotate(q, cos, sin), rotate(k, cos, sin), v)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * d))

    def decode(self, x: torch.Tensor, past: tuple | None, start: int) -> tuple[torch.Tensor, tuple]:
        """Generation's step with a key/value cache: ``x`` the new tokens at positions ``start..``, ``past``
        the earlier ones' rotated keys and values (None: a prefill, causal over ``x``; else ``x`` is one
        token, which sees every cached key). Returns the output and the cache with ``x``'s appended."""
        b, t, _ = x.shape
        q, k, v = self._heads(x)
        heads, groups, d = q.shape[1], k.shape[1], self.head_dim
        cos, sin = self.rotary(torch.arange(start, start + t, device=x.device))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None, enable_gqa=groups != heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * d)), (k, v)


def kv_heads_read(n_head: int, kv_heads: int, rank: int, size: int) -> list[int]:
    """The key/value heads tensor-parallel rank ``rank`` of ``size`` holds when they are not split: its query
    heads are ``n_head / size`` consecutive ones, and it keeps the key/value heads they read -- each once
    where they read them in equal runs (one head each for ``size`` a multiple of ``kv_heads``, grouped-query
    attention as usual), else one per query head (plain multi-head attention over copies)."""
    per, group = n_head // size, n_head // kv_heads
    read = [h // group for h in range(rank * per, (rank + 1) * per)]
    distinct = list(dict.fromkeys(read))
    runs = per // len(distinct) if per % len(distinct) == 0 else 0
    return distinct if runs and read == [h for h in distinct for _ in range(runs)] else read


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.enter = nn.Identity()  # where the parallel region begins under tensor parallel
        self.gate = nn.Linear(n_embd, hidden, bias=False)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, kv_heads: int, hidden: int, theta: float, eps: float,
                 qkv_bias: bool = False, moe: dict | None = None):
        super().__init__()
        self.ln1 = nn.RMSNorm(n_embd, eps=eps)
        self.attn = LlamaAttention(n_embd, n_head, kv_heads, theta, qkv_bias)
        self.ln2 = nn.RMSNorm(n_embd, eps=eps)
        if moe:  # a mixture of SwiGLU experts (Mixtral's layout)
            from distlab.models.moe import MoE, SwiGLUExperts
            self.mlp = MoE(n_embd, hidden=hidden, expert_kind=SwiGLUExperts, **moe)
        else:
            self.mlp = SwiGLU(n_embd, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: torch.Tensor, past: tuple | None, start: int) -> tuple[torch.Tensor, tuple]:
        h, cache = self.attn.decode(self.ln1(x), past, start)
        x = x + h
        return x + self.mlp(self.ln2(x)), cache


class TokenEmbedding(nn.Module):
    """The token embedding alone (positions are rotary, inside attention)."""

    def __init__(self, vocab: int, n_embd: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx)


class LlamaHead(nn.Module):
    """Final RMSNorm and the projection to vocabulary logits."""

    def __init__(self, n_embd: int, vocab: int, eps: float):
        super().__init__()
        self.ln = nn.RMSNorm(n_embd, eps=eps)
        self.enter = nn.Identity()  # where the vocabulary-parallel region begins under tensor parallel
        self.out = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enter(self.ln(x)))


class Llama(nn.Sequential):
    """``Llama(vocab, block_size, n_layer, n_head, kv_heads, n_embd, ffn_hidden, ...)``: embedding,
    ``n_layer`` blocks, head (untied: the LM head has its own matrix)."""

    def __init__(self, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 4, kv_heads: int = 2,
                 n_embd: int = 128, ffn_hidden: int | None = None, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, qkv_bias: bool = False, moe: dict | None = None,
                 tie_embeddings: bool = False):
        hidden = ffn_hidden or default_hidden(n_embd)
        super().__init__(TokenEmbedding(vocab, n_embd),
                         *(LlamaBlock(n_embd, n_head, kv_heads, hidden, rope_theta, norm_eps, qkv_bias, moe)
                           for _ in range(n_layer)),
                         LlamaHead(n_embd, vocab, norm_eps))
        self.qkv_bias, self.moe_options, self.tie_embeddings = qkv_bias, dict(moe or {}), tie_embeddings
        if tie_embeddings:  # one matrix: the head's logits are the hidden state's scores against every embedding
            self[-1].out.weight = self[0].tok.weight
        self.experts = self.moe_options.get("experts", 0)
        self.block_size, self.n_layer, self.n_head, self.kv_heads = block_size, n_layer, n_head, kv_heads
        self.n_embd, self.ffn_hidden, self.rope_theta, self.norm_eps = n_embd, hidden, rope_theta, norm_eps
        self._init_weights()

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: list | None, start: int) -> tuple[torch.Tensor, list]:
        """Logits of the new tokens ``idx`` at positions ``start..`` given every block's key/value ``cache``
        of the tokens before (None: a prefill); and the cache with them (:mod:`distlab.models.generation`)."""
        x = self[0](idx)
        new = []
        for i, block in enumerate(list(self)[1:-1]):
            x, kv = block.decode(x, cache[i] if cache else None, start)
            new.append(kv)
        return self[-1](x), new

    def snapshot_record(self) -> dict:
        """The sizes a snapshot of this model must agree on (:mod:`distlab.models.plans`)."""
        return {"n_layer": self.n_layer, "n_head": self.n_head, "kv_heads": self.kv_heads, "n_embd": self.n_embd,
                "ffn_hidden": self.ffn_hidden, "rope_theta": self.rope_theta, "norm_eps": self.norm_eps,
                "block_size": self.block_size, **({"qkv_bias": True} if self.qkv_bias else {}),
                **({"tie_embeddings": True} if self.tie_embeddings else {}), **self.moe_options}

    @property
    def cacheable(self) -> bool:
        """Whether :meth:`decode` gives what the whole window gives (not where experts drop over capacity)."""
        return self.moe_options.get("capacity_factor") is None

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM's count): 6 x the weights of the matrix multiplications a token
        passes through (q, k, v, output, the MLP's three, the LM head; not the embedding lookup or the
        norms) + 12 x layers x width x block size (scores and weighted values over every key)."""
        weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        weights += sum(self.moe_options["top_k"] * m.active_weights() for m in self.modules()
                       if hasattr(m, "active_weights"))  # the experts a token is routed to
        return float(6 * weights + 12 * self.n_layer * self.n_embd * self.block_size)

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the transformer blocks (not the embedding or the head)."""
        return [(self, [(i, i + 1) for i in range(1, len(self) - 1)])]

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        """Tensor parallel's plan (Megatron-LM's layout): the token embedding and the LM head split by
        vocabulary; attention by heads -- query heads and key/value groups alike (q, k, v column
        parallel after one region entry, the projection row parallel); where ``tp`` does not divide
        the key/value heads they stay whole on every rank (``replicated``: each rank uses those its
        query heads read, the gradients summed over the group -- Megatron-LM's and torchtitan's
        replication for ``tp`` above the key/value heads); the SwiGLU's gate and up column parallel,
        down row parallel (naive: each column parallel, gathered); under sequence parallel the RMSNorms
        see ``block_size / tp`` positions."""
        def mlp(i: int) -> dict[str, str]:
            if self.experts:  # experts stay whole on every tensor-parallel rank (expert parallel splits them)
                return {f"{i}.mlp": "sequence_stats"}
            if style == "megatron":
                return {f"{i}.mlp.enter": "enter", f"{i}.mlp.gate": "colwise_entered", f"{i}.mlp.up": "colwise_entered",
                        f"{i}.mlp.down": "rowwise"}
            return {f"{i}.mlp.{n}": "colwise_gather" for n in ("gate", "up", "down")}
        whole_kv = self.kv_heads % tp != 0
        counts = (("`n_head`", self.n_head), *((("`kv_heads`", self.kv_heads),) if not whole_kv else ()),
                  *((("`ffn_hidden`", self.ffn_hidden),) if not self.experts else ()),
                  ("the vocabulary", self[0].tok.num_embeddings))
        plan = decoder_tensor_plan(self, tp, sequence_parallel, "query heads, key/value heads, the MLP and the "
                                   "vocabulary", counts, mlp)
        if whole_kv:
            for i in range(1, len(self) - 1):
                plan |= {f"{i}.attn.k": "replicated", f"{i}.attn.v": "replicated", f"{i}.attn": "tensor_rank"}
        return plan

    def kv_heads_per_rank(self, tp: int) -> int:
        """The key/value heads a tensor-parallel rank's attention holds (:meth:`LlamaAttention.tensor_rank`)."""
        if self.kv_heads % tp == 0:
            return self.kv_heads // tp
        return len(kv_heads_read(self.n_head, self.kv_heads, 0, tp))

    def context_parallel_plan(self, cp: int, style: str, tp: int = 1) -> dict[str, str]:
        """Context parallel's plan: every block's rotary table reads the rank's global positions, its
        attention core runs over the whole sequence (ring, or all-to-all giving each of the ``cp``
        ranks whole query heads and whole key/value groups of this tensor-parallel rank's)."""
        if style == "ulysses":
            for what, heads in (("query heads", self.n_head // tp), ("key/value heads", self.kv_heads_per_rank(tp))):
                if heads % cp:
                    raise ConfigError(f"`cp_style` ulysses gives each of `cp` {cp} ranks whole heads: {heads} {what} "
                                      f"per tensor-parallel rank do not divide by {cp}; use `cp_style` ring")
        blocks = range(1, len(self) - 1)
        return {**{f"{i}.attn.rotary": "context_positions" for i in blocks},
                **{f"{i}.attn.core": "context_attention" for i in blocks},
                **{f"{i}.mlp": "context_sequence_stats" for i in blocks if self.experts}}

    def expert_parallel_plan(self, ep: int) -> dict[str, str]:
        """Expert parallel's plan: each block's experts sharded over the ``ep`` expert-parallel ranks."""
        return decoder_expert_plan(self, ep)

    def _init_weights(self) -> None:
        """N(0, 0.02) weights, the residual projections scaled by 1/sqrt(2 n_layer), norms at one, biases 0."""
        init_decoder(self, ("attn.proj.weight", "mlp.down.weight", "experts.down_weight"))


def default_hidden(n_embd: int) -> int:
    """Llama's MLP width for ``n_embd``: 2/3 of 4 x width, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


@dataclass(frozen=True)
class LlamaOptions(Options):
    """The decoder's sizes and its choices (``llama``)."""

    n_layer: int = option(2, "gpt: transformer blocks.")
    n_head: int = option(4, "gpt: attention heads per block (must divide --n-embd).")
    kv_heads: int = option(2, "llama: key/value heads (grouped-query attention; divides --n-head).")
    n_embd: int = option(128, "gpt: width of the residual stream.")
    ffn_hidden: int | None = option(None, "llama: SwiGLU hidden units (default: 8/3 x --n-embd, rounded up to a "
                                    "multiple of 64).")
    rope_theta: float = option(10000.0, "llama: rotary positions' base (Llama 2: 10000, Llama 3: 500000).")
    norm_eps: float = option(1e-5, "llama: RMSNorm's epsilon.")
    qkv_bias: bool = option(False, "gpt, llama: biases on the query, key and value projections (GPT-2's, Qwen2's).")
    tie_embeddings: bool = option(False, "gpt, llama: the LM head reuses the token embedding's matrix (GPT-2's, "
                                  "Llama 3.2 1B and 3B's, Qwen2's up to 1.5B).")

    def check(self) -> None:
        for name in ("n_layer", "n_head", "kv_heads", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be at least 1, not {getattr(self, name)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"`n_embd` {self.n_embd} must split into `n_head` {self.n_head} heads of an even width "
                              f"(rotary positions pair a head's dimensions)")
        if self.n_head % self.kv_heads:
            raise ConfigError(f"`kv_heads` {self.kv_heads} must divide `n_head` {self.n_head} (each key/value head "
                              f"serves the same number of query heads)")
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ConfigError(f"`ffn_hidden` must be at least 1, not {self.ffn_hidden}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ConfigError(f"`rope_theta` ({self.rope_theta:g}) and `norm_eps` ({self.norm_eps:g}) must be "
                              f"positive")

    @property
    def hidden(self) -> int:
        """The SwiGLU's hidden units: ``ffn_hidden``, or the default for the width."""
        return self.ffn_hidden or default_hidden(self.n_embd)

    def describe(self) -> str:
        return (f"{self.n_layer} blocks, {self.n_head} heads ({self.kv_heads} key/value), width {self.n_embd}, "
                f"SwiGLU {self.ffn_hidden or default_hidden(self.n_embd)}, rotary base {self.rope_theta:g}"
                + (", q/k/v biases" if self.qkv_bias else "") + (", tied embeddings" if self.tie_embeddings else ""))


def _moe_check(self) -> None:
    LlamaOptions.check(self)
    check_experts(self)


# ``llama-moe``: the Llama family with every block's MLP a mixture of SwiGLU experts (Mixtral's layout); the
# mixture's options and their checks are GPT-MoE's
LlamaMoEOptions = make_dataclass(
    "LlamaMoEOptions", [(f.name, f.type, field(default=f.default, metadata=f.metadata)) for f in EXPERT_FIELDS],
    bases=(LlamaOptions,), frozen=True,
    namespace={"check": _moe_check, "describe": lambda self: f"{LlamaOptions.describe(self)}, {describe_experts(self)}",
               "__module__": __name__})


def _build(shape, vocab, o: LlamaOptions) -> Llama:
    moe = dict(experts=o.experts, top_k=o.top_k, capacity_factor=o.capacity_factor, aux_coef=o.aux_coef,
               **({"drop_policy": o.drop_policy} if o.drop_policy != "position" else {})) \
        if isinstance(o, LlamaMoEOptions) else None
    return Llama(vocab, shape[0], o.n_layer, o.n_head, o.kv_heads, o.n_embd, o.ffn_hidden, o.rope_theta, o.norm_eps,
                 o.qkv_bias, moe, o.tie_embeddings)




register(ModelSpec("llama", _build, LlamaOptions, text=True, summary="rotary, RMSNorm, SwiGLU, grouped-query",
                        adapter=HFLlama))
register(ModelSpec("llama-moe", _build, LlamaMoEOptions, text=True, summary="with mixture-of-experts MLPs"))
