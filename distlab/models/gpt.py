"""A decoder-only transformer (GPT-2's layout, Radford et al. 2019) small enough for CPU cores.

Token and position embeddings, ``n_layer`` blocks of pre-LayerNorm causal self-attention and MLP
with residual connections, a final LayerNorm and the LM head. Input: token ids ``(B, T)``;
output: logits ``(B, T, vocab)`` (loss: cross-entropy of position ``t``'s logits against token
``t + 1``, see :func:`distlab.models.task_loss`).

The model is one ``nn.Sequential`` (embedding, blocks, head), so a pipeline can cut it between
any two layers. Attention keeps its query, key and value projections as separate ``Linear``
layers and reads the number of heads from their width, so tensor parallel can give each rank
whole heads by splitting the three column-wise and the output projection row-wise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from distlab.errors import ConfigError
from distlab.models.moe import MoE
from distlab.models import register
from distlab.models.plans import decoder_expert_plan, decoder_tensor_plan, linear_plan
from distlab.models.hf_families import HFGPT2
from distlab.models.spec import ModelSpec, Options, option


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, vocab: int, block_size: int, n_embd: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(f"sequence of {t} tokens is longer than the model's block size {self.pos.num_embeddings}")
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device))


class CausalAttention(nn.Module):
    """Causal scaled dot-product attention of ``(q, k, v)``, each ``(B, H, T, D)`` (context parallel
    puts its ring or all-to-all version here, causal as :attr:`causal` says)."""

    causal = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, qkv_bias: bool = False):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} must be divisible by n_head {n_head}")
        self.head_dim = n_embd // n_head
        self.enter = nn.Identity()  # where a parallel region begins when tensor parallel splits the heads
        # No biases on q, k, v by default: a key bias shifts every score of a query equally, which softmax
        # ignores, so its gradient is pure rounding noise that Adam would blow up into lr-sized steps
        # (GPT-2's checkpoints have them: `qkv_bias`).
        self.q = nn.Linear(n_embd, n_embd, bias=qkv_bias)
        self.k = nn.Linear(n_embd, n_embd, bias=qkv_bias)
        self.v = nn.Linear(n_embd, n_embd, bias=qkv_bias)
        self.proj = nn.Linear(n_embd, n_embd)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)  # under sequence parallel this gathers the whole sequence
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim  # this rank's heads: all of them, or its share under TP
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))

    def decode(self, x: torch.Tensor, past: tuple | None) -> tuple[torch.Tensor, tuple]:
        """Generation's step with a key/value cache (``past``: the earlier tokens' keys and values; None:
        a prefill, causal over ``x``; else ``x`` is one token, which sees every cached key)."""
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // self.head_dim
        q, k, v = (z.view(b, t, heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=past is None)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim)), (k, v)


class Block(nn.Module):
    """Pre-LayerNorm attention and MLP, each a residual branch; ``moe`` (keyword arguments of
    :class:`~distlab.models.moe.MoE`) makes the MLP a mixture of experts."""

    def __init__(self, n_embd: int, n_head: int, moe: dict | None = None, qkv_bias: bool = False,
                 gelu: str = "exact"):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, qkv_bias)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MoE(n_embd, **moe) if moe else \
            nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh" if gelu == "tanh" else "none"),
                          nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def decode(self, x: torch.Tensor, past: tuple | None) -> tuple[torch.Tensor, tuple]:
        h, cache = self.attn.decode(self.ln1(x), past)
        x = x + h
        return x + self.mlp(self.ln2(x)), cache


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, n_embd: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(n_embd)
        self.enter = nn.Identity()  # where the vocabulary-parallel region begins under tensor parallel
        self.out = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enter(self.ln(x)))


class GPT(nn.Sequential):
    """``GPT(vocab, block_size, n_layer, n_head, n_embd)``: embedding, ``n_layer`` blocks, head.
    With ``experts`` E > 0 every block's MLP is a mixture of E experts, each token sent to
    ``top_k`` of them (:class:`~distlab.models.moe.MoE`; ``capacity_factor`` None is dropless)."""

    def __init__(self, vocab: int, block_size: int, n_layer: int = 2, n_head: int = 4, n_embd: int = 128,
                 experts: int = 0, top_k: int = 2, capacity_factor: float | None = None, aux_coef: float = 0.01,
                 drop_policy: str = "position", qkv_bias: bool = False, gelu: str = "exact",
                 tie_embeddings: bool = False):
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd), ("block_size", block_size)):
            if value < 1:
                raise ValueError(f"{name} must be positive, not {value}")
        moe = dict(experts=experts, top_k=top_k, capacity_factor=capacity_factor, aux_coef=aux_coef,
                   # named only when not the default: a snapshot of before it existed still resumes
                   **({"drop_policy": drop_policy} if drop_policy != "position" else {})) if experts else None
        super().__init__(Embedding(vocab, block_size, n_embd),
                         *(Block(n_embd, n_head, moe, qkv_bias, gelu) for _ in range(n_layer)), Head(n_embd, vocab))
        self.block_size, self.n_layer, self.n_head, self.n_embd = block_size, n_layer, n_head, n_embd
        self.experts = experts
        self.moe_options = moe or {}
        # GPT-2's own choices, recorded only when made (a snapshot of before they existed still resumes)
        self.choices = {k: v for k, v in (("qkv_bias", qkv_bias), ("gelu", gelu), ("tie_embeddings", tie_embeddings))
                        if v != {"gelu": "exact"}.get(k, False)}
        if tie_embeddings:  # one matrix: the head's logits are the hidden state's scores against every embedding
            self[-1].out.weight = self[0].tok.weight
        self._init_weights()

    @property
    def cacheable(self) -> bool:
        """Whether :meth:`decode` gives what the whole window gives: not where experts drop tokens over
        capacity (how many a forward sees changes which ones)."""
        return self.moe_options.get("capacity_factor") is None

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: list | None, start: int) -> tuple[torch.Tensor, list]:
        """Logits of the new tokens ``idx`` at positions ``start..`` given every block's key/value ``cache``
        (None: a prefill); and the cache with them (:mod:`distlab.models.generation`)."""
        emb = self[0]
        x = emb.tok(idx) + emb.pos(torch.arange(start, start + idx.shape[1], device=idx.device))
        new = []
        for i, block in enumerate(list(self)[1:-1]):
            x, kv = block.decode(x, cache[i] if cache else None)
            new.append(kv)
        return self[-1](x), new

    def snapshot_record(self) -> dict:
        """The sizes a snapshot of this model must agree on (:mod:`distlab.models.plans`)."""
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd, "block_size": self.block_size,
                **self.moe_options, **self.choices}

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward (PaLM's count, nanoGPT's ``estimate_mfu``): 6 x
        the weights of the matrix multiplications a token passes through (attention and MLP projections,
        the router and the ``top_k`` experts it is routed to, the LM head; not the embeddings' lookups,
        biases or norms) + 12 x layers x width x block size (scores and weighted values over every key,
        as dense attention kernels compute them)."""
        from distlab.models.moe import GroupedExperts
        weights = 0
        for m in self.modules():
            if isinstance(m, nn.Linear):
                weights += m.weight.numel()
            elif isinstance(m, GroupedExperts):
                weights += self.moe_options["top_k"] * (m.up_weight[0].numel() + m.down_weight[0].numel())
        return float(6 * weights + 12 * self.n_layer * self.n_embd * self.block_size)

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the transformer blocks (not the embedding or the head)."""
        return [(self, [(i, i + 1) for i in range(1, len(self) - 1)])]

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        """Tensor parallel's plan (Megatron-LM's layout, the same in both styles but for the MLPs):
        the token embedding and the LM head split by vocabulary, attention by heads (q, k, v column
        parallel after one region entry, the projection row parallel), each MLP as
        :func:`~distlab.models.plans.linear_plan` splits it; under sequence parallel the
        LayerNorms and the position embedding see ``block_size / tp`` positions."""
        def mlp(i: int) -> dict[str, str]:
            if self.experts:  # experts stay whole on every tensor-parallel rank (expert parallel splits them);
                return {f"{i}.mlp": "sequence_stats"}  # under sequence parallel each routes its own positions
            return linear_plan(self[i].mlp, f"{i}.mlp", style)
        counts = (("`n_head`", self.n_head), ("`n_embd`", self.n_embd), ("the vocabulary", self[0].tok.num_embeddings))
        return decoder_tensor_plan(self, tp, sequence_parallel, "attention heads, widths and the vocabulary", counts,
                                   mlp)

    def context_parallel_plan(self, cp: int, style: str, tp: int = 1) -> dict[str, str]:
        """Context parallel's plan: the position embedding reads each rank's global positions, every
        block's attention core runs over the whole sequence (ring or all-to-all), and a mixture of
        experts completes its per-sequence routing counts over the sequence's ranks. Ulysses gives
        each of the ``cp`` ranks whole heads of this tensor-parallel rank's."""
        if style == "ulysses" and (self.n_head // tp) % cp:
            raise ConfigError(f"`cp_style` ulysses gives each of `cp` {cp} ranks whole heads: {self.n_head // tp} "
                              f"heads per tensor-parallel rank do not divide by {cp}; use `cp_style` ring")
        moe = {f"{i}.mlp": "context_sequence_stats" for i in range(1, len(self) - 1) if self.experts}
        return {"0.pos": "context_positions",
                **{f"{i}.attn.core": "context_attention" for i in range(1, len(self) - 1)}, **moe}

    def expert_parallel_plan(self, ep: int) -> dict[str, str]:
        """Expert parallel's plan: each block's experts sharded over the ``ep`` expert-parallel ranks."""
        return decoder_expert_plan(self, ep)

    def _init_weights(self) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, residual projections scaled by 1/sqrt(2 n_layer)."""
        init_decoder(self, ("attn.proj.weight", "mlp.2.weight", "experts.down_weight"))


def init_decoder(model: nn.Module, residual: tuple[str, ...]) -> None:
    """A decoder's initialisation (GPT-2's, the Llama family's): N(0, 0.02) matrices, zero biases, the
    projections into the residual stream (names ending in ``residual``) scaled by 1/sqrt(2 n_layer);
    norms keep their ones."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * model.n_layer) if name.endswith(residual) else 0.02
            nn.init.normal_(p, 0.0, std)


@dataclass(frozen=True)
class GPTOptions(Options):
    """The decoder's sizes (``gpt``)."""

    n_layer: int = option(2, "gpt: transformer blocks.")
    n_head: int = option(4, "gpt: attention heads per block (must divide --n-embd).")
    n_embd: int = option(128, "gpt: width of the residual stream.")
    qkv_bias: bool = option(False, "gpt, llama: biases on the query, key and value projections (GPT-2's, Qwen2's).")
    gelu: str = option("exact", "gpt: the MLP's GELU, exact or tanh (GPT-2's approximation, its gelu_new).")
    tie_embeddings: bool = option(False, "gpt, llama: the LM head reuses the token embedding's matrix (GPT-2's, "
                                  "Llama 3.2 1B and 3B's, Qwen2's up to 1.5B).")

    def check(self) -> None:
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be at least 1, not {getattr(self, name)}")
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


_ROUTING = "a mixture of experts' routing"


@dataclass(frozen=True)
class GPTMoEOptions(GPTOptions):
    """``gpt-moe``'s: the decoder's sizes and its mixture-of-experts MLPs."""

    experts: int = option(8, "gpt-moe: experts per mixture-of-experts layer (every block's MLP).", what=_ROUTING)
    top_k: int = option(2, "gpt-moe: experts each token is routed to (gates: the router's softmax over them, "
                        "renormalised).", what=_ROUTING)
    capacity_factor: float | None = option(None, "gpt-moe: each expert takes at most ceil(F x tokens x top_k / "
                                           "experts) token-slots per forward, the rest dropped and counted "
                                           "(default: dropless).", what=_ROUTING)
    drop_policy: str = option("position", "gpt-moe with --capacity-factor: which slots a full expert keeps -- "
                              "position (the earliest) or probs (those the router gave it the highest "
                              "probability; DeepSpeed's and Megatron-LM's default).", what=_ROUTING)
    aux_coef: float = option(0.01, "gpt-moe: weight of the per-sequence load-balancing loss.", what=_ROUTING)

    def check(self) -> None:
        super().check()
        check_experts(self)

    def describe(self) -> str:
        return f"{super().describe()}, {describe_experts(self)}"

    def experts_options(self) -> dict:
        return dict(experts=self.experts, top_k=self.top_k, capacity_factor=self.capacity_factor,
                    aux_coef=self.aux_coef, drop_policy=self.drop_policy)


EXPERT_FIELDS = tuple(f for f in fields(GPTMoEOptions) if f.name not in GPTOptions.names())  # a family's MoE options


def check_experts(self) -> None:
    """The mixture-of-experts options' limits (any family that has them: GPT's, the Llama family's)."""
    if self.experts < 2:
        raise ConfigError(f"`experts` must be at least 2, not {self.experts}")
    if not 1 <= self.top_k <= self.experts:
        raise ConfigError(f"`top_k` {self.top_k} must be between 1 and `experts` {self.experts} (each token goes "
                          f"to top_k of the experts)")
    if self.capacity_factor is not None and not self.capacity_factor > 0:
        raise ConfigError(f"`capacity_factor` must be positive, not {self.capacity_factor:g} (leave it out for "
                          f"dropless routing)")
    if not self.aux_coef >= 0:
        raise ConfigError(f"`aux_coef` must be 0 or more, not {self.aux_coef:g}")
    from distlab.models.moe import DROP_POLICIES
    if self.drop_policy not in DROP_POLICIES:
        raise ConfigError(f"unknown `drop_policy` {self.drop_policy!r}; choose one of: {', '.join(DROP_POLICIES)}")
    if self.drop_policy != "position" and self.capacity_factor is None:
        raise ConfigError(f"`drop_policy` {self.drop_policy} picks which slots a full expert drops, and without "
                          f"`capacity_factor` none is ever dropped: give `capacity_factor` (e.g. 1.25) or drop "
                          f"`drop_policy`")


def describe_experts(self) -> str:
    return (f"MLPs of {self.experts} experts, top-{self.top_k}, "
            + ("dropless" if self.capacity_factor is None else f"capacity factor {self.capacity_factor:g}, a full "
               f"expert keeping its {'earliest' if self.drop_policy == 'position' else 'most probable'} slots")
            + f", balance loss x {self.aux_coef:g}")


def _build(shape, vocab, o: GPTOptions) -> GPT:
    return GPT(vocab, shape[0], o.n_layer, o.n_head, o.n_embd, **o.experts_options(), qkv_bias=o.qkv_bias, gelu=o.gelu,
               tie_embeddings=o.tie_embeddings)


register(ModelSpec("gpt", _build, GPTOptions, text=True, adapter=HFGPT2))
register(ModelSpec("gpt-moe", _build, GPTMoEOptions, text=True, summary="mixture of experts"))
