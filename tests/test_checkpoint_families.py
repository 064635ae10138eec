"""The checkpoints people download, read as transformers reads them: rotary scaling (Llama 3.1+'s llama3,
linear, Qwen2.5's yarn) -- logits equal to transformers' within twice its float32 rounding, through the
layouts and out bitwise, and generation's cache past the training window. Tiny random configs, made here
with the published keys."""

from __future__ import annotations

import json

import pytest
import torch

from distlab.errors import ConfigError
from distlab.models import hf, rope
from tests.conftest import invoke
from tests.test_hf import _agree, _saved, _transformers

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # Llama 3.1's keys; a tiny original context: every band in use
SCALINGS = [("LlamaForCausalLM", LLAMA3), ("LlamaForCausalLM", {"rope_type": "linear", "factor": 4.0}),
            ("Qwen2ForCausalLM", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})]


@pytest.mark.parametrize("arch,scaling", SCALINGS, ids=["llama3", "linear", "yarn"])
def test_a_scaled_rotary_checkpoint_gives_transformers_logits_and_goes_out_as_it_came(arch, scaling, tmp_path):
    """rope_scaling as Llama 3.1 and Qwen2.5 publish it (the old ``rope_scaling`` key, ``type`` for
    ``rope_type``): the logits over 48 positions (3x the original context) agree with transformers' float32
    forward within twice its own rounding (its float64 run the reference), and the export's config holds the
    same scaling transformers computes the same logits with."""
    theirs = _saved(arch, tmp_path / "in", rope_theta=10000.0)
    config = json.loads((tmp_path / "in" / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = scaling
    (tmp_path / "in" / "config.json").write_text(json.dumps(config))
    theirs = getattr(_transformers(), arch).from_pretrained(tmp_path / "in").eval()
    mine, record = hf.build(tmp_path / "in")
    kind = scaling.get("rope_type", scaling.get("type"))
    assert record["rope_scaling"].startswith(kind)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x).logits
    _agree(mine, theirs, x)  # (turns theirs to float64)
    plain = hf.build(tmp_path / "in")[0]
    for block in list(plain)[1:-1]:
        block.attn.rotary.scaling = None
    with torch.no_grad():  # the scaling matters here: unscaled, the logits are another model's
        assert (plain(x) - expected).abs().max() > 100 * (mine(x) - expected).abs().max()
    out = hf.write(mine.state_dict(), "llama", hf.options_of(hf.config_of(tmp_path / "in"), "")[2], 256, 64,
                   tmp_path / "out")
    back = _transformers().AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, expected)
