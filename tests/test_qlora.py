"""QLoRA's 4-bit base (``--base-dtype nf4``, distlab.train.quantized_base): each adapted layer's frozen weight
held as torchao's NF4 tensor, equal to one process on data and pipeline parallel, snapshots that hold the
values the model computes with and resume bitwise, less model state than a bf16 base, and the layouts that
cannot hold it refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import patience

SPEC = "r=4,alpha=8,targets=q,v,o_proj,down"


def _torchao():
    pytest.importorskip("torchao", reason="torchao (the test extra) is not installed: pip install -e '.[test]'")


def test_a_quantized_layer_computes_with_nf4s_values_and_its_adapter():
    """The adapted layer's weight becomes torchao's NF4 tensor of the bf16 weight (blocks of 64, the scales
    of a small layer in blocks dividing their count); the layer computes F.linear with those dequantized
    values plus the adapter's update, and its state dict holds the dequantized values."""
    _torchao()
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from distlab.models import lora
    from distlab.train.quantized_base import quantize, scaler_block
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))  # (the last: a head, kept)
    original = model[0].weight.detach().to(torch.bfloat16)
    lora.apply(model, lora.LoRASpec.parse("r=2,alpha=4,targets=0"))
    with torch.no_grad():
        model[0].lora_b.normal_()
    assert quantize(model) == 1 and quantize(model) == 0  # once
    values = to_nf4(original, 64, scaler_block(original.numel())).get_original_weight()
    assert torch.equal(model.state_dict()["0.weight"], values) and model.state_dict()["0.weight"].dtype == torch.bfloat16
    blocks = values.flatten().reshape(-1, 64)
    assert max(len(b.unique()) for b in blocks) <= 16  # 4 bits: at most 16 levels (times its scale) per block
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (the dequantized weight in bf16 under autocast)
        got = model[0](x)
        expected = (torch.nn.functional.linear(x, values.float()) + model[0].bias) + \
            torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].lora_a), model[0].lora_b) * 2.0
    assert torch.equal(got, expected)
    assert scaler_block(64 * 256) == 256 and scaler_block(64 * 12) == 12 and scaler_block(64 * 300) == 150


@pytest.mark.parametrize("shape,parts,dim", [((16, 16), 2, 1), ((48, 64), 4, 1), ((128, 96), 2, 1),
                                             ((256, 512), 4, 1), ((32, 16), 2, 0), ((256, 512), 4, 0)])
def test_a_tensor_parallel_part_of_an_nf4_weight_dequantizes_to_the_wholes_values_there(shape, parts, dim):
    """Each rank's part (rows: a column-parallel layer's; columns: a row-parallel one's, their runs shorter
    than a block or not) dequantizes to the whole NF4 weight's values there bit for bit, computes F.linear
    with them, and holds about 4 bits a value; a run of an odd number of values is refused."""
    _torchao()
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from distlab.errors import ConfigError
    from distlab.models import nf4
    from distlab.train.quantized_base import BLOCK, part, scaler_block
    torch.manual_seed(0)
    whole = to_nf4(torch.randn(shape, dtype=torch.bfloat16), BLOCK, scaler_block(shape[0] * shape[1]))
    values = whole.get_original_weight()
    assert [(t.numel(), t.element_size()) for t in (getattr(whole, k) for k in nf4.PARTS)] == nf4.tensors(shape)
    assert list(whole.__tensor_flatten__()[0]) == list(nf4.PARTS)
    for rank in range(parts):
        mine = part(whole, dim, rank, parts)
        expected = values.chunk(parts, dim)[rank]
        assert torch.equal(mine.get_original_weight(), expected)
        x = torch.randn(3, expected.shape[1], dtype=torch.bfloat16)
        assert torch.equal(torch.nn.functional.linear(x, mine), torch.nn.functional.linear(x, expected))
        held = [(t.numel(), t.element_size()) for t in (getattr(mine, k) for k in nf4.PARTS)]
        assert held == nf4.tensors(shape, dim, parts)  # the sizes the planner prices
        assert sum(a * b for a, b in held[:4]) * 8 <= expected.numel() * (4 + 8 / mine.block_size + 16 / mine.block_size) + 16
    with pytest.raises(ConfigError, match="even number"):
        part(to_nf4(torch.randn(64, 6, dtype=torch.bfloat16), BLOCK, 6), 1, 0, 2)


def _zero3_quantized(rank, world):
    from distlab.models import lora
    from distlab.parallel import Zero
    from distlab.train.quantized_base import quantize
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    alone, model = make(), make()
    for m in (alone, model):
        lora.apply(m, lora.LoRASpec.parse("r=2,alpha=4,targets=0"))
        m.load_state_dict(alone.state_dict())
    quantize(alone)
    zero = Zero(model, 3)
    assert quantize(model, zero.convert_frozen) == 1
    held = {u.name.rsplit(".", 1)[1]: (u.shard.numel(), u.full.untyped_storage().nbytes()) for u in zero.codes}
    x = torch.randn(4, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = zero(x), alone(x)
    got.float().sum().backward()
    zero.sync_gradients()
    freed = all(not u.gathered for u in zero.codes)
    whole = zero.sharded_state_dict()["whole"][0]["shard"]
    return held, torch.equal(got, expected), freed, torch.equal(whole, alone.state_dict()["0.weight"])


def test_zero3_shards_a_4bit_weight_by_its_codes_and_scales_and_gathers_it_to_compute():
    """ZeRO-3 over 3 ranks holds each part of a 4-bit weight (its 4,096 bytes of codes, 128 block scales,
    1 factor, the scales' mean and the 16 levels) as a third of it, freed between uses; gathered, the layer
    computes what the weight held whole does, bit for bit, and a state dict holds its dequantized values."""
    _torchao()
    from distlab.launch.spawn import run_ranks
    for held, same, freed, state in run_ranks(_zero3_quantized, 3, timeout=patience(60)):
        assert held == {"quantized_data": (1366, 0), "quantized_scalers": (43, 0), "quantization_factor": (1, 0),
                        "scaler_mean": (1, 0), "nf4": (6, 0)}, held
        assert same and freed and state


def test_qlora_on_data_pipeline_and_zero_parallel_equals_one_process():
    """verify's bf16 bound: the same weights quantized the same way on every rank as on one process -- under ZeRO
    each quantized weight leaves ZeRO's units whole once its values are in place (ZeRO-3 gathering it for that),
    the rest of the base and the adapters sharded."""
    _torchao()
    from distlab.tools.verify import parse_strategy, verify
    cases = [parse_strategy(f"{s}+bf16+llama+lora=r=2,alpha=4,targets=q,v,o,down+base=nf4")
             for s in ("bucketed", "bucketed+pp=2+microbatches=2", "zero=3+ckpt+accum=2")]  # (ZeRO-1, -2, -3
    # alone: docs/composition.md's cells, tests/test_composition.py)
    records = verify(cases, 2, steps=3, timeout=patience(600))
    failed = [(r["strategy"], r["max_abs_param_diff"], r["tolerance"]) for r in records if not r["passed"]]
    assert not failed, failed


def test_a_qlora_fine_tune_resumes_bitwise_and_holds_less_than_a_bf16_base(run_cli, refused_here, tmp_path):
    """`--base-dtype nf4` from a Hugging Face checkpoint on 2 processes: the header says so; a run stopped at
    step 2 and resumed ends bitwise where the uninterrupted one does (the snapshot's dequantized weights
    quantize back to the same values); its snapshot holds those bf16 values; its model state is below the
    same run's with a bf16 base; under ZeRO-3 and under tensor parallel too a run resumes, its frozen weights the
    same dequantized values; a missing --precision bf16 is refused in one line."""
    _torchao()
    from tests.test_hf import _saved
    from tests.test_lora import _whole
    _saved("LlamaForCausalLM", tmp_path / "in")
    base = ["train", "--init-from", f"hf:{tmp_path / 'in'}", "--dataset", "synthetic-text:2000", "--block-size",
            "16", "--global-batch-size", "8", "--optimizer", "adamw", "--lr", "0.01", "--lr-schedule", "constant",
            "--no-progress", "--nproc-per-node", "2", "--lora", SPEC, "--precision", "bf16", "--snapshot-every", "2",
            "--keep-snapshots", "5"]
    nf4 = [*base, "--base-dtype", "nf4"]
    whole = run_cli(*nf4, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "a"), "--out", str(tmp_path / "arun"),
                    check=True)
    assert "held in nf4" in whole.stdout, whole.stdout
    run_cli(*nf4, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "b"), "--out", str(tmp_path / "brun"), check=True)
    run_cli(*nf4, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "b"), "--resume", "auto", "--out",
            str(tmp_path / "brun2"), check=True)
    a, b = (_whole(next((tmp_path / d).glob("step-*4"))) for d in ("a", "b"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert a["1.attn.q.weight"].dtype == torch.bfloat16 and a["1.attn.q.lora_a"].dtype == torch.float32
    run_cli(*base, "--base-dtype", "bf16", "--max-steps", "2", "--snapshot-dir", str(tmp_path / "c"), "--out",
            str(tmp_path / "crun"), check=True)
    held = [json.loads((tmp_path / d / "summary.json").read_text())["model_state_bytes_per_rank"]
            for d in ("arun", "crun")]
    assert held[0] < held[1], held
    zero = [*nf4, "--zero", "3"]
    first = run_cli(*zero, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "z"), "--out", str(tmp_path / "zrun"),
                    check=True)
    assert "held in nf4" in first.stdout, first.stdout
    run_cli(*zero, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "z"), "--resume", "auto", "--out",
            str(tmp_path / "zrun2"), check=True)
    z = _whole(next((tmp_path / "z").glob("step-*4")))
    frozen = [k for k in a if k.endswith("weight") and k.replace("weight", "lora_a") in a]
    assert len(frozen) == 8 and all(torch.equal(a[k], z[k]) for k in frozen)
    # tensor parallel: each rank's part of the weight quantized whole, and again so from a snapshot's part
    # (a part quantized alone would hold other values: the row-parallel 1.attn.proj's do)
    tp = [*nf4, "--tp", "2"]
    run_cli(*tp, "--max-steps", "2", "--snapshot-dir", str(tmp_path / "t"), "--out", str(tmp_path / "trun"), check=True)
    run_cli(*tp, "--max-steps", "4", "--snapshot-dir", str(tmp_path / "t"), "--resume", "auto", "--out",
            str(tmp_path / "trun2"), check=True)
    t = _whole(next((tmp_path / "t").glob("step-*4")))
    assert all(torch.equal(a[k], t[k]) for k in frozen)
    fp32 = [a if a != "bf16" else "fp32" for a in nf4]  # (--precision fp32)
    proc = refused_here(*fp32, "--max-steps", "1", "--snapshot-dir", str(tmp_path / "none"))
    assert proc.stderr.count("\n") == 1 and "add --precision bf16" in proc.stderr, proc.stderr


def test_a_qlora_run_without_snapshots_leaves_its_final_model_with_the_weights_it_computed_with(run_cli, tmp_path):
    """A QLoRA run on 2 processes that keeps no snapshots writes its final model (OUT/model.safetensors) and
    summary: each adapted layer's frozen weight there is the NF4 dequantization of the checkpoint's weight
    (the values the run computed with, bitwise), the adapters float32; a text sample is drawn from the
    quantized model mid-run as well."""
    _torchao()
    from safetensors.torch import load_file
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from tests.test_hf import _saved
    from distlab.train.quantized_base import BLOCK, scaler_block
    theirs = _saved("LlamaForCausalLM", tmp_path / "in")
    run_cli("train", "--init-from", f"hf:{tmp_path / 'in'}", "--dataset", "synthetic-text:2000", "--block-size", "16",
            "--global-batch-size", "8", "--optimizer", "adamw", "--no-progress", "--nproc-per-node", "2",
            "--lora", "r=4,alpha=8,targets=q,v", "--precision", "bf16", "--base-dtype", "nf4", "--max-steps", "2",
            "--sample-every", "2", "--out", str(tmp_path / "run"), check=True)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    state = load_file(tmp_path / "run" / "model.safetensors")
    for i, layer in enumerate(theirs.model.layers):
        for mine, hf_name in (("q", "q_proj"), ("v", "v_proj")):
            weight = getattr(layer.self_attn, hf_name).weight.detach().to(torch.bfloat16)
            expected = to_nf4(weight, BLOCK, scaler_block(weight.numel())).get_original_weight()
            assert torch.equal(state[f"{i + 1}.attn.{mine}.weight"], expected), (i, mine)
            assert state[f"{i + 1}.attn.{mine}.lora_a"].dtype == torch.float32
