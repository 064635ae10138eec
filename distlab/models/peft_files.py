"""Low-rank adapters as PEFT keeps them: a directory with ``adapter_config.json`` and
``adapter_model.safetensors`` (``peft.PeftModel.from_pretrained(base, DIR)`` loads it; ``save_pretrained``
writes one). A tensor ``base_model.model.<module>.lora_A.weight`` is ``A`` ``(r, in)`` of the base model's
module of that name, ``lora_B.weight`` its ``B`` ``(out, r)``; the config says the rank, ``lora_alpha``
(scale ``alpha / r``), the dropout and ``target_modules``.

Module names are the Hugging Face checkpoint's, mapped to distlab's by the family's adapter
(:mod:`distlab.models.hf`): a layer that is a whole tensor of the checkpoint (Llama's ``q_proj``) maps, a
fused one (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``) does not -- distlab adapts q, k and v apart, PEFT the
fused layer -- and is refused in one line. What PEFT computes that distlab does not (rsLoRA's scale, DoRA,
per-layer ranks, biases, fan-in-fan-out weights, extra trained modules) is refused on the way in.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distlab.errors import ConfigError
from distlab.models.hf_files import confined, finite, header, read_json
from distlab.models.lora import LoRASpec

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
FACTORS = (("lora_a", "lora_A"), ("lora_b", "lora_B"))
# PEFT settings distlab computes as their defaults only (the value each must have)
DEFAULTS = {"bias": "none", "use_rslora": False, "fan_in_fan_out": False, "use_dora": False,
            "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def module_names(name: str, options, architecture: str | None = None) -> dict[str, str]:
    """distlab's layer name -> the checkpoint's module name, for every linear layer that is one tensor of
    the checkpoint (``1.attn.q`` -> ``model.layers.0.self_attn.q_proj``)."""
    from distlab.models import hf
    out = {}
    for theirs, mine in hf.adapter_of(name, architecture).names(options).items():
        if isinstance(mine, str) and mine.endswith(".weight") and theirs.endswith(".weight"):
            out[mine[:-len(".weight")]] = theirs[:-len(".weight")]
    return out


def write(state: dict[str, torch.Tensor], spec: LoRASpec, layers: dict[str, str], out: str | Path,
          base: str | None = None) -> Path:
    """The adapters of ``state`` (a whole model's, distlab's names) as a new PEFT directory ``out``, each
    adapted layer under its checkpoint name (``layers``: :func:`module_names`); written beside ``out`` and
    renamed at the end (a kill mid-write leaves no ``out``)."""
    from safetensors.torch import save_file

    from distlab.models.hf import new_directory
    adapted = sorted({k[:-len(".lora_a")] for k in state if k.endswith(".lora_a")})
    if not adapted:
        raise ConfigError("--format peft writes a run's low-rank adapters: this model has none (train with --lora)")
    fused = [layer for layer in adapted if layer not in layers]
    if fused:
        raise ConfigError(f"--format peft: layer {fused[0]} is part of a fused tensor of the checkpoint's layout "
                          f"(PEFT adapts the fused layer, distlab each of its parts): export --format hf --merge")
    tensors = {f"{PREFIX}{layers[layer]}.{theirs}.weight": state[f"{layer}.{mine}"].detach().float().contiguous()
               for layer in adapted for mine, theirs in FACTORS}
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": spec.r,
              "lora_alpha": alpha, "lora_dropout": spec.dropout,
              "target_modules": sorted({layers[layer].rsplit(".", 1)[-1] for layer in adapted}),
              "inference_mode": True, "init_lora_weights": True, **DEFAULTS}
    with new_directory(out) as root:
        save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
        (root / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return Path(out).resolve()


def other_base(directory: str | Path, model_dir: str | Path) -> str | None:
    """Where the adapters of ``directory`` name another base than the model of ``model_dir`` (their config's
    ``base_model_name_or_path`` against :func:`distlab.models.hf.name_of` of it and its path): a line saying
    so -- an adapter of another model of the same shapes (a Llama's onto a Mistral) loads, but does not
    belong to it. None where they agree or the adapters name none. (The base they name is not read: only
    files inside the adapter directory are.)"""
    from distlab.models import hf
    base = read_json(Path(directory) / CONFIG, f"peft:{directory}").get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        return None
    mine = {hf.name_of(model_dir), str(Path(model_dir).resolve())}
    if base in mine or (Path(base).is_absolute() and str(Path(base).resolve()) in mine):
        return None
    return (f"the adapters of peft:{directory} were trained on {base}; --init-from is {hf.name_of(model_dir)}: "
            f"if that is another model, they do not belong to it")


def read(directory: str | Path, layers: dict[str, str]) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """``(spec, adapters)`` of a PEFT directory: the config's rank, alpha, dropout and target modules, and
    each adapted layer's ``lora_a`` / ``lora_b`` under distlab's names (``layers``: :func:`module_names`),
    float32 -- after its header is checked and its config's every setting is one distlab computes."""
    from safetensors import safe_open
    root, where = Path(directory), f"peft:{directory}"
    if not (root / CONFIG).is_file() or not (root / WEIGHTS).is_file():
        raise ConfigError(f"{where}: a PEFT adapter directory holds {CONFIG} and {WEIGHTS}")
    config = read_json(root / CONFIG, where)
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type {config.get('peft_type')!r}; distlab reads LoRA adapters (LORA)")
    for key, default in DEFAULTS.items():
        value = config.get(key)
        if not (value is None or value == default or (default in (None, {}) and value in ([], {}))):
            raise ConfigError(f"{where}: {key} {value!r} -- distlab's adapters are plain LoRA ({key} {default!r})")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else targets
    dropout = config.get("lora_dropout")
    # each value read as the type it is (never pasted into a --lora text, where "0,alpha=1000" would be a key)
    spec = LoRASpec.checked(config.get("r"), config.get("lora_alpha"), 0.0 if dropout is None else dropout, targets,
                            f"{where}: {CONFIG}'s", ("r", "lora_alpha", "lora_dropout", "target_modules"))
    mine = {theirs: layer for layer, theirs in layers.items()}
    out: dict[str, torch.Tensor] = {}
    shapes = header(root / WEIGHTS, where)  # checked before the library opens the file
    for key, (_, shape) in shapes.items():  # the config's rank is the tensors' (checked before any is read)
        if len(shape) != 2 or shape[0 if ".lora_A." in key else 1] != spec.r:
            raise ConfigError(f"{where}: tensor {key} has shape {list(shape)}, not that of a rank-{spec.r} factor "
                              f"({CONFIG} says r {spec.r})")
    with safe_open(str(confined(root / WEIGHTS, where)), "pt") as f:
        for key in shapes:
            module, _, factor = key.removeprefix(PREFIX).rpartition(".")
            module, _, kind = module.rpartition(".")
            ours = dict((t, m) for m, t in FACTORS).get(kind)
            if not key.startswith(PREFIX) or factor != "weight" or ours is None or module not in mine:
                raise ConfigError(f"{where}: tensor {key} is not a LoRA factor of a layer distlab adapts "
                                  f"({PREFIX}<module>.lora_A.weight / lora_B.weight)")
            out[f"{mine[module]}.{ours}"] = finite(f.get_tensor(key).to(torch.float32), key, where)
    return spec, out
