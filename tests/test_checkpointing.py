"""Activation checkpointing: the same gradients and BatchNorm statistics bit for bit, fewer bytes
held for backward, and the blocks each model lists."""

import pytest
import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models import build_model, task_loss
from distlab.parallel import Strategy
from distlab.parallel.checkpointing import apply_activation_checkpointing, checkpoint_blocks
from distlab.parallel.pipeline import ActivationMeter

MODELS = [("mlp", (1, 8, 8), {"widths": (32, 32, 16)}), ("mlp-bn", (1, 8, 8), {}), ("vgg11-bn", (3, 16, 16), {}),
          ("resnet18", (3, 8, 8), {}), ("gpt", (16,), {"vocab": 20, "n_layer": 3, "n_embd": 32})]


def _step(name, shape, options, checkpointed, every=1, policy="block"):
    torch.manual_seed(0)
    if name == "gpt":
        from distlab.models.gpt import GPT
        model = GPT(options["vocab"], shape[0], n_layer=options["n_layer"], n_head=4, n_embd=options["n_embd"])
        x = torch.randint(0, options["vocab"], (4, *shape))
        y = torch.randint(0, options["vocab"], (4, *shape))
    else:
        model = build_model(name, shape, 10, **options)
        x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    blocks = apply_activation_checkpointing(model, every, policy) if checkpointed else 0
    model.train()
    with ActivationMeter(model.parameters()) as meter:
        loss = task_loss(model(x), y)
        loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.detach(), grads, {k: v.clone() for k, v in model.state_dict().items()}, meter.peak, blocks


@pytest.mark.parametrize("name,shape,options", MODELS, ids=[m[0] for m in MODELS])
def test_checkpointed_step_is_bitwise_equal_and_holds_less(name, shape, options):
    loss, grads, state, peak, _ = _step(name, shape, options, False)
    loss_c, grads_c, state_c, peak_c, blocks = _step(name, shape, options, True)
    assert blocks >= 2
    assert torch.equal(loss, loss_c)
    assert grads.keys() == grads_c.keys() and all(torch.equal(grads[k], grads_c[k]) for k in grads), name
    # BatchNorm's running statistics (and every other buffer) updated once, not twice
    assert state.keys() == state_c.keys() and all(torch.equal(state[k], state_c[k]) for k in state), name
    # An MLP's Linear + ReLU block saves nothing but its input anyway (ReLU's output is the next
    # Linear's input): no gain there. Convolution, BatchNorm and attention blocks save much more.
    assert peak_c < peak if name in ("vgg11-bn", "resnet18", "gpt") else peak_c <= peak, (name, peak_c, peak)


def test_one_block_in_every_k_recomputed_bitwise_equal_holding_between():
    """Selective checkpointing per block (``ac_every``): the first block and every K-th after it recompute; the
    step is bit for bit the plain one's, and it holds less than none checkpointed, more than all."""
    name, shape, options = "gpt", (16,), {"vocab": 20, "n_layer": 4, "n_embd": 32}
    loss, grads, _, peak, _ = _step(name, shape, options, False)
    _, _, _, peak_all, every_block = _step(name, shape, options, True)
    loss_2, grads_2, _, peak_2, half = _step(name, shape, options, True, every=2)
    assert (every_block, half) == (4, 2)
    assert torch.equal(loss, loss_2) and all(torch.equal(grads[k], grads_2[k]) for k in grads)
    assert peak_all < peak_2 < peak
    assert Strategy(activation_checkpointing=True, ac_every=2).checkpointed([["a"], ["b"], ["c"]]) == [["a"], ["c"]]
    assert Strategy(activation_checkpointing=True, ac_every=3).checkpointed([["a"], ["b"]]) == [["a"]]
    assert Strategy().checkpointed([["a"]]) == []
    assert str(Strategy.parse("zero=3+ckpt+ac_every=2")) == "zero=3+ckpt+ac_every=2"
    with pytest.raises(ConfigError, match="turn on `activation_checkpointing`"):
        Strategy(ac_every=2).check()
    with pytest.raises(ConfigError, match="at least 1"):
        Strategy(activation_checkpointing=True, ac_every=0).check()


def test_selective_per_op_keeps_attention_and_every_other_matmul_bitwise_equal():
    """``ac_policy`` ops (torch's selective checkpointing): inside each checkpointed block the attention's and
    every other matrix multiplication's outputs are kept, the rest recomputed -- the step bit for bit the plain
    one's, holding more than the block's input alone and less than nothing checkpointed."""
    name, shape, options = "gpt", (16,), {"vocab": 20, "n_layer": 3, "n_embd": 32}
    loss, grads, _, peak, _ = _step(name, shape, options, False)
    _, _, _, peak_block, _ = _step(name, shape, options, True)
    loss_o, grads_o, _, peak_ops, blocks = _step(name, shape, options, True, policy="ops")
    assert blocks == 3
    assert torch.equal(loss, loss_o) and all(torch.equal(grads[k], grads_o[k]) for k in grads)
    assert peak_block < peak_ops < peak
    assert str(Strategy.parse("zero=3+ckpt+ac_policy=ops")) == "zero=3+ckpt+ac_policy=ops"
    with pytest.raises(ConfigError, match="turn on `activation_checkpointing`"):
        Strategy(ac_policy="ops").check()
    with pytest.raises(ConfigError, match="ac_policy"):
        Strategy(activation_checkpointing=True, ac_policy="some").check()


def test_blocks_listed_per_model_and_state_dict_keys_unchanged():
    vgg = build_model("vgg11", (3, 32, 32), 10)
    keys = list(vgg.state_dict())
    [(features, ranges)] = checkpoint_blocks(vgg)
    assert len(ranges) == 5 and all(isinstance(features[end - 1], nn.MaxPool2d) for _, end in ranges)  # 5 stages
    apply_activation_checkpointing(vgg)
    assert list(vgg.state_dict()) == keys
    resnet = build_model("resnet18", (3, 32, 32), 10)
    assert [len(r) for _, r in checkpoint_blocks(resnet)] == [1, 8]  # the stem and 8 residual blocks
    with pytest.raises(ConfigError, match="has no checkpoint_blocks"):
        checkpoint_blocks(nn.Linear(2, 2))


def test_strategy_text_and_composition():
    s = Strategy.parse("bucketed+ckpt")
    assert s.activation_checkpointing and str(s) == "bucketed+ckpt" and Strategy.from_dict(s.to_dict()) == s
    s = Strategy.parse("bucketed+pp=2+ckpt+bf16")  # with pipelines too (tests/test_pipeline.py)
    assert s.check(2).activation_checkpointing and s.precision == "bf16"


def test_bench_checkpointing_records_both_variants(tmp_path):
    from distlab.bench import checkpointing
    from distlab.bench.markdown import render
    [r] = checkpointing.run(["gpt"], steps=2, batch=2, out=tmp_path, progress=lambda *_: None)
    assert r["gradients_bitwise_equal"] and r["activation_peak_bytes_checkpointed"] < r["activation_peak_bytes_plain"]
    assert r["time_per_step_s_plain"] > 0 and "| gpt | 2 |" in render(tmp_path / "checkpointing.json")



def test_bench_checkpointing_runs_a_pipeline_with_every_stage_checkpointed(tmp_path):
    from distlab.bench import checkpointing
    [r] = checkpointing.run(["gpt"], steps=2, batch=4, pp=2, microbatches=2, precision="bf16", out=tmp_path,
                            progress=lambda *_: None)
    assert r["gradients_bitwise_equal"] and (r["pp"], r["microbatches"], r["precision"]) == (2, 2, "bf16")
    plain, ckpt = r["activation_peak_bytes_per_stage_plain"], r["activation_peak_bytes_per_stage_checkpointed"]
    assert len(plain) == 2 and all(c < p for c, p in zip(ckpt, plain))  # both stages hold blocks of the 4
    assert r["activation_peak_bytes_checkpointed"] == max(ckpt) and r["ranks"] == 2
    from distlab.bench.markdown import render
    from distlab.tools.report import bench_kind
    assert "| gpt pp 2 x mb 2 bf16 | 4 |" in render(tmp_path / "checkpointing.json")  # not taken for bench pipeline's
    assert bench_kind([r]) == "checkpointing"
