"""Hugging Face's Llama, Mistral, Qwen2 and Qwen3 checkpoints <-> ``llama`` (:class:`HFLlama`), and the
config pieces the Llama-like families share: sliding windows, rotary scaling."""

from __future__ import annotations

from distlab.errors import ConfigError
from distlab.models.hf_adapter import HFAdapter
from distlab.models.hf_files import Config


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
