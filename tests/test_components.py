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


class BatchSplit(ComponentKind):
    """A mesh dimension of its own: each data-parallel rank's micro-batch split over its ranks, which
    hold the same model (the gradient sync averages over them)."""
    name = dim = "batch-split"
    replicates = True
    lockstep = False

    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    @classmethod
    def apply(cls, model, strategy, mesh):
        axis = mesh.dims[cls.dim]
        return model, cls(axis.size, axis.rank)

    def prepare_batch(self, *tensors):
        return tuple(t.tensor_split(self.size)[self.rank] for t in tensors)

    def reduce_gradients(self):
        pass

    @classmethod
    def price(cls, t, t_rank, lay, micro, optim):
        from distlab.parallel.cost import Price
        n = lay.strategy.size(cls.dim)
        return Price(compute_split=n, exact=False, report={"batch_split": {"size": n}},
                     activation_note=f", each rank holding 1/{n} of its data-parallel rank's micro-batch")

    @classmethod
    def describe(cls, engine):
        axis = engine.mesh.dims[cls.dim]
        return [f"batch-split: each micro-batch over {axis.size} ranks (this one: {axis.ranks})"]

    @classmethod
    def report(cls, engine):
        return {"size": engine.mesh.size(cls.dim)}
'''


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's own file, and its registry lines (through the environment, so worker processes see them)."""
    (tmp_path / "toy_scale.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(components.ENV, "")
    components.register("unit-scale", "toy_scale:UnitScale")
    components.register("double-scale", "toy_scale:DoubleScale")
    components.register("batch-split", "toy_scale:BatchSplit")


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


def test_a_kind_with_its_own_mesh_dimension_trains_verifies_and_is_priced(toy):
    """A parallelism with a mesh dimension of its own -- its file and one registry line: ``+NAME=N`` sizes
    it, the mesh makes its groups (between the data- and context-parallel dimensions), the data loader
    and the gradient sync see it, and it trains the single-process model (verify), is priced to the byte
    and described, on 4 ranks (dp 2 x batch-split 2)."""
    from distlab.parallel.mesh import Dim, layout
    s = Strategy.parse("bucketed+batch-split=2")
    assert s.dims == (("batch-split", 2),) and str(s) == "bucketed+batch-split=2"
    assert Strategy.from_dict(s.to_dict()) == s and s.to_dict()["dims"] == {"batch-split": 2}
    assert s.dp_size(4) == 2 and Strategy.parse("bucketed+batch-split=1") == Strategy()
    with pytest.raises(ConfigError, match="`batch-split` 2 = 2 does not divide the world size 3"):
        s.check(3)
    with pytest.raises(ConfigError, match="component batch-split splits over a mesh dimension of its own: give "
                                          "its size, \\+batch-split=N"):
        Strategy.parse("bucketed+batch-split")
    with pytest.raises(ConfigError, match="component unit-scale has no mesh dimension of its own"):
        Strategy.parse("bucketed+unit-scale=2")
    groups = layout(8, 2, dims=(Dim("batch-split", 2, replicates=True),))  # dp 2 x batch-split 2 x tp 2
    assert groups.dim_groups["batch-split"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.dp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]] and groups.tp_groups[:2] == [[0, 1], [2, 3]]
    assert groups.replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]

    from distlab.tools.verify import config_for, parse_strategy, verify
    case = parse_strategy("bucketed+batch-split=2")
    record, = verify([case], 4, steps=2, timeout=300)
    assert record["passed"], record
    from distlab.launch.spawn import run_ranks
    cfg = config_for(case, 4, steps=3)
    header, summary = run_ranks(_run_with_header, 4, cfg, timeout=300)[0]
    assert "batch-split: each micro-batch over 2 ranks (this one: [0, 1])" in header, header
    assert "batch-split groups [0, 1] [2, 3]; DP groups [0, 2] [1, 3]" in summary["mesh"]["layout"], summary["mesh"]
    assert summary["components"] == {"batch-split": {"size": 2}} and summary["mesh"]["batch-split"] == 2
    from distlab.data import dataset_shape
    from distlab.plan import Layout, Link, predict, trace
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size, cfg.tokenizer)
    lay = Layout(dp=cfg.strategy.dp_size(4), strategy=cfg.strategy, optimizer=cfg.optimizer,
                 momentum=cfg.momentum, global_batch=cfg.global_batch_size)
    p = predict(trace(cfg.model, shape, classes, options=cfg.options), lay, Link(), None)
    assert p["comm_bytes_per_step_per_rank"] == summary["comm_bytes_per_step"], (p["comm_bytes_by"], summary)
    assert p["batch_split"] == {"size": 2} and lay.replicas == 4


def _run_with_header(rank, world, cfg):
    from distlab import runtime
    from distlab.train import Trainer
    from distlab.train.header import header
    trainer = Trainer(cfg, runtime.from_process_group())
    return header(trainer), trainer.fit()
