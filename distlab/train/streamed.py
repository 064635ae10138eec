"""Files written as a stream, hashed on the way: a model's state never serialized whole in memory beside itself.

A 1B-parameter model's state is 4 GB in float32; a writer that first serializes it (``safetensors.torch.save``
returns bytes; ``torch.save`` into a ``BytesIO``) and then reads the file back for its checksum holds the state
three times over. Here each tensor's bytes go to the file as they are (a view, not a copy) and into the SHA-256 as
they pass: :class:`HashingFile` (under ``torch.save``), :func:`write_safetensors` (the safetensors format, written
tensor by tensor -- the ``safetensors`` library's writers take every tensor's bytes at once; its readers read what
this writes, and the tests check they do).
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

# safetensors' dtype names (its format: an 8-byte little-endian header length, the JSON header, the data)
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class HashingFile:
    """A file that hashes and counts what is written through it (``torch.save`` streams into it). An OSError
    inside the write is kept in :attr:`error` (torch.save reports it as its own error) to be raised as it was."""

    def __init__(self, f):
        self.f, self.sha, self.bytes, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        self.sha.update(data)
        self.bytes += len(memoryview(data).cast("B"))
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _raw(t: torch.Tensor):
    """A CPU tensor's bytes, as a buffer over its memory (no copy where it is already contiguous)."""
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def write_safetensors(f, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> HashingFile:
    """``state`` in the safetensors format to the open binary file ``f``, one tensor at a time (the header from
    the shapes, before any data); returns the :class:`HashingFile` that wrote it (its checksum and size)."""
    out = HashingFile(f)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, t in state.items():
        if t.dtype not in DTYPES:
            raise TypeError(f"{key}: safetensors holds no {t.dtype}")
        size = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library pads it
    out.write(struct.pack("<Q", len(text)))
    out.write(text)
    for t in state.values():
        if t.numel():
            out.write(_raw(t))
    return out
