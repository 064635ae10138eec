"""The decoder-only transformer every text family is: embedding, ``n_layer`` pre-norm blocks of causal
self-attention and MLP with residual connections, a final norm and the LM head -- one ``nn.Sequential``,
so a pipeline can cut it between any two layers. A family (:mod:`distlab.models.gpt`,
:mod:`distlab.models.llama`) gives only what differs: its norms, its MLP, its positions (a learned table
or rotary angles), its options and its snapshot record.

Shared here, once: the embedding (token rows, an optional scale, optional learned positions), the
attention (separate q, k, v projections, so tensor parallel gives each rank whole query heads and whole
key/value groups; grouped-query attention where there are fewer key/value heads; rotary positions where
the family has them), the block, the head, tied embeddings, generation's key/value cache
(:meth:`Decoder.decode`), activation checkpointing's blocks, the tensor-, context- and expert-parallel
plans' skeleton, FLOPs per token and the initialisation. Input: token ids ``(B, T)``; output: logits
``(B, T, vocab)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models.rope import frequencies
from distlab.models.contract import ModelContract, SplitEmbedding, attend
from distlab.models.packing import Packing


class Embedding(SplitEmbedding):
    """Token rows (times ``scale``, Gemma's ``sqrt(width)``) plus learned positions where the family has a
    table of ``positions`` rows (GPT-2's; rotary families have none). Under sequence parallel ``tok``
    returns this rank's piece of the positions, the ``part``-th (:class:`~distlab.models.contract.SplitEmbedding`)."""

    def __init__(self, vocab: int, n_embd: int, positions: int = 0, scale: float = 1.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(positions, n_embd) if positions else None
        self.scale = scale

    def forward(self, idx: torch.Tensor, start: int = 0) -> torch.Tensor:
        x = self.tok(idx)  # (B, t, C): every position, or this rank's piece
        return self.place(x, start + self.part * x.shape[1])

    def place(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Token rows ``x`` ``(B, t, C)`` at positions ``start..start+t-1``: scaled, their positions added."""
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos is None:
            return x
        t = x.shape[1]
        if start + t > self.pos.num_embeddings:
            raise ValueError(f"sequence of {start + t} tokens is longer than the model's block size "
                             f"{self.pos.num_embeddings}")
        return x + self.pos(torch.arange(start, start + t, device=x.device))


class RotaryTable(ModelContract, nn.Module):
    """``forward(positions) -> (cos, sin)``, each ``(t, head_dim)``: the rotation angles of those
    positions (float32; no parameters, so every layout holds it whole)."""

    reads_positions = True  # context parallel's context_positions: called with the positions 0..t-1

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary positions pair a head's dimensions: head_dim {head_dim} must be even")
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling  # scaling: distlab.models.rope's

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.angles(positions)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles of ``positions`` as they are -- a packed window's own, which context parallel's hook on
        :meth:`forward` (mapping a chunk's ``0..t-1`` to its place in the sequence) must not move."""
        inv_freq, scale = frequencies(self.head_dim, self.theta, self.scaling, positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        if scale != 1.0:  # yarn's attention factor, on the cosines and sines as transformers puts it
            return angles.cos() * scale, angles.sin() * scale
        return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, t, D)`` rotated by the angles (rotate-half layout), in float32, back in ``x``'s dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class AttentionCore(ModelContract, nn.Module):
    """Scaled dot-product attention of ``(q, k, v)``, ``(B, H, t, D)`` and ``(B, H_kv, t, D)``, each key/value
    head serving ``H / H_kv`` query heads; causal as :attr:`causal` says, within a sliding :attr:`window` where
    one is given (context parallel puts its ring or all-to-all version here)."""

    def __init__(self, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.window = window  # a sliding window: each query sees itself and the window - 1 keys before it
        self.scale = scale  # the scores' scale where it is not 1 / sqrt(head width) (Gemma's)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                records: torch.Tensor | None = None) -> torch.Tensor:
        """``records`` ``(B, t)``: a packed window's record of each position (each query sees its own only)."""
        return attend(q, k, v, self.causal, self.window, self.scale, records)


class Attention(ModelContract, nn.Module):
    """Multi-head attention with ``kv_heads`` key/value heads (grouped-query where fewer than ``n_head``),
    rotary positions where ``theta`` is given (scaled as ``rope_scaling`` says: :mod:`distlab.models.rope`)."""

    def __init__(self, n_embd: int, n_head: int, kv_heads: int, qkv_bias: bool = False, proj_bias: bool = False,
                 theta: float | None = None, rope_scaling: dict | None = None, window: int | None = None,
                 head_dim: int | None = None, qk_norm: Callable[[int], nn.Module] | None = None,
                 scale: float | None = None):
        super().__init__()
        if head_dim is None and n_embd % n_head:
            raise ValueError(f"n_embd {n_embd} must be divisible by n_head {n_head}")
        self.head_dim = head_dim or n_embd // n_head  # Qwen3's: its own, not n_embd / n_head
        self.enter = nn.Identity()  # where a parallel region begins when tensor parallel splits the heads
        self.q = nn.Linear(n_embd, n_head * self.head_dim, bias=qkv_bias)
        self.k = nn.Linear(n_embd, kv_heads * self.head_dim, bias=qkv_bias)
        self.v = nn.Linear(n_embd, kv_heads * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_head * self.head_dim, n_embd, bias=proj_bias)
        self.rotary = RotaryTable(self.head_dim, theta, rope_scaling) if theta is not None else None
        # Qwen3's and Gemma 3's per-head norms of queries and keys, before the rotation (one weight for every head)
        self.q_norm, self.k_norm = (qk_norm(self.head_dim), qk_norm(self.head_dim)) if qk_norm else (None, None)
        self.core, self.window, self.scale = AttentionCore(window, scale), window, scale
        self.n_head, self.kv_heads = n_head, kv_heads
        self.kv_index: list[int] | None = None  # tensor parallel with the key/value heads whole: the ones used here

    def tensor_rank(self, rank: int, size: int) -> None:
        """Tensor parallel where ``size`` does not divide the key/value heads (they stay whole on every rank):
        keep those this rank's query heads read (:func:`kv_heads_read`)."""
        self.kv_index = kv_heads_read(self.n_head, self.kv_heads, rank, size)

    def _heads(self, x: torch.Tensor, start: int,
               positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``'s queries, keys and values as ``(B, heads, t, D)`` -- this rank's heads (all, or its share) --
        the queries and keys rotated to positions ``start..`` (a packed window's own: ``positions`` ``(B, t)``)
        where the family's positions are rotary."""
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, q.shape[-1] // d, d).transpose(1, 2)
        k, v = (z.view(b, t, k.shape[-1] // d, d).transpose(1, 2) for z in (k, v))
        if self.kv_index is not None:
            k, v = k[:, self.kv_index], v[:, self.kv_index]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None and positions is not None:  # each record's own, from 0
            cos, sin = (z.view(b, 1, t, -1) for z in self.rotary.angles(positions.reshape(-1)))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        elif self.rotary is not None:
            cos, sin = self.rotary(torch.arange(start, start + t, device=x.device))
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, heads, t, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * d))

    packing: Packing | None = None  # the model's slot: a packed batch's structure (distlab.models.packing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)  # under sequence parallel this gathers the whole sequence
        packed = self.packing.fields if self.packing is not None else None
        if packed is None:
            return self._out(self.core(*self._heads(x, 0)))
        return self._out(self.core(*self._heads(x, 0, packed.positions), records=packed.records))

    def decode(self, x: torch.Tensor, past: tuple | None, start: int) -> tuple[torch.Tensor, tuple]:
        """Generation's step with a key/value cache: ``x`` the new tokens at positions ``start..``, ``past``
        the earlier ones' (rotated) keys and values (None: a prefill, causal over ``x``; else ``x`` is one
        token, which sees every cached key). Returns the output and the cache with ``x``'s appended."""
        q, k, v = self._heads(x, start)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        return self._out(attend(q, k, v, window=self.window, scale=self.scale)), (k, v)


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


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with the tanh GELU), biases where given."""

    def __init__(self, n_embd: int, hidden: int, bias: bool = False):
        super().__init__()
        self.enter = nn.Identity()  # where the parallel region begins under tensor parallel
        self.gate = nn.Linear(n_embd, hidden, bias=bias)
        self.up = nn.Linear(n_embd, hidden, bias=bias)
        self.down = nn.Linear(hidden, n_embd, bias=bias)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} gives its activation (act)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        return self.down(self.act(self.gate(x)) * self.up(x))


def gated_mlp_plan(i: int, style: str) -> dict[str, str]:
    """Block ``i``'s :class:`GatedMLP` under tensor parallel: gate and up column parallel, entering the parallel
    region together, down row parallel (naive: each column parallel, its output gathered)."""
    if style == "megatron":
        return {f"{i}.mlp.enter": "enter", f"{i}.mlp.gate": "colwise_entered", f"{i}.mlp.up": "colwise_entered",
                f"{i}.mlp.down": "rowwise"}
    return {f"{i}.mlp.{n}": "colwise_gather" for n in ("gate", "up", "down")}


class Block(nn.Module):
    """Attention and MLP, each a residual branch normed before it (the family's norms and MLP) -- and, where the
    family gives them (Gemma's), normed after it too, before it joins the residual stream: ``x +
    post_attn(attn(ln1(x)))``, then ``x + post_mlp(mlp(ln2(x)))``."""

    def __init__(self, ln1: nn.Module, attn: Attention, ln2: nn.Module, mlp: nn.Module,
                 post_attn: nn.Module | None = None, post_mlp: nn.Module | None = None):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        if post_attn is not None:  # (registered after the others: a checkpoint's tensors in their order)
            self.post_attn = post_attn
        if post_mlp is not None:
            self.post_mlp = post_mlp

    def _after(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self._modules[name](x) if name in self._modules else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._after("post_attn", self.attn(self.ln1(x)))
        return x + self._after("post_mlp", self.mlp(self.ln2(x)))

    def decode(self, x: torch.Tensor, past: tuple | None, start: int) -> tuple[torch.Tensor, tuple]:
        h, cache = self.attn.decode(self.ln1(x), past, start)
        x = x + self._after("post_attn", h)
        return x + self._after("post_mlp", self.mlp(self.ln2(x))), cache


class Head(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, norm: nn.Module, n_embd: int, vocab: int):
        super().__init__()
        self.ln = norm
        self.enter = nn.Identity()  # where the vocabulary-parallel region begins under tensor parallel
        self.out = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enter(self.ln(x)))


class Decoder(ModelContract, nn.Sequential):
    """``Decoder(embedding, blocks, head, ...)``: the layers, the sizes every layer asks of the model, and
    the :class:`~distlab.models.contract.ModelContract` members a decoder answers for any family. A family
    subclass gives :meth:`mlp_plan` (its MLP under tensor parallel), :meth:`split_counts` (what ``tp``
    must divide besides the query heads and the vocabulary), :meth:`record` (its snapshot sizes) and
    ``residual`` (the names of its projections into the residual stream, scaled at initialisation)."""

    residual: tuple[str, ...] = ()

    def __init__(self, embedding: Embedding, blocks, head: Head, *, block_size: int, n_head: int, kv_heads: int,
                 n_embd: int, moe: dict | None = None, tie_embeddings: bool = False, context: int | None = None):
        blocks = list(blocks)
        super().__init__(embedding, *blocks, head)
        self.block_size, self.n_layer, self.n_head, self.kv_heads = block_size, len(blocks), n_head, kv_heads
        self.context = max(context or block_size, block_size)  # the longest sequence it reads; it trains on block_size
        self.n_embd, self.tie_embeddings = n_embd, tie_embeddings
        # the heads' width (n_embd, but where a family's head_dim is its own: Qwen3's)
        self.attn_width = blocks[0].attn.n_head * blocks[0].attn.head_dim if blocks else n_embd
        self.moe_options = dict(moe or {})
        self.experts = self.moe_options.get("experts", 0)
        if tie_embeddings:  # one matrix: the head's logits are the hidden state's scores against every embedding
            self[-1].out.weight = self[0].tok.weight
        self.packing = Packing()  # a packed batch's structure, bound by the Engine; each attention masks by it
        for block in blocks:
            block.attn.packing = self.packing
        init_decoder(self, self.residual)

    # ------------------------------------------------------------------ what a family gives
    def mlp_plan(self, i: int, style: str) -> dict[str, str]:
        raise NotImplementedError(f"{type(self).__name__} does not say how tensor parallel splits its MLP (mlp_plan)")

    def split_counts(self) -> tuple[tuple[str, int], ...]:
        return ()

    def record(self) -> dict:
        raise NotImplementedError(f"{type(self).__name__} does not say what its snapshots record (record)")

    # ------------------------------------------------------------------ the contract
    @property
    def packable(self) -> bool:
        """Packed windows restart each record's positions: rotary ones can, a learned table is not built for it."""
        return self[0].pos is None

    @property
    def blocks(self) -> range:
        """The indices of the transformer blocks (the embedding is 0, the head last)."""
        return range(1, len(self) - 1)

    @property
    def cacheable(self) -> bool:
        """Whether :meth:`decode` gives what the whole window gives: not where experts drop tokens over
        capacity (how many a forward sees changes which ones)."""
        return self.moe_options.get("capacity_factor") is None

    @torch.no_grad()
    def decode(self, idx: torch.Tensor, cache: list | None, start: int) -> tuple[torch.Tensor, list]:
        """Logits of the new tokens ``idx`` at positions ``start..`` given every block's key/value ``cache`` of
        the tokens before (None: a prefill); and the cache with them (:mod:`distlab.models.generation`)."""
        x = self[0](idx, start)
        new = []
        for n, i in enumerate(self.blocks):
            x, kv = self[i].decode(x, cache[n] if cache else None, start)
            new.append(kv)
        return self[-1](x), new

    def snapshot_record(self) -> dict:
        """The sizes a snapshot of this model must agree on (its context where it is not its block size)."""
        return {**self.record(), **({"context": self.context} if self.context != self.block_size else {})}

    def flops_per_token(self) -> float:
        """Training FLOPs per token, forward and backward (PaLM's count, nanoGPT's ``estimate_mfu``): 6 x the
        weights of the matrix multiplications a token passes through (attention and MLP projections, the
        router and the ``top_k`` experts it is routed to, the LM head; not the embeddings' lookups, biases or
        norms) + 12 x layers x the heads' width x block size (scores and weighted values over every key, as dense
        attention kernels compute them)."""
        from distlab.models.moe import Experts
        weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        weights += sum(self.moe_options["top_k"] * m.active_weights() for m in self.modules()
                       if isinstance(m, Experts))  # the experts a token is routed to
        return float(6 * weights + 12 * self.n_layer * self.attn_width * self.block_size)

    def kv_share(self, tp: int) -> float | None:
        """The share of the key/value heads one of ``tp`` ranks holds where ``tp`` does not divide them (they
        stay whole, each rank keeping those its query heads read); None where they split as the plan says."""
        if self.kv_heads % tp == 0:
            return None
        return len(kv_heads_read(self.n_head, self.kv_heads, 0, tp)) / self.kv_heads

    def kv_heads_per_rank(self, tp: int) -> int:
        """The key/value heads a tensor-parallel rank's attention holds."""
        if self.kv_heads % tp == 0:
            return self.kv_heads // tp
        return len(kv_heads_read(self.n_head, self.kv_heads, 0, tp))

    def checkpoint_blocks(self):
        """Activation checkpointing's blocks: the transformer blocks (not the embedding or the head)."""
        return [(self, [(i, i + 1) for i in self.blocks])]

    def tensor_parallel_plan(self, tp: int, style: str, sequence_parallel: bool) -> dict[str, str]:
        """Tensor parallel's plan (Megatron-LM's layout): the token embedding and the LM head split by
        vocabulary; attention by heads -- query heads and key/value groups alike (q, k, v column parallel
        after one region entry, the projection row parallel); where ``tp`` does not divide the key/value
        heads they stay whole on every rank (``replicated``: each rank uses those its query heads read, the
        gradients summed over the group -- Megatron-LM's and torchtitan's replication for ``tp`` above the
        key/value heads); each block's MLP as the family splits it (:meth:`mlp_plan`; experts stay whole on
        every rank, expert parallel splits them); under sequence parallel the norms and the embedding's
        own rows see ``block_size / tp`` positions."""
        whole_kv = self.kv_heads % tp != 0
        counts = (("`n_head`", self.n_head), *((("`kv_heads`", self.kv_heads),) if not whole_kv and
                                                self.kv_heads != self.n_head else ()),
                  *self.split_counts())
        for what, count in counts:
            if count % tp:
                raise ConfigError(f"tensor parallel splits {self.splits} over `tp` {tp} ranks: {what} {count} is "
                                  f"not divisible by {tp}")
        vocab = self[0].tok.num_embeddings  # cut unevenly where tp does not divide it: ceil(V/tp) rows, the last fewer
        if -(-vocab // tp) * (tp - 1) >= vocab:
            raise ConfigError(f"tensor parallel splits the vocabulary of {vocab} into parts of {-(-vocab // tp)} rows "
                              f"over `tp` {tp} ranks: the last would be empty; choose a smaller `tp`")
        if sequence_parallel and self.block_size % tp:
            raise ConfigError(f"`sequence_parallel` splits each sequence of `block_size` {self.block_size} tokens "
                              f"over `tp` {tp} ranks: choose a `block_size` that {tp} divides")
        plan = {"0.tok": "vocab_embedding", "0": "sequence_embedding"}
        for i in self.blocks:
            mlp = {f"{i}.mlp": "sequence_stats"} if self.experts else self.mlp_plan(i, style)
            # (in the order they run: activation checkpointing's pricing stops before a block's last layer)
            norms = {f"{i}.attn.q_norm": "replicated", f"{i}.attn.k_norm": "replicated"} \
                if self[i].attn.q_norm is not None else {}  # one weight for every head: each rank's add to its gradient
            plan |= {f"{i}.ln1": "sequence", f"{i}.attn.enter": "enter", f"{i}.attn.q": "colwise_entered",
                     f"{i}.attn.k": "colwise_entered", f"{i}.attn.v": "colwise_entered", **norms,
                     f"{i}.attn.proj": "rowwise", f"{i}.ln2": "sequence", **mlp}
            if whole_kv:
                plan |= {f"{i}.attn.k": "replicated", f"{i}.attn.v": "replicated", f"{i}.attn": "tensor_rank"}
        head = len(self) - 1
        return plan | {f"{head}.ln": "sequence", f"{head}.enter": "enter", f"{head}.out": "vocab_output"}

    splits = "attention heads, widths and the vocabulary"  # the words of tensor parallel's refusal

    def context_parallel_plan(self, cp: int, style: str, tp: int = 1) -> dict[str, str]:
        """Context parallel's plan: the positions (a learned table, or every block's rotary table) read the
        rank's global positions, every block's attention core runs over the whole sequence (ring, or
        all-to-all giving each of the ``cp`` ranks whole query heads and whole key/value groups of this
        tensor-parallel rank's), and a mixture of experts completes its per-sequence routing counts over
        the sequence's ranks."""
        if style == "ulysses":
            for what, heads in (("heads", self.n_head // tp), ("key/value heads", self.kv_heads_per_rank(tp))):
                if heads % cp:
                    raise ConfigError(f"`cp_style` ulysses gives each of `cp` {cp} ranks whole heads: {heads} {what} "
                                      f"per tensor-parallel rank do not divide by {cp}; use `cp_style` ring")
        positions = {"0.pos": "context_positions"} if self[0].pos is not None else {}
        return {**positions,
                **{f"{i}.attn.rotary": "context_positions" for i in self.blocks if self[i].attn.rotary is not None},
                **{f"{i}.attn.core": "context_attention" for i in self.blocks},
                **{f"{i}.mlp": "context_sequence_stats" for i in self.blocks if self.experts}}

    def expert_parallel_plan(self, ep: int) -> dict[str, str]:
        """Expert parallel's plan: each block's experts sharded over the ``ep`` expert-parallel ranks."""
        if self.experts and self.experts % ep:
            raise ConfigError(f"expert parallel shards `experts` {self.experts} over `ep` {ep} ranks: choose an "
                              f"`ep` that divides {self.experts}")
        return {f"{i}.mlp.experts": "experts" for i in self.blocks} if self.experts else {}


def init_decoder(model: nn.Module, residual: tuple[str, ...]) -> None:
    """A decoder's initialisation (GPT-2's): N(0, 0.02) matrices, zero biases, the projections into the
    residual stream (names ending in ``residual``) scaled by 1/sqrt(2 n_layer); norms keep their ones."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * model.n_layer) if name.endswith(residual) else 0.02
            nn.init.normal_(p, 0.0, std)


__all__ = ["Attention", "AttentionCore", "Block", "Decoder", "Embedding", "GatedMLP", "Head", "RotaryTable", "init_decoder",
           "kv_heads_read", "rotate"]
