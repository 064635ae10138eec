"""Hugging Face's GPT-2 checkpoints <-> ``gpt`` (:class:`HFGPT2`: fused, transposed projections)."""

from __future__ import annotations

import torch

from distlab.errors import ConfigError
from distlab.models.hf_adapter import HFAdapter, Rows
from distlab.models.hf_files import Config


class HFGPT2(HFAdapter):
    """Hugging Face's GPT-2 checkpoints (``GPT2LMHeadModel``) <-> ``gpt`` (:mod:`distlab.models.hf`): the same
    model with GPT-2's choices (q/k/v biases, the tanh GELU, tied embeddings). Its attention's q, k and v
    are one fused ``c_attn`` and its matrices ``Conv1D``'s ``(in, out)``: split and transposed on the way
    in, fused and transposed on the way out (a distlab GPT without q/k/v biases goes out with zero ones)."""

    family = "gpt"
    architectures = ("GPT2LMHeadModel",)
    LAYER = {"ln_1": "ln1", "ln_2": "ln2", "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.0", "mlp.c_proj": "mlp.2"}
    MASKS = (".attn.bias", ".attn.masked_bias")  # the causal mask older checkpoints stored as buffers

    @classmethod
    def names(cls, options) -> dict:
        """Their names -> distlab's, a matrix as the rows of its transpose (:class:`Rows`), c_attn's q, k, v
        as its thirds -- under both of the names GPT-2 checkpoints use (with and without ``transformer.``)."""
        n, last = options.n_embd, options.n_layer + 1
        out = {"wte.weight": "0.tok.weight", "wpe.weight": "0.pos.weight", "ln_f.weight": f"{last}.ln.weight",
               "ln_f.bias": f"{last}.ln.bias"}
        wide = {"attn.c_proj": n, "mlp.c_fc": 4 * n, "mlp.c_proj": n}
        for i in range(options.n_layer):
            theirs, mine = f"h.{i}.", f"{i + 1}."
            out[theirs + "attn.c_attn.weight"] = tuple(Rows(f"{mine}attn.{p}.weight", j * n, (j + 1) * n, True)
                                                       for j, p in enumerate("qkv"))
            out[theirs + "attn.c_attn.bias"] = tuple(Rows(f"{mine}attn.{p}.bias", j * n, (j + 1) * n)
                                                     for j, p in enumerate("qkv"))
            for a, b in cls.LAYER.items():
                out[f"{theirs}{a}.weight"] = f"{mine}{b}.weight" if a.startswith("ln") else \
                    (Rows(f"{mine}{b}.weight", 0, wide[a], True),)
                out[f"{theirs}{a}.bias"] = f"{mine}{b}.bias"
            out |= {theirs[:-1] + m: None for m in cls.MASKS}
        out = {**out, **{"transformer." + k: v for k, v in out.items()}}
        out["lm_head.weight"] = None if options.tie_embeddings else f"{last}.out.weight"
        return out

    @classmethod
    def to_mine(cls, tensors: dict, options, where: str) -> dict:
        t = {k.removeprefix("transformer."): v for k, v in tensors.items() if not k.endswith(cls.MASKS)}

        def take(key):
            if key not in t:
                raise ConfigError(f"{where} has no {key}, which its config's GPT-2 has")
            return t.pop(key)

        n, last = options.n_embd, options.n_layer + 1
        out = {"0.tok.weight": take("wte.weight"), "0.pos.weight": take("wpe.weight"),
               f"{last}.ln.weight": take("ln_f.weight"), f"{last}.ln.bias": take("ln_f.bias")}
        head = t.pop("lm_head.weight", None)
        if not options.tie_embeddings:
            out[f"{last}.out.weight"] = head if head is not None else take("lm_head.weight")
        for i in range(options.n_layer):
            theirs, mine = f"h.{i}.", f"{i + 1}."
            weight, bias = take(theirs + "attn.c_attn.weight"), take(theirs + "attn.c_attn.bias")
            for j, p in enumerate("qkv"):
                out[f"{mine}attn.{p}.weight"] = weight[:, j * n:(j + 1) * n].t().contiguous()
                out[f"{mine}attn.{p}.bias"] = bias[j * n:(j + 1) * n].clone()
            for a, b in cls.LAYER.items():
                w = take(f"{theirs}{a}.weight")
                out[f"{mine}{b}.weight"] = w if a.startswith("ln") else w.t().contiguous()
                out[f"{mine}{b}.bias"] = take(f"{theirs}{a}.bias")
        if t:
            raise ConfigError(f"{where} holds {sorted(t)[0]}, which distlab's gpt has no place for")
        return out

    @classmethod
    def to_theirs(cls, state: dict, options) -> dict:
        n, last = options.n_embd, options.n_layer + 1
        out = {"transformer.wte.weight": state["0.tok.weight"], "transformer.wpe.weight": state["0.pos.weight"],
               "transformer.ln_f.weight": state[f"{last}.ln.weight"], "transformer.ln_f.bias": state[f"{last}.ln.bias"],
               **({} if options.tie_embeddings else {"lm_head.weight": state[f"{last}.out.weight"]})}
        for i in range(options.n_layer):
            theirs, mine = f"transformer.h.{i}.", f"{i + 1}."
            out[theirs + "attn.c_attn.weight"] = torch.cat([state[f"{mine}attn.{p}.weight"].t() for p in "qkv"], dim=1)
            out[theirs + "attn.c_attn.bias"] = torch.cat([state.get(f"{mine}attn.{p}.bias", torch.zeros(n))
                                                          for p in "qkv"])
            for a, b in cls.LAYER.items():
                w = state[f"{mine}{b}.weight"]
                out[f"{theirs}{a}.weight"] = w if a.startswith("ln") else w.t()
                out[f"{theirs}{a}.bias"] = state[f"{mine}{b}.bias"]
        return out

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        c = Config(config, where)
        act = c.text("activation_function", "gelu_new")
        width = c.size("n_embd")
        refused = [(act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"), f"activation_function {act!r} (distlab's "
                    f"GELU is exact or tanh)"),
                   (config.get("n_inner") not in (None, 4 * width), f"n_inner {config.get('n_inner')} (distlab's MLP "
                    f"is 4 x n_embd = {4 * width} wide)"),
                   (config.get("layer_norm_epsilon", 1e-5) != 1e-5, f"layer_norm_epsilon "
                    f"{config.get('layer_norm_epsilon')} (distlab's LayerNorms use 1e-5)"),
                   (not config.get("scale_attn_weights", True), "scale_attn_weights false (distlab scales scores "
                    "by 1/sqrt(head width))"),
                   (config.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx true")]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"{where}: {what}: distlab would compute another model; it reads GPT-2 configs "
                                  f"without it")
        options = dict(n_layer=c.size("n_layer"), n_head=c.size("n_head"), n_embd=width, qkv_bias=True,
                       gelu="exact" if act == "gelu" else "tanh",
                       tie_embeddings=c.flag("tie_word_embeddings", True),
                       context=c.size("n_positions", 0, "n_ctx", least=0) or None)
        return options, c.size("vocab_size")

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        """The ``config.json`` of a ``GPT2LMHeadModel`` computing what ``gpt`` with ``options`` computes."""
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab,
                "n_positions": options.context or block_size, "n_ctx": options.context or block_size,
                "n_embd": options.n_embd, "n_layer": options.n_layer,
                "n_head": options.n_head, "n_inner": None,
                "activation_function": "gelu_new" if options.gelu == "tanh" else "gelu", "layer_norm_epsilon": 1e-5,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "tie_word_embeddings": options.tie_embeddings, "torch_dtype": "float32", "dtype": "float32"}
