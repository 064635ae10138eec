"""Hugging Face's Phi-3 checkpoints <-> ``llama`` (:class:`HFPhi3`: fused ``qkv_proj`` and ``gate_up_proj``
read by rows, each rank reading only the rows of its pieces)."""

from __future__ import annotations

from distlab.errors import ConfigError
from distlab.models.hf_adapter import Rows
from distlab.models.hf_files import Config
from distlab.models.hf_llama import HFLlama


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
