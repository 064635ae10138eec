"""Where a run keeps its data set: in host memory (a batch is gathered there and copied to the
device every step) or *device-resident* (the whole set in GPU memory; a batch is gathered there).

A GPU step of a small model is short enough that the host-side gather and the copy are a large part
of it. The sampler does not change: the same indices come from torch's DistributedSampler on the
host either way (a few hundred bytes of int64 per step travel to the GPU instead of the batch), so
a device-resident run sees the same samples in the same order, and its batches are equal to the host
run's (gathers are exact; normalisation is the same correctly rounded float32 arithmetic).

``data_on_device``: ``auto`` (the default) puts the data on the GPU when the run is on one and the
sets take at most :data:`AUTO_FRACTION` of its free memory; ``on`` forces it (GPU runs only); ``off``
keeps it on the host.
"""

from __future__ import annotations

import torch

from distlab.errors import ConfigError

MODES = ("auto", "on", "off")
AUTO_FRACTION = 0.25  # of the GPU's free memory at start, at most, for `auto` to move the data there


def nbytes(*datasets, mapped: bool = False) -> int:
    """Bytes of the tensors the data sets hold in memory (images and labels, or the token stream and
    windows); with ``mapped``, those of the memory-mapped files they read instead (a prepared corpus)."""
    total = 0
    for ds in datasets:
        if ds is None:
            continue
        for name in ("images", "labels", "tokens", "starts", "ignored"):
            t = getattr(ds, name, None)
            on_disk = name == "tokens" and getattr(ds, "mapped", False)
            if isinstance(t, torch.Tensor) and on_disk == mapped:
                total += t.numel() * t.element_size()
    return total


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def decide(mode: str, device: torch.device, need: int, free: int | None = None, mapped: int = 0) -> tuple[bool, str]:
    """Whether the data goes onto ``device`` and the header's words for it. ``need``: the bytes it holds
    in memory; ``mapped``: those it reads from memory-mapped files (a prepared corpus: pages the kernel
    caches, not the run's memory); ``free``: the device's free bytes (default: asked of CUDA)."""
    if mode not in MODES:
        raise ConfigError(f"unknown `data_on_device` {mode!r}; choose one of: {', '.join(MODES)}")
    where = f"in host memory ({_size(need)}" if not mapped else \
        f"memory-mapped from disk ({_size(mapped)}, read as batches need it" \
        + (f"; {_size(need)} more in host memory" if need else "")
    if device.type != "cuda":
        if mode == "on":
            raise ConfigError(f"`data_on_device` on keeps the data set in GPU memory, but this run is on "
                              f"{device.type}: its data is in host memory already; drop the flag or use --device cuda")
        return False, f"{where}; the run is on {device.type})"
    if mode == "off":
        return False, f"{where}), each batch copied to {device} (data_on_device off)"
    need += mapped  # on the device the whole corpus is copied
    if free is None:
        free, _ = torch.cuda.mem_get_info(device)
    share = need / max(free, 1)
    if mode == "on" or share <= AUTO_FRACTION:
        how = "asked for" if mode == "on" else f"auto: at most {AUTO_FRACTION:.0%} of free memory"
        return True, f"resident on {device} ({_size(need)}, {share:.1%} of its {_size(free)} free; {how})"
    return False, (f"in host memory, each batch copied to {device}: {_size(need)} is {share:.0%} of its "
                   f"{_size(free)} free, over auto's {AUTO_FRACTION:.0%} (data_on_device on forces it)")
