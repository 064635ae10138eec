"""The layout of a 4-bit NormalFloat weight (QLoRA's NF4, as torchao's ``NF4Tensor`` holds it), in sizes:
what a quantized weight -- whole, or a tensor-parallel rank's part of one -- is made of. The converter that
quantizes (:mod:`distlab.train.quantized_base`) and the planner that prices it (``distlab plan --base-dtype
nf4``) both read it, so the bytes the planner predicts are the tensors a run holds.

A weight of ``numel`` values is held as its 4-bit codes (two to a byte), one 8-bit scale per block of
:data:`BLOCK` values, one bf16 factor per group of scales (:func:`scaler_block` of them), the scales' mean
and NF4's 16 levels (bf16 each). A part cut along rows or columns holds its values' codes in blocks of
``gcd(BLOCK, run)`` values (``run``: its consecutive values in the whole weight) and a factor per ``groups`` of
those (:func:`part_layout`).
"""

from __future__ import annotations

import math

from distlab.errors import ConfigError

BLOCK = 64  # values per scale (QLoRA's, torchao's default)
SCALER_BLOCK = 256  # scales per 8-bit quantization block
LEVELS = 16  # NF4's levels, a bf16 table of them held with each weight
# the tensors a quantized weight is made of, as ``NF4Tensor.__tensor_flatten__`` names them
PARTS = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")


def scaler_block(numel: int) -> int:
    """Scales per quantization block for a weight of ``numel`` values: :data:`SCALER_BLOCK`, or the largest
    divisor of its number of scales below that (a small layer's)."""
    scales = numel // BLOCK
    return next(b for b in range(min(SCALER_BLOCK, scales), 0, -1) if scales % b == 0)


def part_layout(rows: int, cols: int, dim: int, parts: int) -> tuple[int, int]:
    """``(block, groups)`` of one of ``parts`` equal parts of a ``(rows, cols)`` NF4 weight cut along ``dim``: its
    values lie in runs of consecutive values of the whole (a row's columns, or all its rows), each starting at a
    multiple of the run, so blocks of ``gcd(BLOCK, run)`` values never straddle one of the whole's blocks, and
    ``groups`` of them -- dividing both a run's blocks and a scale group of the whole -- share a factor."""
    run = cols // parts if dim == 1 else rows // parts * cols
    block = math.gcd(BLOCK, run)
    if block % 2 or (rows, cols)[dim] % parts:
        raise ConfigError(f"`base_dtype` nf4 under tensor parallel: a weight of shape {(rows, cols)} cut in {parts} "
                          f"along dimension {dim} leaves runs of {run} values, not pairs of whole codes; choose a "
                          "`tp` that leaves an even number of its columns on each rank (or hold the base in bf16)")
    return block, math.gcd(run // block, scaler_block(rows * cols) * BLOCK // block)


def tensors(shape: tuple[int, ...], dim: int | None = None, parts: int = 1) -> list[tuple[int, int]]:
    """``(elements, bytes per element)`` of each tensor (in :data:`PARTS` order) a quantized weight of ``shape``
    is held as: whole, or (``dim``, ``parts``) one rank's part of it."""
    numel = math.prod(shape)
    if dim is None or parts == 1:
        block, groups = BLOCK, scaler_block(numel)
    else:
        block, groups = part_layout(shape[0], shape[1], dim, parts)
        numel //= parts
    blocks = numel // block
    return [(numel // 2, 1), (1, 2), (blocks // groups, 2), (blocks, 1), (LEVELS, 2)]
