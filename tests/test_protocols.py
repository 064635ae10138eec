"""The contract under the Engine (distlab.parallel.protocols): every gradient sync and step schedule
implements its protocol, and an Engine of each combination runs a step through nothing else."""

import torch
import torch.nn.functional as F

from distlab.models import build_model
from distlab.parallel import DataParallel, Strategy, Zero, build_mesh, parallelize
from distlab.parallel.data_parallel import SYNC_METHODS
from distlab.parallel.protocols import GradSync, ShardedState, StateCost, StatePlacement, StepSchedule
from distlab.parallel.schedule import Accumulate
from distlab.parallel.zero import STAGES
from distlab.parallel.zero.plain import PlainZero
from distlab.launch.spawn import run_ranks
from distlab.tools.verify import gradient_tolerance


def _model():
    torch.manual_seed(0)
    return build_model("mlp", (1, 4, 4), 3, widths=(8,))


def test_every_gradient_sync_and_schedule_implements_its_protocol():
    syncs = [DataParallel(_model(), method) for method in SYNC_METHODS if method != "ddp"]
    syncs += [Zero(_model(), stage) for stage in STAGES if stage]
    syncs += [PlainZero(_model(), stage) for stage in STAGES if stage]
    for sync in syncs:
        for protocol in (GradSync, ShardedState, StatePlacement, StateCost):
            assert isinstance(sync, protocol), (type(sync).__name__, protocol.__name__)
    assert isinstance(Accumulate(2), StepSchedule)
    engine = parallelize(_model(), Strategy.parse("zero=2+accum=2"), build_mesh(1))
    assert isinstance(engine.grad_sync, GradSync) and isinstance(engine.schedule, StepSchedule)


def test_a_state_dict_is_read_back_by_the_kind_that_wrote_it():
    dp, zero = DataParallel(_model()), Zero(_model(), 3)
    assert DataParallel.reads(dp.sharded_state_dict()) and not Zero.reads(dp.sharded_state_dict())
    assert Zero.reads(zero.sharded_state_dict()) and not DataParallel.reads(zero.sharded_state_dict())


def _step(rank, world):
    x, y = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    engine = parallelize(_model(), Strategy.parse("zero=3+accum=2"), build_mesh(1))
    mine = slice(rank * 4, (rank + 1) * 4)
    engine.forward_backward(x[mine], y[mine], F.cross_entropy)
    grads = engine.full_gradients()
    with engine.gathered():
        out = engine.infer(x)
    return grads, out


def test_the_engine_steps_infers_and_reports_gradients_through_its_protocols():
    """Two ranks, ZeRO-3 and 2 accumulated micro-batches each: the gathered full gradients are one
    process's on the whole batch (within the float32 bound of verify), and infer is the model's output."""
    x, y = torch.randn(8, 1, 4, 4, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    plain = _model()
    F.cross_entropy(plain(x), y).backward()
    for grads, out in run_ranks(_step, 2, timeout=120):
        assert list(grads) == [k for k, _ in plain.named_parameters()]
        for k, p in plain.named_parameters():
            assert (grads[k] - p.grad).abs().max() <= gradient_tolerance(8), k
        assert torch.equal(out, plain(x).detach())


def test_each_gradient_sync_has_a_cost_model_beside_it_that_plan_picks_as_parallelize_does():
    from distlab.parallel.cost import DataParallelCost, Optim
    from distlab.plan.trace import trace
    from distlab.parallel.zero.cost import ZeroCost
    from distlab.plan.predict import grad_sync_cost
    t = trace("mlp", (1, 4, 4), 3, widths=(8,))
    for text in ("allreduce", "bucketed", "gather-scatter", "zero=1", "zero=2", "zero=3"):
        strategy = Strategy.parse(text)
        built = type(parallelize(_model(), strategy, build_mesh(1)).grad_sync)
        cost = grad_sync_cost(strategy)
        assert {DataParallel: DataParallelCost, Zero: ZeroCost}[built] is cost, text
        planned = cost.planned_calls(t, strategy, 4)
        sent = planned.before_layers + planned.during_backward + planned.after_backward + planned.after_step
        assert sent and all(c.nbytes > 0 for c in sent), text  # four ranks: something to send
        assert cost.planned_memory(t, Optim.of("sgd"), strategy, 4) > 0


def _sharded_layers(rank, world):
    import torch.distributed as dist

    from distlab.models import GPT
    from distlab.parallel.expert_parallel import ExpertShard
    from distlab.parallel.placement import full_state_dict
    from distlab.parallel.protocols import ShardedLayer
    from distlab.parallel.tensor_parallel.plan import apply_tensor_parallel
    torch.manual_seed(0)
    whole = GPT(32, 8, n_layer=1, n_head=2, n_embd=8)
    torch.manual_seed(0)
    sharded = apply_tensor_parallel(GPT(32, 8, n_layer=1, n_head=2, n_embd=8), dist.group.WORLD)
    kinds = sorted({type(m).__name__ for m in sharded.modules() if isinstance(m, ShardedLayer)})
    gathered = full_state_dict(sharded)  # through the protocol alone
    equal = list(gathered) == list(whole.state_dict()) and all(torch.equal(gathered[k], v)
                                                               for k, v in whole.state_dict().items())
    return kinds, equal, hasattr(ExpertShard, "full_parameters")


def test_sharded_layers_are_one_protocol_that_whole_state_is_gathered_through():
    """Tensor parallel's column, row and vocabulary layers answer ShardedLayer; the whole model's state
    gathered through that protocol alone is the unsharded model's, key for key and bit for bit; the
    Engine imports no strategy module to do it."""
    import ast
    from pathlib import Path
    for kinds, equal, experts in run_ranks(_sharded_layers, 2, timeout=120):
        assert {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLinear"} <= \
            set(kinds) and equal and experts, kinds
    engine = Path(__file__).resolve().parent.parent / "distlab" / "parallel" / "engine.py"
    imported = {n.module for n in ast.walk(ast.parse(engine.read_text())) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"distlab.parallel.tensor_parallel", "distlab.parallel.expert_parallel",
                           "distlab.parallel.context_parallel", "distlab.parallel.zero"}, imported


class _Adapted(torch.nn.Linear):
    """A low-rank adapted linear layer that is not distlab's LoRALinear: its own update's arithmetic (the
    factors' product scaled by 3, no dropout), declared through LowRankAdapted alone."""

    def __init__(self, n_in, n_out, r):
        super().__init__(n_in, n_out, bias=False)
        self.weight.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(r, n_in))
        self.lora_b = torch.nn.Parameter(torch.randn(n_out, r))
        self.adapter = lambda result, x, a, b, training: result + 3.0 * (x @ a.T @ b.T)

    def forward(self, x):
        return self.adapter(F.linear(x, self.weight), x, self.lora_a, self.lora_b, self.training)


def _adapted_split(rank, world):
    import torch.distributed as dist

    from distlab.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, adapt
    torch.manual_seed(0)
    first, second, x = _Adapted(4, 6, 2), _Adapted(6, 4, 2), torch.randn(3, 4)
    column = ColumnParallelLinear(first, dist.group.WORLD, gather_output=False)
    row = RowParallelLinear(second, dist.group.WORLD)
    shared = []
    adapt(column, first, shared)
    adapt(row, second, shared)
    out, reference = row(column(x)), second(first(x))
    whole = [t for m in (column, row) for t in m.full_parameters()]
    expected = [t.detach().clone() for m in (first, second) for t in (m.weight, m.lora_a, m.lora_b)]
    with torch.no_grad():  # |fl(sum) - sum| <= gamma_n * sum|terms| (Higham): the function of |x| on |weights|
        for m in (first, second):
            for t in (m.weight, m.lora_a, m.lora_b):
                t.abs_()
        magnitude = second(first(x.abs())).max().item()
    depth = 4 + 2 + 6 + 2  # the longest chain of additions an output element passes through, either order
    bound = 2 * depth * torch.finfo(torch.float32).eps * magnitude  # both orders' errors
    return ((out - reference).abs().max().item() <= bound, all(torch.equal(a, b) for a, b in zip(whole, expected)),
            len(shared))


def test_tensor_parallel_meets_an_adapter_through_the_protocol_only():
    """Any layer answering LowRankAdapted (here not distlab's LoRALinear: an update of its own) is split by
    the column- and row-parallel layers with its factors and computes the whole layer's function: the
    strategies read the protocol, never the converter's class."""
    from distlab.models.lora import LoRALinear, LoRASpec, apply
    from distlab.parallel.protocols import LowRankAdapted
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    apply(model, LoRASpec.parse("r=2,alpha=4,targets=0"))
    assert isinstance(model[0], LoRALinear) and isinstance(model[0], LowRankAdapted)
    assert not isinstance(model[1], LowRankAdapted)
    from tests.conftest import patience
    for close, parameters, shared in run_ranks(_adapted_split, 2, timeout=patience(120)):
        assert close and parameters and shared == 2, (close, parameters, shared)
