"""The Hugging Face layouts of distlab's families (:mod:`distlab.models.hf` reads and writes a directory
through them): which architectures a family reads, its options from a ``config.json`` (refusing, in one
line, what would compute another model), the config it writes, and its tensors both ways -- renamed one
to one (:class:`HFLlama`) or converted as whole state dicts where the layouts differ (:class:`HFGPT2`:
fused, transposed). Each is an :class:`HFAdapter` registered here by its family's name: the families
know nothing of checkpoint formats, and a family of one's own joins with its adapter and
:func:`distlab.models.hf.register_adapter`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.errors import ConfigError
from distlab.models.hf_files import Config


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of a fused checkpoint tensor that are one of distlab's tensors (``mine``): Phi-3's
    ``qkv_proj`` holds q, k and v one after another, its ``gate_up_proj`` gate then up."""

    mine: str
    start: int
    stop: int
    transposed: bool = False  # rows of the checkpoint's tensor transposed (GPT-2's Conv1D (in, out) matrices)


class HFAdapter:
    """A family's Hugging Face layout. Override what is yours; the rest is the default:

    ``family``, ``architectures``       the distlab family it builds, the ``architectures`` it reads
    ``options_from(config, where)``     ``(option values, vocabulary)`` of a ``config.json`` (required)
    ``config_for(options, vocab, ctx)`` the ``config.json`` it writes (required)
    ``names(options)``                  their tensor names -> distlab's (None: read and dropped; a tuple of
                                        :class:`Rows`: a fused tensor, cut by rows); the default
                                        :meth:`to_mine` and :meth:`to_theirs` rename (and cut, or join) by it
    ``sliced``                          True: every tensor maps to one of distlab's whole or by rows, so a rank
                                        may read only its slices of each (False where tensors are transposed)
    ``to_mine(tensors, options, where)``  a checkpoint's tensors under distlab's names
    ``to_theirs(state, options)``       distlab's whole-model state under their names
    ``tied(options)``                   distlab's names a checkpoint leaves out, being another's (a tied head)
    """

    family = ""
    architectures: tuple[str, ...] = ()
    sliced = True

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        raise NotImplementedError(f"adapter {cls.__name__} does not read a config.json (options_from)")

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        raise NotImplementedError(f"adapter {cls.__name__} does not write a config.json (config_for)")

    @classmethod
    def names(cls, options) -> dict[str, str | None]:
        raise NotImplementedError(f"adapter {cls.__name__} does not name its tensors (names, or to_mine and to_theirs)")

    @classmethod
    def tied(cls, options) -> tuple[str, ...]:
        return (f"{options.n_layer + 1}.out.weight",) if options.tie_embeddings else ()

    @classmethod
    def to_mine(cls, tensors: dict, options, where: str) -> dict:
        names, state = cls.names(options), {}
        for key, tensor in tensors.items():
            mine = names.get(key)
            if mine is None and key in names:  # known, and another tensor's (a tied LM head)
                continue
            if mine is None:
                raise ConfigError(f"{where} holds {key}, which distlab's {cls.family} has no place for")
            if isinstance(mine, tuple):  # a fused tensor: each of its row ranges one of distlab's
                if tensor.shape[0] != mine[-1].stop:
                    raise ConfigError(f"{where}: {key} has {tensor.shape[0]} rows; its config's make {mine[-1].stop}")
                state |= {r.mine: tensor[r.start:r.stop] for r in mine}
            else:
                state[mine] = tensor
        return state

    @classmethod
    def to_theirs(cls, state: dict, options) -> dict:
        out, used = {}, set()
        for hf_name, mine in cls.names(options).items():
            if isinstance(mine, tuple) and all(r.mine in state for r in mine):
                out[hf_name] = torch.cat([state[r.mine] for r in mine])
                used |= {r.mine for r in mine}
            elif isinstance(mine, str) and mine in state:
                out[hf_name] = state[mine]
                used.add(mine)
        unknown = sorted(set(state) - used)
        if unknown:
            raise ConfigError(f"{unknown[0]} has no place in the Hugging Face layout of {cls.family}")
        return out


class HFLlama(HFAdapter):
    """Hugging Face's Llama, Mistral and Qwen2 checkpoints <-> ``llama`` (:mod:`distlab.models.hf`): the
    same math (Qwen2's: with q/k/v biases), rotary positions already in the rotate-half layout distlab
    uses, so every tensor maps by name."""

    family = "llama"
    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
    LAYER = {"self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
             "self_attn.o_proj": "attn.proj", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
             "mlp.down_proj": "mlp.down", "input_layernorm": "ln1", "post_attention_layernorm": "ln2"}

    @classmethod
    def names(cls, options) -> dict[str, str]:
        """Every Hugging Face tensor name -> distlab's (None: read and dropped -- a tied LM head that a
        checkpoint holds anyway is the embedding; none is written)."""
        last = options.n_layer + 1
        out = {"model.embed_tokens.weight": "0.tok.weight", "model.norm.weight": f"{last}.ln.weight",
               "lm_head.weight": None if options.tie_embeddings else f"{last}.out.weight"}
        for i in range(options.n_layer):
            out |= {f"model.layers.{i}.{theirs}.weight": f"{i + 1}.{mine}.weight" for theirs, mine in cls.LAYER.items()}
            if options.qkv_bias:
                out |= {f"model.layers.{i}.self_attn.{p}_proj.bias": f"{i + 1}.attn.{p}.bias" for p in "qkv"}
            if options.proj_bias:
                out[f"model.layers.{i}.self_attn.o_proj.bias"] = f"{i + 1}.attn.proj.bias"
            if options.mlp_bias:
                out |= {f"model.layers.{i}.mlp.{p}_proj.bias": f"{i + 1}.mlp.{p}.bias" for p in ("gate", "up", "down")}
            if options.qk_norm:
                out |= {f"model.layers.{i}.self_attn.{p}_norm.weight": f"{i + 1}.attn.{p}_norm.weight" for p in "qk"}
        return out

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        """The option values and vocabulary of a ``config.json``; one line naming a key whose math distlab
        does not do."""
        c = Config(config, where)
        rope = c.get("rope_parameters", {})
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: config.json's rope_parameters is {rope!r}: it must be an object")
        scaling = rope_scaling(c, rope, where)
        heads, width = c.size("num_attention_heads"), c.size("hidden_size")
        qwen2, qwen3 = (c.architecture() == f"Qwen{n}ForCausalLM" for n in (2, 3))
        window, full = sliding(c, qwen2 or qwen3, where)
        head_dim = c.size("head_dim", width // heads)
        refused = [(config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r} (SwiGLU is silu)"),
                   (head_dim % 2, f"head_dim {head_dim} (rotary positions pair a head's dimensions)")]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"{where}: {what}: distlab would compute another model; it reads Llama-family "
                                  f"configs without it")
        theta = c.number("rope_theta", Config(rope, where).number("rope_theta", 10000.0))
        options = dict(n_layer=c.size("num_hidden_layers"), n_head=heads,
                       kv_heads=c.size("num_key_value_heads", heads), n_embd=width,
                       ffn_hidden=c.size("intermediate_size"), rope_theta=theta,
                       norm_eps=c.number("rms_norm_eps", 1e-6), rope_scaling=scaling, qk_norm=qwen3,
                       qkv_bias=qwen2 or c.flag("attention_bias", False), proj_bias=c.flag("attention_bias", False),
                       mlp_bias=c.flag("mlp_bias", False),
                       head_dim=head_dim if head_dim * heads != width else None,
                       sliding_window=window, full_layers=full,
                       tie_embeddings=c.flag("tie_word_embeddings", False),
                       context=c.size("max_position_embeddings", 0, least=0) or None)
        return options, c.size("vocab_size")

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        """The ``config.json`` of a ``LlamaForCausalLM`` computing what ``llama`` with ``options`` computes."""
        return {**architecture(options), "vocab_size": vocab,
                "hidden_size": options.n_embd, "intermediate_size": options.hidden,
                "num_hidden_layers": options.n_layer, "num_attention_heads": options.n_head,
                "num_key_value_heads": options.kv_heads, "head_dim": options.head_dim or options.n_embd // options.n_head,
                "hidden_act": "silu", "max_position_embeddings": options.context or block_size,
                "rms_norm_eps": options.norm_eps,
                **rope_config(options.rope_theta, options.rope_scaling),
                **({} if options.qkv_bias and not options.proj_bias else {"attention_bias": options.proj_bias}),
                **({"mlp_bias": options.mlp_bias} if options.mlp_bias or not (options.qk_norm or options.qkv_bias)
                   else {}),
                "tie_word_embeddings": options.tie_embeddings,
                "torch_dtype": "float32", "dtype": "float32"}


def sliding(c: Config, qwen: bool, where: str) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, full_layers)`` of a ``config.json``: Mistral's window over every layer, Qwen2's (with
    ``use_sliding_window``) over the layers from ``max_window_layers`` on, or ``layer_types`` where it says
    which layers slide; no window where none slides or it is as long as the context (it changes nothing)."""
    window = c.size("sliding_window", 0, least=0) if c.flag("use_sliding_window", not qwen) else 0
    layers = c.size("num_hidden_layers")
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or \
                any(t not in ("full_attention", "sliding_attention") for t in types):
            raise ConfigError(f"{where}: config.json's layer_types must list full_attention or sliding_attention "
                              f"for each of its {layers} layers")
        slides = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if slides and not window:
            raise ConfigError(f"{where}: config.json's layer_types has sliding layers but no sliding_window")
    else:
        slides = list(range(c.size("max_window_layers", 0, least=0) if qwen else 0, layers))
    context = c.size("max_position_embeddings", 0, least=0)
    if not window or not slides or (context and window >= context):
        return None, ()
    return window, tuple(i for i in range(layers) if i not in slides)


def architecture(options) -> dict:
    """The architecture a ``llama``'s options are (Qwen2: with q/k/v biases; Mistral: a sliding window over
    every layer; Llama: neither) and its window keys; one line for a window Llama's configs cannot say."""
    window = options.sliding_window
    if options.proj_bias != (options.qkv_bias and options.proj_bias) or options.proj_bias and (options.qk_norm or
                                                                                             window):
        raise ConfigError("an output bias goes out as a Llama config's attention_bias, which puts biases on q, k, v "
                          "and o, without q/k norms or a window: this model has no Hugging Face architecture; export "
                          "it without --format hf")
    if options.mlp_bias and (options.qk_norm or options.qkv_bias and not options.proj_bias or window):
        raise ConfigError("MLP biases go out as a Llama config's mlp_bias, without Qwen's q/k/v biases, q/k norms or a "
                          "window: this model has no Hugging Face architecture; export it without --format hf")
    if options.proj_bias or options.mlp_bias:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if options.qk_norm and options.qkv_bias:
        raise ConfigError("q/k norms with q/k/v biases have no Hugging Face architecture (Qwen3's have norms, no "
                          "biases); export it without --format hf")
    if options.qk_norm or options.qkv_bias:
        slides = [i for i in range(options.n_layer) if i not in options.full_layers] if window else []
        qwen = "Qwen3" if options.qk_norm else "Qwen2"
        return {"architectures": [f"{qwen}ForCausalLM"], "model_type": qwen.lower(), "use_sliding_window": bool(window),
                "sliding_window": window, "max_window_layers": slides[0] if slides else options.n_layer,
                "layer_types": ["sliding_attention" if i in slides else "full_attention"
                                for i in range(options.n_layer)]}
    if window and options.full_layers:
        raise ConfigError(f"a sliding window with blocks {','.join(map(str, options.full_layers))} whole has no "
                          f"Mistral config (its window is every layer's); export it without --format hf")
    if window:
        return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": window}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def rope_scaling(c: Config, rope: dict, where: str) -> str | None:
    """The ``--rope-scaling`` of a ``config.json``: its ``rope_scaling`` (Llama 3.1's, Qwen2.5's) or the scaling
    keys of its ``rope_parameters`` (as transformers 5 writes them), checked (:mod:`distlab.models.rope`); the
    original context where the config leaves it out taken as transformers takes it (a top-level
    ``original_max_position_embeddings`` first, else ``max_position_embeddings``)."""
    scaling = c.get("rope_scaling")
    if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
        scaling = rope
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: config.json's rope_scaling is {scaling!r}: it must be an object")
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | \
        {"rope_type": scaling.get("rope_type", scaling.get("type", "default"))}
    if scaling.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: config.json's partial_rotary_factor: distlab rotates every dimension of a head")
    if scaling["rope_type"] == "default":
        return None
    if scaling["rope_type"] in ("llama3", "yarn"):
        original = c.size("original_max_position_embeddings", 0, least=0) or \
            scaling.get("original_max_position_embeddings") or c.size("max_position_embeddings", 0, least=0) or None
        scaling["original_max_position_embeddings"] = original
        if scaling["rope_type"] == "yarn" and scaling.get("factor") is None and original:
            scaling["factor"] = c.size("max_position_embeddings") / original
    from distlab.models import rope as scaled
    return scaled.text(scaled.checked(scaling, f"{where}: config.json's rope_scaling"))


def rope_config(theta: float, scaling: str | None) -> dict:
    """The rotary keys of a ``config.json``: ``rope_theta``, and ``rope_scaling`` with ``rope_parameters`` (the
    form transformers 5 reads) holding the same scaling."""
    from distlab.models import rope
    hf = rope.to_hf(rope.parse(scaling))
    return {"rope_theta": theta, "rope_scaling": hf,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta, **(hf or {})}}


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


ADAPTERS = (HFLlama, HFGPT2)  # registered by distlab.models.hf when it first reads or writes a directory
