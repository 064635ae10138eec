"""A model built on the meta device gets, one tensor at a time, the values a real build gives it; no rank of a
sharded layout ever holds the whole model while it loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distlab.models import build_model
from distlab.models.deferred import deferred

FAMILIES = [("mlp", (1, 28, 28), 10), ("mlp-bn", (1, 28, 28), 10), ("small-cnn-bn", (1, 28, 28), 10),
            ("vgg11-bn", (3, 32, 32), 10), ("resnet18", (3, 32, 32), 10), ("gpt", (16,), 64), ("llama", (16,), 64),
            ("gpt-moe", (16,), 64), ("llama-moe", (16,), 64)]


def _tensors(model):
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


@pytest.mark.parametrize("name,shape,classes", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_meta_build_gives_every_tensor_a_real_builds_values_and_leaves_the_same_random_state(name, shape, classes):
    """Built on the meta device (no tensor has memory), then replayed tensor by tensor: every parameter and
    buffer equals a seeded real build's bitwise, in its dtype, and the random state afterwards is the one the
    real build leaves (training draws its dropout and everything after from it)."""
    torch.manual_seed(7)
    real = _tensors(build_model(name, shape, classes))
    after_real = torch.get_rng_state()
    torch.manual_seed(7)
    model, init = deferred(lambda: build_model(name, shape, classes))
    assert init is not None and all(t.is_meta for t in _tensors(model).values())
    got = {n: t for names, t in init.tensors() for n in names}
    assert sorted(got) == sorted(real)
    assert all(got[k].dtype == real[k].dtype and torch.equal(got[k], real[k]) for k in real)
    assert torch.equal(torch.get_rng_state(), after_real)


class _Computed(nn.Module):
    """A builder the replay cannot follow: one weight computed from another."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Parameter(self.a.weight.detach() * 2)


class _Loose(nn.Module):
    """A tensor kept as a plain attribute (no parameter, no buffer): nothing would give it values."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = torch.ones(4)


@pytest.mark.parametrize("cls", [_Computed, _Loose])
def test_a_build_that_cannot_be_replayed_is_built_whole_as_before(cls):
    torch.manual_seed(3)
    expected = _tensors(cls())
    torch.manual_seed(3)
    model, init = deferred(cls)
    assert init is None
    assert all(torch.equal(t, expected[k]) for k, t in _tensors(model).items())


def _config(strategy):
    from distlab.parallel import Strategy
    from distlab.train import TrainConfig
    return TrainConfig.from_flags(model="gpt", n_layer=8, n_embd=1024, n_head=8, block_size=16,
                                  dataset="synthetic-text:3000", global_batch_size=4, max_steps=1, optimizer="sgd",
                                  progress=False, verbose=False, eval_every_epoch=False,
                                  strategy=Strategy.parse(strategy))


def _load(rank, world, strategy):
    import torch._dynamo  # noqa: F401 - imported by torch under the meta build's dispatch mode: code, not the model
    from distlab import runtime
    from distlab.bench.load_peak import peak, reset_peak, rss
    from distlab.train import Trainer
    cfg = _config(strategy).validate(world)
    reset_peak()
    before = rss()
    trainer = Trainer(cfg, runtime.from_process_group())
    return peak() - before, trainer.engine.observe(), 4 * trainer.num_parameters


def test_no_rank_of_a_sharded_layout_holds_the_whole_model_while_it_loads():
    """ZeRO-3 on 2 ranks, a 101M-parameter GPT (405 MB in float32, its largest tensor 16.8 MB): while the trainer
    is made, each rank's resident set grows by less than the whole model (it grew by the whole model and more:
    every rank built and initialised all of it before cutting), by at least the half it holds, and by at most
    10% more than `distlab plan` predicts for loading (its shards + the largest tensor)."""
    from distlab.data import dataset_shape
    from distlab.launch.spawn import run_ranks
    from distlab.plan import Layout, Link, predict, trace
    cfg = _config("allreduce+zero=3").validate(2)
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size, cfg.tokenizer)
    lay = Layout(dp=2, strategy=cfg.strategy, optimizer=cfg.optimizer, momentum=cfg.momentum,
                 global_batch=cfg.global_batch_size)
    planned = predict(trace(cfg.model, shape, classes, options=cfg.options), lay, Link(), None)
    for peak, held, whole in run_ranks(_load, 2, "allreduce+zero=3", timeout=600):
        assert held == planned["parameter_bytes_per_rank"] < whole / 2 + 2**20  # its shards (zero padding aside)
        assert held <= peak <= 1.1 * planned["load_peak_bytes_per_rank"] < whole, (peak, planned, whole)
