"""QLoRA's 4-bit base (``--base-dtype nf4``; Dettmers et al., 2023): each adapted layer's frozen weight held as
4-bit NormalFloat -- torchao's ``NF4Tensor``, the maintained implementation torchtune's QLoRA uses: blocks of
64 values, each an index into NF4's 16 levels times its block's scale, the scales themselves quantized to
8 bits in blocks of 256 ("double quantization"). The rest of the frozen base is held in bf16, as
``--base-dtype bf16`` holds it; the adapters and their optimizer state stay float32, and the model
computes under bf16 autocast (the weight dequantized to bf16 for each matmul, its gradient never formed).

The weights are quantized once their values are in place (the checkpoint loaded, on the layout that
trains), so every rank quantizes the same values the same way. A snapshot holds each quantized weight
dequantized (bf16: the values the model computes with); loading one quantizes it again, which gives the
same dequantized values, so a resumed run computes what the uninterrupted one does. Data, pipeline,
context and expert parallel hold the weights as they are; ZeRO takes each quantized weight out of its units
and holds it whole (:meth:`Engine.convert_frozen <distlab.parallel.Engine.convert_frozen>`; ZeRO-3 gathers it
once to quantize it whole). Tensor parallel's splits do not carry an ``NF4Tensor`` (its scales' groups span a
row-parallel layer's columns), so that layout is refused before launch (``--base-dtype bf16`` splits).

torchao is an optional extra (``pip install torchao``), imported only by a run that asks for ``nf4``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from distlab.errors import ConfigError

BLOCK = 64  # values per scale (QLoRA's, torchao's default)
SCALER_BLOCK = 256  # scales per 8-bit quantization block


def _nf4():
    """torchao's ``to_nf4`` and ``NF4Tensor`` (its CUDA kernels' load messages kept out of the run's output)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # (its enums' registration, deprecated)
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            raise ConfigError("`base_dtype` nf4 holds the base in torchao's NF4 tensor: pip install torchao (or "
                              "choose `base_dtype` bf16)") from None
    return to_nf4, NF4Tensor


def check(cfg) -> None:
    """``base_dtype`` nf4: torchao present and a layout that holds the weights whole."""
    if cfg.base_dtype != "nf4":
        return
    _nf4()
    if cfg.strategy.tp > 1:
        raise ConfigError("`base_dtype` nf4 under tensor parallel: torchao's NF4 weight double-quantizes its blocks' "
                          "scales in groups of 256 consecutive blocks of the whole row-major weight, so a row-parallel "
                          "layer's columns are no whole groups and its rank's part holds other values than the whole "
                          "weight's; train it with data, ZeRO, pipeline, context or expert parallel, or hold the base "
                          "in bf16 (`base_dtype` bf16, which tensor parallel splits)")


def scaler_block(numel: int) -> int:
    """Scales per quantization block for a weight of ``numel`` values: :data:`SCALER_BLOCK`, or the largest
    divisor of its number of scales below that (a small layer's)."""
    scales = numel // BLOCK
    return next(b for b in range(min(SCALER_BLOCK, scales), 0, -1) if scales % b == 0)


def quantize(module: nn.Module, convert=None) -> int:
    """Each adapted layer's frozen weight of ``module`` to NF4 (its values already loaded); returns how many.
    ``convert(layer, "weight", make)`` puts the made weight in place -- the gradient sync's
    (:meth:`Engine.convert_frozen <distlab.parallel.Engine.convert_frozen>`: ZeRO holds it whole from then on);
    default: in place. A snapshot's state dict holds them dequantized (module docstring)."""
    from distlab.models.lora import LoRALinear
    to_nf4, nf4_type = _nf4()
    convert = convert or (lambda layer, name, make: setattr(layer, name, make(getattr(layer, name))))

    def make(weight: torch.Tensor) -> nn.Parameter:
        whole = weight.detach().to(torch.bfloat16)
        return nn.Parameter(to_nf4(whole, BLOCK, scaler_block(whole.numel())), requires_grad=False)

    done = 0
    for layer in module.modules():
        if not isinstance(layer, LoRALinear) or isinstance(layer.weight, nf4_type):
            continue
        if layer.weight.numel() % BLOCK:
            raise ConfigError(f"`base_dtype` nf4 quantizes weights in blocks of {BLOCK} values: a layer of shape "
                              f"{tuple(layer.weight.shape)} does not divide (hold the base in bf16)")
        convert(layer, "weight", make)
        layer._register_state_dict_hook(_dequantized)
        done += 1
    return done


def _dequantized(module, state, prefix, local_metadata):
    """A state dict holds a quantized weight as the bf16 values it computes with."""
    key = prefix + "weight"
    value = state.get(key)
    if value is not None and hasattr(value, "get_original_weight"):
        state[key] = value.get_original_weight()
    return state
