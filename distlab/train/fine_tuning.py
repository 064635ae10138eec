"""Fine-tuning's flags: a run's low-rank adapters (``--lora``, :mod:`distlab.models.lora`) put on the model
before the layout cuts it, starting at their own values -- or, with ``--lora-from peft:DIR``, at the adapters
PEFT saved for the ``--init-from hf:DIR`` base (:mod:`distlab.models.peft_files`), whose config then says the
spec --, the frozen base's dtype, and the checks of packing, chats and preference pairs."""

from __future__ import annotations

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models import lora

BASE_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "nf4": torch.bfloat16}  # nf4: the rest in bf16


def _source(cfg) -> tuple[str, dict[str, str]]:
    """``(directory, layer names)`` of ``--lora-from``: the PEFT directory and distlab's layer -> the base
    checkpoint's module, for the family ``--init-from hf:DIR`` builds."""
    from distlab.models import hf, peft_files
    if not str(cfg.lora_from).startswith("peft:"):
        raise ConfigError(f"`lora_from` {cfg.lora_from}: give peft:DIR, a directory PEFT's save_pretrained wrote")
    if not str(cfg.init_from or "").startswith("hf:"):
        raise ConfigError("`lora_from` continues adapters PEFT trained on a Hugging Face model: give that model as "
                          "`init_from` hf:DIR")
    base = cfg.init_from[3:]
    config = hf.config_of(base)
    name, _, options, _ = hf.options_of(config, f"hf:{base}")
    architectures = config.get("architectures") or [None]
    return cfg.lora_from[5:], peft_files.module_names(name, options, architectures[0])


def spec_of_source(cfg) -> lora.LoRASpec:
    """The ``lora`` spec a run with ``--lora-from`` trains: the adapter config's (``--lora``, if given, must
    say the same)."""
    from distlab.models import peft_files
    directory, layers = _source(cfg)
    spec = peft_files.read(directory, layers)[0]
    if cfg.lora is not None and cfg.lora != spec:
        raise ConfigError(f"`lora` {cfg.lora} differs from {cfg.lora_from}'s adapters ({spec.text()}): drop `lora` "
                          f"(the adapters' config says it)")
    return spec


def check_fine_tuning(cfg) -> None:
    """What fine-tuning's flags need: ``base_dtype``'s adapters and precision, ``pack``'s records and
    model, ``dpo_beta``'s preference pairs, ``chat_turns``' chats."""
    from distlab.data.preference import is_preference
    from distlab.models.contract import contract
    check_base_dtype(cfg)
    from distlab.train.grpo import check as check_grpo
    check_grpo(cfg)
    if cfg.pack and not contract(cfg._meta_model()).packable:
        raise ConfigError(f"`pack` restarts each record's positions: model {cfg.model} does not read packed "
                          f"windows (a rotary family does: llama, gemma3)")
    pairs = is_preference(cfg.dataset)
    if pairs and cfg.kept() is not None:
        raise ConfigError(f"DPO's reference is the model training started from, read again when a run resumes: "
                          f"`init_from` {cfg.init_from} is gone, so this run cannot go on (restore it)")
    if cfg.chat_turns not in ("all", "last"):
        raise ConfigError(f"`chat_turns` is all (every assistant reply of a chat is a target) or last, not "
                          f"{cfg.chat_turns!r}")
    if cfg.chat_turns != "all" and not cfg.dataset.startswith("sft:"):
        raise ConfigError(f"`chat_turns` chooses which replies of sft:FILE.jsonl chats are targets; {cfg.dataset} "
                          f"is not such records (drop it)")
    if cfg.dpo_beta is not None and not pairs:
        raise ConfigError(f"`dpo_beta` weighs DPO's loss on preference pairs (dpo:FILE.jsonl); {cfg.dataset} is not "
                          f"pairs (drop `dpo_beta`)")
    if cfg.dpo_beta is not None and not cfg.dpo_beta > 0:
        raise ConfigError(f"`dpo_beta` must be positive, not {cfg.dpo_beta:g} (0.1 is usual)")
    if pairs and cfg.pack:
        raise ConfigError("`pack`: preference pairs are scored per completion, one window each: drop `pack`")
    if pairs and cfg.label_smoothing:
        raise ConfigError("`label_smoothing` smooths a cross-entropy's targets; DPO's loss is a pair's: drop it")


def check_base_dtype(cfg) -> None:
    """``base_dtype`` bf16 or nf4: a frozen base under adapters, computed in bf16 under autocast."""
    if cfg.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"`base_dtype` {cfg.base_dtype}: choose {' or '.join(BASE_DTYPES)}")
    if cfg.base_dtype != "float32" and cfg.lora is None:
        raise ConfigError(f"`base_dtype` {cfg.base_dtype} holds a frozen base in a narrower type: the base is "
                          f"frozen under `lora` (add it) -- a trained model keeps float32 weights")
    if cfg.base_dtype != "float32" and cfg.strategy.precision != "bf16":
        raise ConfigError(f"`base_dtype` {cfg.base_dtype}: the frozen base computes in bf16 under autocast, beside "
                          f"float32 adapters: add `precision` bf16")
    from distlab.train import quantized_base
    quantized_base.check(cfg)


def attach(cfg, net: nn.Module, real: bool) -> dict:
    """``--lora``: adapters on ``net``'s target layers, the rest frozen; their starting values (whole: the
    PEFT directory's, or :func:`distlab.models.lora.initial_state`), given to a ``real`` model now (else with
    its state, once the layout cut it). ``{}`` without adapters."""
    if cfg.lora is None:
        return {}
    lora.apply(net, cfg.lora)
    state = lora.initial_state(net, cfg.seed)
    if cfg.lora_from is not None:
        from distlab.models import peft_files
        from distlab.models.hf_files import check_tensors
        saved = peft_files.read(*_source(cfg))[1]
        check_tensors({k: tuple(v.shape) for k, v in state.items()}, {k: tuple(v.shape) for k, v in saved.items()},
                      f"`lora_from` {cfg.lora_from} does not fit the model's adapters", "the model's")
        state = saved
    if real:
        lora.fill(net, state)
    narrow_base(net, cfg.base_dtype)
    return state


def narrow_base(net: nn.Module, dtype: str) -> None:
    """The frozen parameters of ``net`` in ``dtype`` (values loaded later are cast to it)."""
    narrow = BASE_DTYPES[dtype]
    for p in net.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != narrow:
            p.data = p.data.to(narrow)
