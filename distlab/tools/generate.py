"""``distlab generate``: text from a trained language model -- a run directory, a snapshot of any layout,
an exported ``model.pt`` / ``.safetensors``, or ``hf:DIR``, all read by one loader
(:func:`distlab.train.loading.load`): the model built as it was recorded (its family, options and context)
and the tokens it trained on -- bytes, the run's BPE, the directory's tokenizer, or the ids themselves.
Sampling is autoregressive over the model's context (its positions, not the window it trained on):
temperature ``T`` (0: always the most likely token), optionally only the ``top_k`` most likely, drawn
from a generator seeded with ``seed`` -- the same command prints the same text.
"""

from __future__ import annotations

from pathlib import Path

from distlab.errors import ConfigError
from distlab.models.generation import generate, gpt_from_state, stream
from distlab.train.loading import load

__all__ = ["generate", "gpt_from_state", "load", "load_gpt", "stream"]


def chat_prompt(source: str | Path, message: str, meta: dict | None = None) -> str:
    """``message`` as a user's turn rendered by the chat template of ``source`` -- hf:DIR's, or the one a run
    kept from the Hugging Face files it started from (``meta``: what was recorded with its model) -- with
    the template's generation prompt: the text the model continues with the assistant's reply."""
    from distlab.data.chat import ChatTemplate
    if str(source).startswith("hf:"):
        template = ChatTemplate.from_dir(str(source)[3:])
    else:
        kept = (meta or {}).get("hf")
        files = kept.get("files") if isinstance(kept, dict) else None
        template = ChatTemplate.from_files(files, str(source)) if isinstance(files, dict) else None
    if template is None:
        raise ConfigError(f"--chat renders the prompt with a model's chat template: {source} has none (give hf:DIR "
                          f"of a model whose tokenizer_config.json has chat_template, or a run started from one)")
    return template.render([{"role": "user", "content": message}], add_generation_prompt=True)


def load_gpt(source: str | Path, n_head: int | None = None, tokenizer_file: str | None = None) -> tuple:
    """``(model, tokenizer, where)`` of any source (:func:`distlab.train.loading.load`)."""
    return tuple(load(source, n_head, tokenizer_file))
