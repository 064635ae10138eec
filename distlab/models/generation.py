"""Text from a language model: rebuild one from a whole model's state, and sample from it.

Sampling is autoregressive over the last ``block_size`` tokens: temperature ``T`` (0: always the
most likely token), optionally only the ``top_k`` most likely, drawn from a generator seeded with
``seed`` -- the same call gives the same text, and the caller's random streams are untouched.
"""

from __future__ import annotations

import torch

from distlab.data import tokenizer as tokenizers
from distlab.errors import ConfigError
from distlab.models.gpt import GPT
from distlab.models.contract import contract
from distlab.models.plans import assign_state
from distlab.runtime.meta import on_meta_device


def gpt_from_state(state: dict[str, torch.Tensor], n_layer: int, n_head: int, top_k: int = 2) -> GPT:
    """A GPT holding ``state`` (a whole model's state_dict), its sizes read from the tensors' shapes
    (a mixture of experts' number of experts too; ``top_k`` is not in the tensors). Built on the meta
    device and given the tensors: no random initialisation, so the run's random streams are
    untouched (a sample mid-training changes nothing that follows)."""
    tok, pos = state["0.tok.weight"], state["0.pos.weight"]
    experts = state["1.mlp.experts.up_weight"].shape[0] if "1.mlp.experts.up_weight" in state else 0
    with on_meta_device():
        model = GPT(tok.shape[0], pos.shape[0], n_layer=n_layer, n_head=n_head, n_embd=tok.shape[1], experts=experts,
                    top_k=top_k)
    assign_state(model, state)
    return model.eval()


def _literal(value):
    """A recorded value: strings read as Python literals (a ``.safetensors`` export keeps strings), a word
    that is none (a drop policy) as itself."""
    import ast
    try:
        return ast.literal_eval(value) if isinstance(value, str) else value
    except (ValueError, SyntaxError):
        return value


def recorded_options(meta: dict):
    """The options of family ``meta["model"]`` that ``meta`` records (a snapshot's ``meta.json``, an export's
    metadata), the rest its defaults."""
    from distlab.models import spec
    family = spec(meta["model"])
    return family.make_options({k: _literal(meta[k]) for k in family.options.names()
                                if meta.get(k) not in (None, "None")})


def model_from_state(state: dict[str, torch.Tensor], meta: dict):
    """The registered text family ``meta["model"]`` built with the options ``meta`` records (a snapshot's
    ``meta.json`` or a ``.safetensors`` export's metadata: strings are read as Python literals), its
    vocabulary from the token embedding, holding ``state``; on the meta device, then given the tensors."""
    from distlab.models import build_model, spec, specs
    family = spec(meta["model"])
    if not family.text:
        raise ConfigError(f"{meta['model']} is not a language model: generate needs one "
                          f"({', '.join(s.name for s in specs() if s.text)})")
    if meta.get("block_size") is None:
        raise ConfigError("the model's context length (block_size) is not recorded with it: export it from its "
                          "run directory or snapshot (distlab export), which records it")
    with on_meta_device():
        model = build_model(meta["model"], (int(_literal(meta["block_size"])),), state["0.tok.weight"].shape[0],
                            recorded_options(meta))
    assign_state(model, state)
    return model.eval()


@torch.no_grad()
def generate(model: GPT, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             seed: int = 0, tokenizer=None, use_cache: bool = True, top_p: float | None = None) -> str:
    """``prompt`` followed by ``max_new_tokens`` sampled tokens, decoded (``tokenizer``: bytes by default).
    A model with a ``decode`` method (GPT, the Llama family) keeps its keys and values: the prompt is run once,
    then one token per step (``use_cache`` False: the whole window every step, the same tokens)."""
    return prompt + "".join(stream(model, prompt, max_new_tokens, temperature, top_k, seed, tokenizer, use_cache,
                                   top_p))


HELD_TOKENS = 8  # a piece that does not decode to whole characters waits for at most this many tokens


@torch.no_grad()
def stream(model: GPT, prompt: str, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
           seed: int = 0, tokenizer=None, use_cache: bool = True, top_p: float | None = None, begin: bool = True):
    """The text after ``prompt``, piece by piece as it is sampled (``"".join`` of it is what
    :func:`generate` appends): a token is given out as soon as it completes a character, so a long
    generation shows from its first token. Memory stays that of one context window. The prompt starts
    with what the tokenizer puts before a text (its BOS; ``begin`` False: a chat template wrote it)."""
    eos = getattr(tokenizer, "eos", None)
    stops = getattr(tokenizer, "stops", None) or ({eos} if eos is not None else set())
    tokenizer = tokenizer or tokenizers.ByteTokenizer()
    ids = tokenizer.encode(prompt.encode("utf-8")).tolist()
    ids = [*(tokenizer.begin if begin else ()), *ids] or tokenizer.encode(b"\n").tolist()
    pending: list[int] = []
    for nxt in sample_ids(model, ids, max_new_tokens, temperature, top_k, seed, use_cache, top_p, stops):
        pending.append(nxt)
        text = tokenizer.decode(pending)
        if not text.endswith("\ufffd") or len(pending) >= HELD_TOKENS:  # a character cut in two waits for its rest
            yield text
            pending = []
    if pending:
        yield tokenizer.decode(pending)


@torch.no_grad()
def sample_ids(model, ids: list[int], max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               seed: int = 0, use_cache: bool = True, top_p: float | None = None, stops=frozenset()):
    """The token ids that follow ``ids``, one at a time, until ``max_new_tokens`` or a token of ``stops`` (not
    given out). The window is the model's context (``model.context``, else its ``block_size``): past it the
    oldest tokens slide out."""
    if temperature < 0 or (top_k is not None and top_k < 1) or (top_p is not None and not 0 < top_p <= 1):
        raise ConfigError("--temperature must be at least 0, --top-k at least 1 and --top-p in (0, 1]")
    model = contract(model)
    context = model.context or model.block_size
    generator = torch.Generator().manual_seed(seed)
    window = torch.tensor([ids[-context:]], dtype=torch.long)
    cached = model.cacheable and use_cache
    cache, fed = None, 0  # the key/value cache holds the window's first `fed` tokens
    for _ in range(max_new_tokens):
        if not cached:
            logits = model(window)[0, -1].float()
        else:  # prefill once, then one token a step; a window that slid re-prefills (positions start again at 0)
            if cache is not None and fed == window.shape[1] - 1:
                out, cache = model.decode(window[:, -1:], cache, fed)
            else:
                out, cache = model.decode(window, None, 0)
            fed = window.shape[1]
            logits = out[0, -1].float()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            # in float64 from the best logit down: a temperature of 1e-300 makes -inf of the others, not inf - inf
            logits = (logits.double() - logits.max()) / temperature
            if top_k is not None and top_k < logits.numel():
                cutoff = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < cutoff, float("-inf"))
            probs = torch.softmax(logits, -1)
            if top_p is not None and top_p < 1:  # the smallest set of most likely tokens reaching top_p
                ranked, order = probs.sort(descending=True)
                drop = ranked.cumsum(0) - ranked >= top_p  # the tokens after the set is complete
                drop[0] = False  # the most likely token always stays (a top_p below float precision keeps it alone)
                probs = probs.scatter(0, order, ranked.masked_fill(drop, 0.0))
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        if nxt in stops:  # the model's end of sequence (or of its turn): the text is complete
            return
        grown = torch.cat([window, torch.tensor([[nxt]])], dim=1)
        if grown.shape[1] > context:  # the window slides: the cache's positions no longer hold
            grown, cache = grown[:, -context:], None
        window = grown
        yield nxt
