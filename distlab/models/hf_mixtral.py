"""Hugging Face's Mixtral checkpoints <-> ``llama-moe`` (:class:`HFMixtral`: each expert's matrices stacked)."""

from __future__ import annotations

import torch

from distlab.errors import ConfigError
from distlab.models.hf_files import Config
from distlab.models.hf_llama import HFLlama


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
