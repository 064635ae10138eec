"""A parallelism of one's own: its own file and one registry line, and the Engine, the strategy's
text form and ``verify`` take it as they take the built-in ones (distlab.parallel.components)."""

from __future__ import annotations

import pytest
import torch

from distlab.errors import ConfigError
from distlab.parallel import Strategy, build_mesh, components, parallelize

TOY = '''"""Toy model-sharding components: every gradient multiplied by a factor after the gradient sync."""
import torch

from distlab.parallel.protocols import ComponentKind


class Scale(ComponentKind):
    factor = 1.0
    lockstep = False

    def __init__(self, params):
        self.params = params

    @classmethod
    def apply(cls, model, strategy, mesh):
        return model, cls(list(model.parameters()))

    def prepare_batch(self, *tensors):
        return tensors

    @torch.no_grad()
    def reduce_gradients(self):
        for p in self.params:
            p.grad.mul_(self.factor)


class UnitScale(Scale):
    name = "unit-scale"


class DoubleScale(Scale):
    name = "double-scale"
    factor = 2.0

    @classmethod
    def describe(cls, engine):
        return [f"double-scale: every gradient x {cls.factor:g} after the sync"]

    @classmethod
    def report(cls, engine):
        return {"factor": cls.factor}


class NotAKind:
    name = "not-a-kind"
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's own file, and its registry lines (through the environment, so worker processes see them)."""
    (tmp_path / "toy_scale.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(components.ENV, "")
    components.register("unit-scale", "toy_scale:UnitScale")
    components.register("double-scale", "toy_scale:DoubleScale")


def test_a_registered_component_is_named_by_a_strategy_and_held_by_the_engine(toy):
    s = Strategy.parse("bucketed+unit-scale")
    assert s.components == ("unit-scale",) and str(s) == "bucketed+unit-scale"
    assert Strategy.from_dict(s.to_dict()) == s and "components" not in Strategy().to_dict()
    torch.manual_seed(0)
    engine = parallelize(torch.nn.Sequential(torch.nn.Linear(4, 3)), s, build_mesh(1))
    assert [type(c).__name__ for c in engine.components] == ["UnitScale"]
    with pytest.raises(ConfigError, match="'unit-scal'.*did you mean unit-scale"):
        Strategy(components=("unit-scal",)).check()


def test_an_unregistered_component_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv(components.ENV, raising=False)
    with pytest.raises(ConfigError, match="not a modifier"):
        Strategy.parse("bucketed+unit-scale")
    with pytest.raises(ConfigError, match="none is registered"):
        Strategy(components=("unit-scale",)).check()


def test_verify_runs_a_registered_component_against_one_process(toy):
    """Two ranks: scaling the gradients by 1 trains the single-process model (verify's float32 bound);
    scaling them by 2 does not -- verify ran the component, not around it."""
    from distlab.tools.verify import parse_strategy, verify
    unit, double = verify([parse_strategy("bucketed+unit-scale"), parse_strategy("bucketed+double-scale")], 2,
                          steps=3, timeout=120)
    assert unit["strategy"] == "bucketed+unit-scale" and unit["passed"], unit
    assert double["passed"] is False and double["max_abs_param_diff"] > 10 * double["tolerance"], double


def test_a_kind_is_a_component_kind_and_what_it_leaves_out_defaults(toy):
    """The contract: a registered class that is not a ComponentKind is refused in one line; a kind
    without a price is refused by the planner, never left out of a prediction; a kind's description
    and report reach the run's header and summary."""
    components.register("not-a-kind", "toy_scale:NotAKind")
    with pytest.raises(ConfigError, match="toy_scale:NotAKind is not a component kind: subclass "
                                          "distlab.parallel.protocols.ComponentKind"):
        components.kinds()
    components.register("not-a-kind", "toy_scale:UnitScale")  # the line mended
    from distlab.plan import Layout, Link, predict, trace
    t = trace("mlp", (1, 8, 8), 4, widths=(8,))
    with pytest.raises(ConfigError, match="component double-scale cannot be planned yet: its kind DoubleScale has "
                                          "no price"):
        predict(t, Layout(dp=2, global_batch=8, strategy=Strategy.parse("bucketed+double-scale")), Link(), None)
    assert predict(t, Layout(dp=2, global_batch=8), Link(), None)["model_state_bytes_per_rank"] > 0
    from distlab.launch.spawn import run_ranks
    header, summary = run_ranks(_header_and_summary, 1, timeout=120)[0]
    assert "double-scale: every gradient x 2 after the sync" in header, header
    assert summary["components"] == {"double-scale": {"factor": 2.0}}


def _header_and_summary(rank, world):
    from distlab import runtime
    from distlab.train import Trainer, TrainConfig
    from distlab.train.header import header
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(8,), dataset="synthetic:1x8x8:4:64", max_steps=2,
                                 global_batch_size=8, progress=False, verbose=False, eval_every_epoch=False,
                                 components=("double-scale",)).validate(1)
    trainer = Trainer(cfg, runtime.from_process_group())
    return header(trainer), trainer.fit()
