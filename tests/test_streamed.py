"""A model file is written as a stream (distlab.train.streamed): never the serialized state in memory beside the
state, its checksum taken on the way -- and the safetensors written tensor by tensor are what the safetensors
library reads."""

from __future__ import annotations

import hashlib
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distlab.train.export import write_state
from distlab.train.streamed import write_safetensors


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_a_model_file_is_streamed_not_serialized_in_memory_first(tmp_path, name):
    """Writing a 64 MiB state allocates far less than it in Python objects (the serialized bytes, the file read
    back for its checksum: each 64 MiB before); the file reads back equal and its checksum is the file's."""
    state = {"big": torch.arange(16 << 20, dtype=torch.float32), "small": torch.ones(3, 4, dtype=torch.bfloat16)}
    out = tmp_path / name
    tracemalloc.start()
    try:
        written = write_state(state, {"model": "gpt", "step": 3}, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak / 2**20:.0f} MiB allocated while writing"
    back = load_file(out) if name.endswith(".safetensors") else torch.load(out, weights_only=True)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert written["sha256"] == digest and (tmp_path / f"{name}.sha256").read_text() == f"{digest}  {name}\n"
    assert written["bytes"] == out.stat().st_size


def test_the_safetensors_library_reads_every_dtype_and_shape_written_tensor_by_tensor(tmp_path):
    """Every dtype safetensors names, 0-dim, empty and non-contiguous tensors, and the metadata: what the library
    reads of the streamed file equals what was given; the sizes and offsets are its own (bytes = header + data)."""
    g = torch.Generator().manual_seed(0)
    state = {
        "f32": torch.randn(5, 3, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 2, generator=g).half(), "f64": torch.randn(3, generator=g).double(),
        "i64": torch.arange(-4, 5), "i32": torch.arange(6, dtype=torch.int32).view(2, 3), "i8": torch.tensor([-1, 2],
        dtype=torch.int8), "u8": torch.tensor([255, 0], dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "strided": torch.randn(4, 6, generator=g).t(),
    }
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        written = write_safetensors(f, state, {"format": "pt", "step": "7"})
    assert written.bytes == path.stat().st_size
    assert written.sha.hexdigest() == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(path)
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}


def test_a_dtype_safetensors_cannot_hold_is_refused_by_name(tmp_path):
    with open(tmp_path / "m.safetensors", "wb") as f, pytest.raises(TypeError, match="w: safetensors holds no"):
        write_safetensors(f, {"w": torch.zeros(2, dtype=torch.complex64)})
