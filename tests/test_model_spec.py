"""A model family is a spec: defined here, registered in one line, it trains, verifies and is planned
like the built-in ones (distlab.models.spec)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from distlab.errors import ConfigError
from distlab.models import register
from distlab.models.llama import LlamaOptions
from distlab.models.spec import ModelSpec, Options, option


@dataclass(frozen=True)
class BigramOptions(Options):
    width: int = option(16, "bigram-mlp: hidden width.")

    def check(self) -> None:
        if self.width < 2:
            raise ConfigError(f"`width` must be at least 2, not {self.width}")

    def describe(self) -> str:
        return f"hidden width {self.width}"


class BigramMLP(nn.Sequential):
    """Each position's next token from its own token only: embedding, a ReLU layer, the logits."""

    def __init__(self, vocab: int, block_size: int, width: int):
        super().__init__(nn.Embedding(vocab, width), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, vocab))
        self.block_size = block_size


register(ModelSpec("bigram-mlp", lambda shape, vocab, o: BigramMLP(vocab, shape[0], o.width), BigramOptions, text=True))


def _cfg(**changes):
    from distlab.train import TrainConfig
    return TrainConfig.from_flags(**{**dict(model="bigram-mlp", width=8, dataset="synthetic-text:2000", block_size=8,
                                            global_batch_size=8, max_steps=4, log_every=1, lr=0.05, progress=False, verbose=False,
                                            eval_every_epoch=False), **changes})


def _train(rank, world, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    from distlab.train.header import header
    trainer = Trainer(cfg, runtime.from_process_group())
    trainer.fit()
    module = trainer.engine.module
    return (type(module).__name__, module[0].embedding_dim, [r["loss"] for r in trainer.history],
            next(line for line in header(trainer) if line.startswith("model")))


def test_a_family_of_ones_own_trains_with_its_options_described():
    from distlab.launch.spawn import run_ranks
    cfg = _cfg().validate(1)
    assert cfg.options == BigramOptions(width=8) and cfg.to_dict()["width"] == 8
    name, width, losses, model_line = run_ranks(_train, 1, cfg, timeout=120)[0]
    assert (name, width, len(losses)) == ("BigramMLP", 8, 4) and all(torch.isfinite(torch.tensor(losses)))
    assert "model    bigram-mlp (hidden width 8, context 8)" in model_line, model_line


def test_its_options_are_checked_and_others_refused():
    with pytest.raises(ConfigError, match="`width` must be at least 2, not 1"):
        _cfg(width=1)
    with pytest.raises(ConfigError, match=r"`n_layer` is an option \(--model gpt, gpt-moe, llama, llama-moe, gemma3, scaled-llama\); model bigram-mlp "
                                          r"has no "
                                          r"such option"):
        _cfg(n_layer=2)
    with pytest.raises(ConfigError, match=r"`width` is an option \(--model bigram-mlp\); model mlp has no such option"):
        _cfg(model="mlp", dataset="synthetic:1x4x4:2:64")
    with pytest.raises(ConfigError, match="predicts tokens but dataset synthetic:1x4x4:2:64 is images"):
        _cfg(dataset="synthetic:1x4x4:2:64").validate(1)


def test_it_verifies_on_data_parallel_zero_and_a_pipeline():
    from distlab.tools.verify import parse_strategy, verify
    cases = [parse_strategy(s) for s in ("bucketed:ring+bigram-mlp", "zero=3+bigram-mlp", "pp=2+bigram-mlp")]
    records = verify(cases, 2, steps=3, timeout=300)
    assert [r["model"] for r in records] == ["bigram-mlp"] * 3
    assert all(r["passed"] for r in records), records


def test_it_is_planned_from_its_own_parameters():
    from distlab.parallel import Strategy
    from distlab.plan import Layout, predict, trace
    from distlab.plan.machine import Link
    t = trace("bigram-mlp", (8,), 256, width=8)
    params = 256 * 8 + 8 * 8 + 8 + 8 * 256 + 256
    assert sum(t.numels) == params
    plain = predict(t, Layout(dp=2, global_batch=8), Link(), None)
    zero = predict(t, Layout(dp=2, global_batch=8, strategy=Strategy(zero=3)), Link(), None)
    assert plain["model_state_bytes_per_rank"] == 4 * params * 3  # weights, gradients, momentum (SGD)
    assert zero["model_state_bytes_per_rank"] < plain["model_state_bytes_per_rank"]


def _scaled_llama(shape, vocab, o):
    """The Llama family with Gemma's embedding: token rows scaled by sqrt(width) (the decoder's Embedding
    says so; a family's own embedding forward, which sequence parallel must keep)."""
    from distlab.models.llama import _build
    model = _build(shape, vocab, o)
    model[0].scale = o.n_embd ** 0.5
    return model


@dataclass(frozen=True)
class ScaledLlamaOptions(LlamaOptions):
    """The Llama family's options, a class of this module's: verify's ranks unpickle it, importing this
    module, which registers the family."""


register(ModelSpec("scaled-llama", _scaled_llama, ScaledLlamaOptions, text=True))

def test_a_family_that_scales_its_embedding_trains_equal_to_one_process_under_sequence_parallel():
    """Sequence parallel splits the family's own embedding forward (its token lookups reduce-scattered, then
    its own scale and positions for this rank's piece); it used to rebuild it as tok(idx) + pos, which
    dropped a scale silently (a Gemma-style model then trained another model under --sequence-parallel)."""
    from distlab.tools.verify import parse_strategy, verify
    records = verify([parse_strategy("allreduce+tp=2+sp+scaled-llama")], 2, steps=2, timeout=300)
    assert all(r["passed"] for r in records), records
