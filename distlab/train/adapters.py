"""A run's low-rank adapters (``--lora``, :mod:`distlab.models.lora`): put on the model before the layout
cuts it, starting at their own values -- or, with ``--lora-from peft:DIR``, at the adapters PEFT saved for
the ``--init-from hf:DIR`` base (:mod:`distlab.models.peft_files`), whose config then says the spec."""

from __future__ import annotations

from torch import nn

from distlab.errors import ConfigError
from distlab.models import lora


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


def spec_text(cfg) -> str:
    """The ``lora`` spec a run with ``--lora-from`` trains: the adapter config's (``--lora``, if given, must
    say the same)."""
    from distlab.models import peft_files
    directory, layers = _source(cfg)
    spec = peft_files.read(directory, layers)[0]
    if cfg.lora is not None and lora.LoRASpec.parse(cfg.lora) != spec:
        raise ConfigError(f"`lora` {cfg.lora} differs from {cfg.lora_from}'s adapters ({spec.text()}): drop `lora` "
                          f"(the adapters' config says it)")
    return spec.text()


def attach(cfg, net: nn.Module, real: bool) -> dict:
    """``--lora``: adapters on ``net``'s target layers, the rest frozen; their starting values (whole: the
    PEFT directory's, or :func:`distlab.models.lora.initial_state`), given to a ``real`` model now (else with
    its state, once the layout cut it). ``{}`` without adapters."""
    if cfg.lora is None:
        return {}
    lora.apply(net, cfg.lora_spec())
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
    return state
