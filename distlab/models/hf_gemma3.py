"""Hugging Face's Gemma 3 text checkpoints <-> ``gemma3`` (:class:`HFGemma3`)."""

from __future__ import annotations

from distlab.errors import ConfigError
from distlab.models.hf_adapter import HFAdapter
from distlab.models.hf_files import Config
from distlab.models.hf_llama import rope_scaling


class HFGemma3(HFAdapter):
    """Hugging Face's Gemma 3 text checkpoints (``Gemma3ForCausalLM``) <-> ``gemma3``: every tensor by name (the
    four norms of a block: input, post-attention, pre- and post-feedforward); the local and global layers'
    rotary bases from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_local_base_freq``/
    ``rope_scaling`` (the published configs), the global every ``sliding_window_pattern``-th layer (or as
    ``layer_types`` says, where it follows such a pattern)."""

    family = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    LAYER = {"self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
             "self_attn.o_proj": "attn.proj", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
             "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
             "input_layernorm": "ln1", "post_attention_layernorm": "post_attn", "pre_feedforward_layernorm": "ln2",
             "post_feedforward_layernorm": "post_mlp"}

    @classmethod
    def names(cls, options) -> dict:
        last = options.n_layer + 1
        out = {"model.embed_tokens.weight": "0.tok.weight", "model.norm.weight": f"{last}.ln.weight",
               "lm_head.weight": None if options.tie_embeddings else f"{last}.out.weight"}
        for i in range(options.n_layer):
            out |= {f"model.layers.{i}.{theirs}.weight": f"{i + 1}.{mine}.weight" for theirs, mine in cls.LAYER.items()}
        return out

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        c = Config(config, where)
        refused = [(config.get("final_logit_softcapping") is not None, "final_logit_softcapping (Gemma 2's)"),
                   (config.get("attn_logit_softcapping") is not None, "attn_logit_softcapping (Gemma 2's)"),
                   (config.get("use_bidirectional_attention"), "use_bidirectional_attention (an encoder's)"),
                   (config.get("attention_bias"), "attention_bias true"),
                   (c.text("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"),
                    f"hidden_activation {config.get('hidden_activation')!r} (distlab's GeGLU is tanh's)")]
        for bad, what in refused:
            if bad:
                raise ConfigError(f"{where}: {what}: distlab would compute another model; it reads Gemma 3 configs "
                                  f"without it")
        layers = c.size("num_hidden_layers")
        every = c.size("sliding_window_pattern", 6)
        types = c.get("layer_types")
        if types is not None:
            full = [i for i, t in enumerate(types) if t == "full_attention"] if isinstance(types, list) else []
            every = full[0] + 1 if full else layers + 1
            if not isinstance(types, list) or len(types) != layers or \
                    [t == "full_attention" for t in types] != [(i + 1) % every == 0 for i in range(layers)]:
                raise ConfigError(f"{where}: config.json's layer_types must be {layers} layers of sliding_attention "
                                  f"with every N-th full_attention (Gemma 3's pattern)")
        params = c.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: config.json's rope_parameters is {params!r}: it must be an object")
        nested = {k: params.get(k) for k in ("full_attention", "sliding_attention")}
        if any(v is not None and not isinstance(v, dict) for v in nested.values()):
            raise ConfigError(f"{where}: config.json's rope_parameters must hold an object for each layer type")
        glob, local = nested["full_attention"] or {}, nested["sliding_attention"] or {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope scaling on the local layers ({local.get('rope_type')}) is not Gemma 3's")
        scaled = rope_scaling(c, glob, where)  # the global layers' (the local ones are never scaled)
        options = dict(n_layer=layers, n_head=c.size("num_attention_heads"),
                       kv_heads=c.size("num_key_value_heads"), n_embd=c.size("hidden_size"),
                       head_dim=c.size("head_dim", 256), ffn_hidden=c.size("intermediate_size"),
                       rope_theta=Config(glob, where).number("rope_theta", c.number("rope_theta", 1_000_000.0)),
                       rope_local_theta=Config(local, where).number(
                           "rope_theta", c.number("rope_local_base_freq", 10_000.0)),
                       rope_scaling=scaled, sliding_window=c.size("sliding_window", 4096), global_every=every,
                       query_pre_attn_scalar=c.number("query_pre_attn_scalar", 256.0),
                       norm_eps=c.number("rms_norm_eps", 1e-6), tie_embeddings=c.flag("tie_word_embeddings", True),
                       context=c.size("max_position_embeddings", 0, least=0) or None)
        return options, c.size("vocab_size")

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        from distlab.models import rope
        scaling = rope.to_hf(rope.parse(options.rope_scaling))
        types = ["full_attention" if options.is_global(i) else "sliding_attention" for i in range(options.n_layer)]
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": vocab,
                "hidden_size": options.n_embd, "intermediate_size": options.ffn_hidden,
                "num_hidden_layers": options.n_layer, "num_attention_heads": options.n_head,
                "num_key_value_heads": options.kv_heads, "head_dim": options.head_dim,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": options.context or block_size,
                "rms_norm_eps": options.norm_eps, "query_pre_attn_scalar": int(options.query_pre_attn_scalar)
                if float(options.query_pre_attn_scalar).is_integer() else options.query_pre_attn_scalar,
                "sliding_window": options.sliding_window, "sliding_window_pattern": options.global_every,
                "layer_types": types, "rope_theta": options.rope_theta,
                "rope_local_base_freq": options.rope_local_theta, "rope_scaling": scaling,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": options.rope_theta,
                                                       **(scaling or {})},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": options.rope_local_theta}},
                "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
                "tie_word_embeddings": options.tie_embeddings, "torch_dtype": "float32", "dtype": "float32"}
