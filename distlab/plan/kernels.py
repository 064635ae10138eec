"""What a GPU's kernels and selective checkpointing keep for backward, for the meta-device trace
(:mod:`distlab.plan.trace`) and the dry run (:mod:`distlab.plan.dry_run`): :class:`FlashAttention` runs attention
as the fused flash kernel does, :class:`OpsTally` adds up what checkpointing per op would keep of a layer."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from distlab.parallel.checkpointing import KeptOps


class FlashAttention:
    """``scaled_dot_product_attention`` without a mask as a GPU runs it in training, while this context is open: the
    fused flash kernel (``aten._scaled_dot_product_flash_attention``, which the meta device runs too), saving the
    queries, keys, values, output and each row's log-sum-exp instead of the scores; grouped key/value heads
    repeated to the query heads first. A masked call stays as it is (the kernel that takes a mask keeps it).
    ``torch.nn.functional``'s function is swapped for the context's length -- a checkpointed block's recomputation
    in backward included, which a torch-function mode would not see."""

    def __enter__(self):
        self._plain = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attend
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._plain

    def _attend(self, q, k, v, attn_mask=None, *args, **kwargs):
        if attn_mask is not None or args:
            return self._plain(q, k, v, attn_mask, *args, **kwargs)
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each key/value head to its query heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, bool(kwargs.get("is_causal", False)), False, scale=kwargs.get("scale"))[0]


class OpsTally(KeptOps):
    """What selective checkpointing per op (:func:`~distlab.parallel.checkpointing.ops_policy`) would keep of a
    layer's forward -- the outputs of attention kernels and of every other matrix multiplication, each storage
    once -- and the FLOPs of the matrix multiplications it would run again."""

    def __init__(self):
        super().__init__()
        self.kept_bytes, self.recompute_flops, self.seen = 0.0, 0.0, set()
        self.alive: list[torch.Tensor] = []  # what was counted, kept alive: a freed storage's address may be reused
        self.kept_by: dict[str, float] = {}  # linear layer (its name) -> what is kept of its output
        self.module: str | None = None

    def enter(self, name: str | None) -> None:
        """A linear layer's forward begins (its name) or ends (None)."""
        self.module = name

    def kept(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.alive.append(t)
            self.kept_bytes += storage.nbytes()
            if self.module is not None:
                self.kept_by[self.module] = self.kept_by.get(self.module, 0.0) + storage.nbytes()

    def recomputed(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.recompute_flops += 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
