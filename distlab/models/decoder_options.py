"""What every decoder family's options share (``gpt``, ``llama``, ``gemma3``: :mod:`distlab.models.decoder`'s
families): a frozen dataclass each family's options extend."""

from __future__ import annotations

from dataclasses import dataclass

from distlab.errors import ConfigError
from distlab.models.spec import Options, option


@dataclass(frozen=True)
class DecoderOptions(Options):
    """What every decoder family's options share: its depth, heads, width, whether the head reuses the embedding,
    and its own context. A family adds its choices and checks (``super().check()`` first); a field a family
    redefines keeps its place and takes that family's default."""

    n_layer: int = option(2, "decoders: transformer blocks.")
    n_head: int = option(4, "decoders: attention heads per block.")
    n_embd: int = option(128, "decoders: width of the residual stream.")
    tie_embeddings: bool = option(False, "decoders: the LM head reuses the token embedding's matrix (GPT-2's, "
                                  "Llama 3.2 1B and 3B's, Qwen2's up to 1.5B, Gemma's).")
    context: int | None = option(None, "decoders: the model's own context, the longest sequence it reads (GPT's "
                                 "position table; a checkpoint's max_position_embeddings), at least --block-size, "
                                 "the window it trains on (default: --block-size).")
    positive = ("n_layer", "n_head", "n_embd")  # the sizes :meth:`check` wants at least 1 (a family adds its own)

    def check(self) -> None:
        if self.context is not None and self.context < 1:
            raise ConfigError(f"`context` must be at least 1, not {self.context}")
        for name in self.positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"`{name}` must be at least 1, not {getattr(self, name)}")
