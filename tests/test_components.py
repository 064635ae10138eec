"""A parallelism of one's own: its own file and one registry line, and the Engine, the strategy's
text form and ``verify`` take it as they take the built-in ones (distlab.parallel.components)."""

from __future__ import annotations

import pytest
import torch

from distlab.errors import ConfigError
from distlab.parallel import Strategy, build_mesh, components, parallelize

TOY = '''"""Toy model-sharding components: every gradient multiplied by a factor after the gradient sync."""
import torch


class Scale:
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
