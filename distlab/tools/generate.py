"""``distlab generate``: text from a trained GPT -- a run directory, a snapshot of any layout, or an
exported ``model.pt`` / ``.safetensors``.

The whole model is put back together from the snapshot's shards (as ``distlab export`` does) and
built as the run built it (its ``meta.json``: blocks, heads, width, context). Tokens are those the
run trained on: bytes (the prompt encoded as UTF-8, the output decoded with invalid bytes
replaced), or the run's BPE (kept in the snapshot's ``meta.json``, ``OUT/tokenizer.json``, and
beside an exported model as ``MODEL_FILE.tokenizer.json``). Sampling is
autoregressive over the last ``block_size`` tokens: temperature ``T`` (0: always the most likely
token), optionally only the ``top_k`` most likely, drawn from a generator seeded with ``seed`` --
the same command prints the same text.
"""

from __future__ import annotations

from pathlib import Path

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError, with_article
from distlab.models.generation import generate, gpt_from_state, model_from_state, stream

__all__ = ["generate", "gpt_from_state", "load_gpt", "stream"]


def chat_prompt(source: str | Path, message: str) -> str:
    """``message`` as a user's turn rendered by the chat template of ``source`` (hf:DIR), with the template's
    generation prompt: the text the model continues with the assistant's reply."""
    from distlab.data.chat import ChatTemplate
    template = ChatTemplate.from_dir(str(source)[3:]) if str(source).startswith("hf:") else None
    if template is None:
        raise ConfigError(f"--chat renders the prompt with a model's chat template: {source} has none (give hf:DIR "
                          f"of a model whose tokenizer_config.json has chat_template)")
    return template.render([{"role": "user", "content": message}], add_generation_prompt=True)


def load_gpt(source: str | Path, n_head: int | None = None, tokenizer_file: str | None = None) -> tuple:
    """The GPT ``source`` holds, its tokenizer, and a word on where it came from."""
    from distlab.train import export
    if str(source).startswith("hf:"):  # a Hugging Face checkpoint with its own tokenizer
        from distlab.models import hf
        model, record = hf.build(str(source)[3:])
        directory = Path(str(source)[3:])
        tokenizer = tokenizers.load(tokenizer_file) if tokenizer_file else \
            tokenizers.HFTokenizer.from_dir(str(directory)) if (directory / "tokenizer.json").is_file() else None
        if tokenizer is None and record["vocab"] != 256:
            raise ConfigError(f"{source} has no tokenizer.json and a vocabulary of {record['vocab']:,}: give --tokenizer")
        if tokenizer is not None and tokenizer.learned > record["vocab"]:
            raise ConfigError(f"the tokenizer has {tokenizer.learned:,} tokens, {source}'s model only "
                              f"{record['vocab']:,}: give the tokenizer it was trained with")
        return model, tokenizer or tokenizers.ByteTokenizer(), f"{source} ({record['model']})"
    kind, path = export.run_source(source)  # a run directory: its last snapshot, else its final model
    if kind == "snapshot" and path.is_dir():
        state, meta = export.whole_state(path)
        from distlab.models import is_text_model
        if not (isinstance(meta.get("model"), str) and is_text_model(meta["model"])):
            raise ConfigError(f"snapshot {path} holds {with_article(meta.get('model'))} model; generate needs a "
                              f"language model (gpt, gpt-moe, llama, llama-moe)")
        heads, layers = meta.get("n_head"), meta.get("n_layer")
        where = f"snapshot {path} (step {meta.get('step')})"
        text = meta.get("tokenizer_json")
        tokenizer = tokenizers.BPETokenizer.from_json(text, where=f"snapshot {path}'s tokenizer") \
            if isinstance(text, str) and not tokenizer_file else None
    elif path.is_file():
        state, meta = export.read_state(str(path), what="the model file")
        layers = len({k.split(".")[0] for k in state if k.split(".")[0].isdigit()}) - 2
        recorded = meta.get("n_head")
        heads = n_head or (int(recorded) if str(recorded).isdigit() else None)
        where = f"model file {path}"
        beside = path.with_name("tokenizer.json" if path.name == export.FINAL_MODEL else path.name + ".tokenizer.json")
        tokenizer = None if tokenizer_file or not beside.is_file() else tokenizers.load(str(beside))
        if heads is None and meta.get("model") in (None, "gpt", "gpt-moe"):
            raise ConfigError(f"{path} is a plain state_dict: give the model's --n-head (its other sizes are read "
                              f"from the tensors' shapes; a .safetensors export records it)")
    else:
        raise ConfigError(f"{source}: no run directory, snapshot or model file there")
    try:
        if meta.get("model") in (None, "gpt", "gpt-moe"):  # a plain state_dict's sizes from its tensors' shapes
            top_k = meta.get("top_k", 2)
            model = gpt_from_state(state, layers, heads, top_k=int(top_k) if str(top_k).isdigit() else 2)
        else:  # any other family: as its options recorded with it
            model = model_from_state(state, meta)
        tok = state["0.tok.weight"]
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"{where} does not hold {with_article(meta.get('model') or 'gpt')} model of distlab's layout: "
                          f"{str(exc).splitlines()[0][:200]}") from None
    if tokenizer_file:
        tokenizer = tokenizers.load(tokenizer_file)
    if tokenizer is None:
        if tok.shape[0] != 256:
            raise ConfigError(f"{where} has a vocabulary of {tok.shape[0]:,} tokens, not bytes: give its "
                              f"tokenizer with --tokenizer (the run's OUT/tokenizer.json)")
        tokenizer = tokenizers.ByteTokenizer()
    elif tokenizer.learned > tok.shape[0]:
        raise ConfigError(f"the tokenizer has {tokenizer.learned:,} tokens, {where} only {tok.shape[0]:,}: "
                          f"give the tokenizer it was trained with")
    return model.eval(), tokenizer, where
