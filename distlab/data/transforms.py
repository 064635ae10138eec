"""Batch transforms on tensors: normalisation, and CIFAR's random crop + horizontal flip."""

from __future__ import annotations

import functools

import torch


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 (B,C,H,W) -> float32 ``(x/255 - mean) / std`` per channel; float input is returned as is."""
    if images.dtype != torch.uint8:
        return images.float()
    m, s = _moments(tuple(mean), tuple(std), images.device)
    return (images.float().div_(255.0) - m) / s


@functools.lru_cache(maxsize=16)
def _moments(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and std as tensors on ``device``, made once: a copy to a GPU per batch would
    make the host wait for the device every step."""
    return tuple(torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1).to(device) for v in (mean, std))


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4) -> torch.Tensor:
    """Per sample: zero-pad by ``padding``, crop back to H x W at a random offset, flip with p=1/2.

    Vectorised over the batch (one gather, no Python loop over samples), as in the standard
    CIFAR recipe (``RandomCrop(32, padding=4)`` + ``RandomHorizontalFlip``). The draws come from
    ``generator`` on the host (the same on any device); the gathers run where ``x`` is (the draws copied
    there without waiting for the device: from pageable memory the copy is done when the call returns).
    """
    b, _, h, w = x.shape
    dev = x.device
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(dev, non_blocking=True)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=generator).to(dev, non_blocking=True)
    flip = (torch.rand(b, generator=generator) < 0.5).to(dev, non_blocking=True)
    rows = (dy.view(b, 1) + torch.arange(h, device=dev).view(1, h))         # (b, h)
    cols = torch.arange(w, device=dev).view(1, w).expand(b, w)
    cols = torch.where(flip.view(b, 1), w - 1 - cols, cols) + dx.view(b, 1)  # (b, w)
    idx_r = rows.view(b, 1, h, 1).expand(b, x.shape[1], h, padded.shape[-1])
    out = padded.gather(2, idx_r)                                             # (b, c, h, W+2p)
    idx_c = cols.view(b, 1, 1, w).expand(b, x.shape[1], h, w)
    return out.gather(3, idx_c)                                               # (b, c, h, w)
