"""More Hugging Face layouts (:mod:`distlab.models.hf_families` holds the base and the plain ones): Mixtral's
mixtures of experts (each expert's matrices stacked into distlab's ``llama-moe``), Phi-3's fused projections
(``qkv_proj``, ``gate_up_proj``: distlab's q, k, v and gate, up by rows, each rank reading only the rows of its
pieces) and Gemma 3's text decoder (``gemma3``). Registered beside the others by :mod:`distlab.models.hf`."""

from __future__ import annotations

import torch

from distlab.errors import ConfigError
from distlab.models.hf_families import HFAdapter, HFLlama, Rows, rope_scaling
from distlab.models.hf_files import Config


class HFMixtral(HFLlama):
    """Hugging Face's Mixtral checkpoints (``MixtralForCausalLM``) <-> ``llama-moe``: Llama's attention and norms,
    every MLP a mixture of SwiGLU experts -- the router's softmax (float32) over the experts, the top
    ``num_experts_per_tok`` renormalised as the gates, no token dropped (dropless, as transformers computes
    it). Each expert's ``w1``/``w3``/``w2`` are ``nn.Linear`` matrices there, stacked and transposed into
    distlab's ``gate_weight``/``up_weight`` ``(E, d, h)`` and ``down_weight`` ``(E, h, d)`` (read whole)."""

    family = "llama-moe"
    architectures = ("MixtralForCausalLM",)
    sliced = False
    EXPERT = (("w1", "gate_weight"), ("w3", "up_weight"), ("w2", "down_weight"))

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        c = Config(config, where)
        if c.number("router_jitter_noise", 0.0, positive=False) != 0:
            raise ConfigError(f"{where}: router_jitter_noise {config.get('router_jitter_noise')} (noise on the "
                              f"router's inputs in training): distlab's router has none; set it to 0")
        options, vocab = super().options_from(config, where)
        experts = c.size("num_local_experts")
        top_k = c.size("num_experts_per_tok", 2)
        if top_k > experts:
            raise ConfigError(f"{where}: num_experts_per_tok {top_k} is more than num_local_experts {experts}")
        return {**options, "experts": experts, "top_k": top_k, "capacity_factor": None,
                "aux_coef": abs(c.number("router_aux_loss_coef", 0.001, positive=False))}, vocab

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        if options.capacity_factor is not None:
            raise ConfigError(f"--capacity-factor {options.capacity_factor:g} drops tokens, which Mixtral never "
                              f"does; export a dropless mixture")
        config = {k: v for k, v in super().config_for(options, vocab, block_size).items() if k != "mlp_bias"}
        return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "sliding_window": options.sliding_window, "num_local_experts": options.experts,
                "num_experts_per_tok": options.top_k, "router_aux_loss_coef": options.aux_coef,
                "router_jitter_noise": 0.0, "output_router_logits": False}

    @classmethod
    def names(cls, options) -> dict[str, str | None]:
        out = {k: v for k, v in super().names(options).items() if ".mlp." not in k}
        for i in range(options.n_layer):
            out[f"model.layers.{i}.block_sparse_moe.gate.weight"] = f"{i + 1}.mlp.router.weight"
        return out

    @classmethod
    def to_mine(cls, tensors: dict, options, where: str) -> dict:
        rest = dict(tensors)
        state = {}
        for i in range(options.n_layer):
            for theirs, mine in cls.EXPERT:
                keys = [f"model.layers.{i}.block_sparse_moe.experts.{e}.{theirs}.weight" for e in range(options.experts)]
                missing = [k for k in keys if k not in rest]
                if missing:
                    raise ConfigError(f"{where} has no {missing[0]}, which its config's {options.experts} experts "
                                      f"have")
                state[f"{i + 1}.mlp.experts.{mine}"] = torch.stack([rest.pop(k).t() for k in keys])
        return {**super().to_mine(rest, options, where), **state}

    @classmethod
    def to_theirs(cls, state: dict, options) -> dict:
        rest = dict(state)
        out = {}
        for i in range(options.n_layer):
            for theirs, mine in cls.EXPERT:
                stacked = rest.pop(f"{i + 1}.mlp.experts.{mine}")
                out |= {f"model.layers.{i}.block_sparse_moe.experts.{e}.{theirs}.weight": stacked[e].t().contiguous()
                        for e in range(options.experts)}
        return {**super().to_theirs(rest, options), **out}


class HFPhi3(HFLlama):
    """Hugging Face's Phi-3 checkpoints (``Phi3ForCausalLM``, mini 4k) <-> ``llama``: Llama's math (its window
    of 2047 too), with q, k and v fused in one ``qkv_proj`` and the SwiGLU's gate and up in one
    ``gate_up_proj`` -- distlab's tensors are their row ranges (:class:`Rows`), so a rank of a layout reads
    only the rows its pieces hold. Phi-3's 128k configs (``longrope``) and a ``partial_rotary_factor`` are
    refused in one line."""

    architectures = ("Phi3ForCausalLM",)

    @classmethod
    def options_from(cls, config: dict, where: str) -> tuple[dict, int]:
        if Config(config, where).number("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(f"{where}: partial_rotary_factor {config.get('partial_rotary_factor')}: distlab rotates "
                              f"every dimension of a head")
        return super().options_from(config, where)

    @classmethod
    def config_for(cls, options, vocab: int, block_size: int) -> dict:
        config = super().config_for(options, vocab, block_size)
        if config["architectures"] not in (["LlamaForCausalLM"], ["MistralForCausalLM"]) or options.proj_bias \
                or options.mlp_bias or options.head_dim:
            raise ConfigError("this model's biases, q/k norms or head width have no Phi-3 config; export it from a "
                              "run not started from a Phi-3 checkpoint")
        drop = ("attention_bias", "mlp_bias", "head_dim")
        return {**{k: v for k, v in config.items() if k not in drop}, "architectures": ["Phi3ForCausalLM"],
                "model_type": "phi3", "sliding_window": options.sliding_window, "partial_rotary_factor": 1.0,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
                # Phi3Config's own defaults (32000 ...) lie outside another vocabulary: the checkpoint's ids, if any
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

    @classmethod
    def names(cls, options) -> dict:
        out = {k: v for k, v in super().names(options).items()
               if not k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))}
        q, kv, ff = options.n_head * (options.head_dim or options.n_embd // options.n_head), \
            options.kv_heads * (options.head_dim or options.n_embd // options.n_head), options.hidden
        for i in range(options.n_layer):
            mine = f"{i + 1}."
            out[f"model.layers.{i}.self_attn.qkv_proj.weight"] = (
                Rows(mine + "attn.q.weight", 0, q), Rows(mine + "attn.k.weight", q, q + kv),
                Rows(mine + "attn.v.weight", q + kv, q + 2 * kv))
            out[f"model.layers.{i}.mlp.gate_up_proj.weight"] = (Rows(mine + "mlp.gate.weight", 0, ff),
                                                                Rows(mine + "mlp.up.weight", ff, 2 * ff))
        return out


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


VARIANTS = (HFMixtral, HFPhi3, HFGemma3)
