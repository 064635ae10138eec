"""QLoRA's 4-bit base (``--base-dtype nf4``; Dettmers et al., 2023): each adapted layer's frozen weight held as
4-bit NormalFloat -- torchao's ``NF4Tensor``, the maintained implementation torchtune's QLoRA uses: blocks of
64 values, each an index into NF4's 16 levels times its block's scale, the scales themselves quantized to
8 bits in blocks of 256 ("double quantization"). The rest of the frozen base is held in bf16, as
``--base-dtype bf16`` holds it; the adapters and their optimizer state stay float32, and the model
computes under bf16 autocast (the weight dequantized to bf16 for each matmul, its gradient never formed).

The weights are quantized once their values are in place (the checkpoint loaded, on the layout that
trains), whole -- so every layout computes with the values one process does. A snapshot holds each quantized
weight dequantized (bf16: the values the model computes with); loading one quantizes it again, which gives the
same dequantized values, so a resumed run computes what the uninterrupted one does. Data, pipeline, context
and expert parallel hold the weights as they are; ZeRO takes each quantized weight out of its units
(:meth:`Engine.convert_frozen <distlab.parallel.Engine.convert_frozen>`; ZeRO-3 gathers it once to quantize it
whole): stages 1-2 hold it whole, as they hold every parameter, and ZeRO-3 shards its codes and scales, each
part a unit of its own gathered with its layer. Tensor parallel gathers a split layer's weight once, quantizes it whole and keeps its own
part (:func:`part`): the 4-bit codes of its rows or columns and the scales of the blocks they lie in -- its
part dequantizes to exactly the whole's values there, and a snapshot's part is quantized again the same way
(the group's parts gathered as it loads).

torchao is an optional extra (``pip install torchao``), imported only by a run that asks for ``nf4``.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models.nf4 import BLOCK, part_layout, scaler_block

def _nf4():
    """torchao's NF4 module: ``to_nf4``, ``NF4Tensor`` and its ``SubclassTensorArgs`` (its CUDA kernels' load
    messages kept out of the run's output)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # (its enums' registration, deprecated)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        try:
            from torchao.dtypes import nf4tensor as nf4_tensor
        except ImportError:
            raise ConfigError("`base_dtype` nf4 holds the base in torchao's NF4 tensor: pip install torchao (or "
                              "choose `base_dtype` bf16)") from None
    return nf4_tensor


def check(cfg) -> None:
    """``base_dtype`` nf4: torchao present."""
    if cfg.base_dtype == "nf4":
        _nf4()


def quantize(module: nn.Module, convert=None) -> int:
    """Each adapted layer's frozen weight of ``module`` to NF4 (its values already loaded); returns how many.
    ``convert(layer, "weight", make)`` puts the made weight in place -- the gradient sync's
    (:meth:`Engine.convert_frozen <distlab.parallel.Engine.convert_frozen>`: ZeRO holds it whole from then on);
    default: in place. A tensor-parallel layer's weight is quantized whole and cut (:func:`part`; collective
    over its group). A snapshot's state dict holds them dequantized (module docstring)."""
    from distlab.parallel.protocols import LowRankAdapted
    nf4_type = _nf4().NF4Tensor
    convert = convert or (lambda layer, name, make: setattr(layer, name, make(getattr(layer, name))))
    done = 0
    for layer in module.modules():
        if not isinstance(layer, LowRankAdapted) or isinstance(layer.weight, nf4_type):
            continue
        split = _split_of(layer)
        whole = layer.weight.numel() * (split[2] if split else 1)
        if whole % BLOCK:
            raise ConfigError(f"`base_dtype` nf4 quantizes weights in blocks of {BLOCK} values: a layer of "
                              f"{whole} values does not divide (hold the base in bf16)")
        convert(layer, "weight", functools.partial(_made, split=split))
        layer._register_state_dict_hook(_dequantized)
        if split:
            layer._register_load_state_dict_pre_hook(_requantized, with_module=True)
        done += 1
    return done


def _made(weight: torch.Tensor, split: tuple | None) -> nn.Parameter:
    made = nn.Parameter(_quantized(weight.detach().to(torch.bfloat16), split), requires_grad=False)
    if split:  # what a state's values become before they are copied in (protocols.ShardedLayer: from_values)
        made.from_values = lambda values: _quantized(values.to(made.device, torch.bfloat16), split)
    return made


def _split_of(layer: nn.Module) -> tuple | None:
    """``(dim, group, parts, rank)`` of a layer whose weight the ranks of its group each hold a part of
    (tensor parallel's, :class:`~distlab.parallel.protocols.ShardedLayer`); ``None`` for a whole one."""
    from distlab.runtime import group_rank, group_size
    dim = getattr(layer, "tp_split", {}).get("weight")
    group = getattr(layer, "group", None)
    if dim is None or group_size(group) == 1:
        return None
    return dim, group, group_size(group), group_rank(group)


def _quantized(values: torch.Tensor, split: tuple | None):
    """``values`` (bf16) as NF4: whole, or -- ``split`` -- the group's parts gathered, quantized whole and this
    rank's part kept (collective)."""
    to_nf4 = _nf4().to_nf4
    if split is None:
        made = to_nf4(values, BLOCK, scaler_block(values.numel()))
        for name in made.__tensor_flatten__()[0]:  # each part in storage of its own size (torchao's factors of
            t = getattr(made, name)  # a single scale group keep the whole intermediate they were cut from)
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                setattr(made, name, t.clone())
        return made
    from distlab.parallel.tensor_parallel.mappings import all_gather_along
    dim, group, parts, rank = split
    whole = all_gather_along(values.contiguous(), group, dim)
    return part(to_nf4(whole, BLOCK, scaler_block(whole.numel())), dim, rank, parts)


def part(whole, dim: int, rank: int, parts: int):
    """Rank ``rank``'s part of the NF4 weight ``whole`` cut in ``parts`` along ``dim`` (0: rows, 1: columns), an
    ``NF4Tensor`` of its own that dequantizes to exactly ``whole``'s values there: its blocks
    (:func:`~distlab.models.nf4.part_layout`) lie inside the whole's, each carrying its block's 8-bit scale, and
    each group of them that group's factor -- dequantizing a scale is the same division of the same
    numbers, so the part's bf16 values equal the whole's bit for bit."""
    torchao = _nf4()
    rows, cols = whole.shape
    unit, groups = part_layout(rows, cols, dim, parts)  # (the whole's blocks and scale groups are distlab's own)
    codes = torch.stack([whole.quantized_data >> 4, whole.quantized_data & 0b1111], -1).view(rows, cols)
    mine = codes.chunk(parts, dim)[rank].reshape(-1)
    index = torch.arange(rows * cols, device=codes.device).view(rows, cols).chunk(parts, dim)[rank].reshape(-1)
    blocks = index[::unit] // whole.block_size  # each unit's block of ``whole``
    shape = list(whole.shape)
    shape[dim] //= parts
    return torchao.NF4Tensor(torchao.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, whole.dtype, whole.device, False),
                    unit, mine.numel() // unit, groups, whole.quantized_scalers[blocks].contiguous(),
                    whole.quantization_factor[blocks[::groups] // whole.scaler_block_size].contiguous(),
                    whole.scaler_mean, (mine[::2] << 4 | mine[1::2]).to(torch.uint8), whole.nf4)


def _dequantized(module, state, prefix, local_metadata):
    """A state dict holds a quantized weight as the bf16 values it computes with (one whose parts ZeRO-3 holds
    elsewhere between its gathers, as it is: such a state dict is read for its names only)."""
    from distlab.parallel.state_bytes import plain
    key = prefix + "weight"
    value = state.get(key)
    if value is not None and hasattr(value, "get_original_weight") and \
            all(t.untyped_storage().nbytes() for t in plain([value])):
        state[key] = value.get_original_weight()
    return state


def _requantized(module, state, prefix, *args):
    """A tensor-parallel part loaded from its dequantized values is quantized as it was made: the group's parts
    gathered and quantized whole (collective; torchao's own ``copy_`` would quantize the part alone)."""
    key = prefix + "weight"
    value = state.get(key)
    if value is not None and not hasattr(value, "get_original_weight"):
        state[key] = module.weight.from_values(value)
