"""Pipeline parallel in the Trainer: the data x tensor x pipeline mesh, the strategy's pipeline
fields and refusals, runs equal to one process (verify's float32 tolerance) on 4 and 8 ranks,
evaluation along the pipeline, the gathered model, and bad input refused before launch."""


import json

import pytest
import torch

from distlab import runtime
from distlab.errors import ConfigError
from distlab.models import build_model
from distlab.parallel import Strategy, parallelize
from distlab.parallel.mesh import build_mesh, layout
from distlab.launch.spawn import run_ranks
from distlab.train import TrainConfig, Trainer
from distlab.train.evaluate import evaluate
from distlab.tools.verify import evaluation_tolerance, parse_strategy, verify


def test_the_3d_mesh_puts_tensor_parallel_innermost_and_stages_outermost():
    groups = layout(8, tp=2, pp=2)  # dp 2
    assert groups.tp_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups.dp_groups == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.pp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    every = sorted(r for kind in (groups.tp_groups, groups.dp_groups, groups.pp_groups) for g in kind for r in g)
    assert every == sorted(list(range(8)) * 3)  # each rank in exactly one group of each kind
    assert layout(4, tp=1, pp=4).pp_groups == [[0, 1, 2, 3]]
    with pytest.raises(ConfigError, match=r"`tp` 2 x `pp` 2 = 4 does not divide the world size 6"):
        layout(6, tp=2, pp=2)


def test_pipeline_fields_in_the_text_form_and_their_refusals():
    s = Strategy.parse("bucketed+tp=2+pp=2+mb=4+gpipe")
    assert (s.pp, s.microbatches, s.pp_schedule, s.micro_steps) == (2, 4, "gpipe", 4)
    assert Strategy.parse(str(s)) == s
    assert Strategy(pp=4).microbatches == 4 and Strategy().microbatches == 1  # default: one per stage
    assert Strategy.from_dict(s.to_dict()) == s and Strategy().to_dict()["pp_schedule"] is None
    assert s.dp_size(8) == 2
    b = Strategy.parse("bucketed+pp=2+balance=1:3")
    assert b.pp_balance == (1, 3) and Strategy.parse(str(b)) == b and Strategy.from_dict(b.to_dict()) == b
    for text, message in [
        ("bucketed+mb=4", "there is no pipeline"),
        ("bucketed+pp=2+accum=2", "drop `grad_accum` 2 and set `microbatches` to 4"),
        ("zero=3+pp=2+zb", "use `pp_schedule` 1f1b"),
        ("ddp+pp=2", "use `dp_sync` bucketed"),
        ("bucketed+pp=2+schedule=interleaved", "unknown `pp_schedule`"),
        ("bucketed+pp=2+balance=1:2:1", "must give 2 positive layer counts"),
        ("bucketed+balance=1:3", "there is no pipeline"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Strategy.parse(text)
    with pytest.raises(ConfigError, match=r"`pp` 3 does not divide the world size 4"):
        Strategy(pp=3).check(4)
    with pytest.raises(ConfigError, match=r"`microbatches` 3 does not divide the per-rank batch 8"):
        Strategy(pp=2, microbatches=3).check_batch(16, 4)  # dp 2: 8 per rank


def test_a_model_with_too_few_layers_or_a_bad_split_is_refused_by_the_config():
    gpt = dict(model="gpt", dataset="synthetic-text", n_layer=2, n_head=4, n_embd=32, global_batch_size=16)
    TrainConfig.from_flags(**gpt, pp=4).validate(4)  # embedding, 2 blocks, head: 4 stages fit
    with pytest.raises(ConfigError, match="model gpt: `pp` 8: the model has 4 layers"):
        TrainConfig.from_flags(**gpt, pp=8).validate(8)
    TrainConfig.from_flags(**gpt, pp=2, pp_virtual=2, microbatches=2).validate(2)  # 4 chunks of one layer
    with pytest.raises(ConfigError, match=r"`pp` 2 x `pp_virtual` 3 = 6 chunks.*4 layers.*lower `pp_virtual`"):
        TrainConfig.from_flags(**gpt, pp=2, pp_virtual=3, microbatches=2).validate(2)
    with pytest.raises(ConfigError, match="model mlp: `pp` 4: the model has 3 layers with parameters"):
        TrainConfig.from_flags(model="mlp", dataset="synthetic:1x8x8:4:64", pp=4).validate(4)
    with pytest.raises(ConfigError, match="`n_head` 4 is not divisible by 3"):
        TrainConfig.from_flags(**gpt, tp=3).validate(3)
    with pytest.raises(ConfigError, match="needs `tp` of 2 or more"):
        TrainConfig.from_flags(**gpt, sequence_parallel=True, pp=2).validate(2)


@pytest.mark.parametrize("args,message", [
    (["--nproc-per-node", "4", "--pp", "3"], "--pp 3 does not divide the world size 4"),
    (["--nproc-per-node", "2", "--pp", "2", "--microbatches", "3", "--batch-size", "16"],
     "--microbatches 3 does not divide the per-rank batch 16"),
])
def test_bad_pipeline_flags_are_one_line_before_launch(run_cli, args, message):
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--max-steps", "1", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "waiting for" not in proc.stderr + proc.stdout  # refused before any worker started


def test_pipelines_equal_one_process_on_4_ranks():
    """Two- and four-stage pipelines with each schedule, alone (pp 4), with data parallel (dp 2 x
    pp 2, also with ZeRO-1, -2 under zero bubble, -3 interleaved and recomputing, and with a given split) and with
    tensor parallel (tp 2 x pp 2, also
    sequence parallel) train the transformer as one process does (verify's float32 tolerance); so
    do a two-stage MLP and a two-stage CNN with SyncBatchNorm over the data-parallel pairs (one
    micro-batch: BatchNorm then normalises over the whole global batch, as the single process does)."""
    cases = ["bucketed+pp=2+mb=3+1f1b", "bucketed+pp=4+mb=4+gpipe+gpt", "bucketed+pp=2+mb=2+1f1b+balance=1:3+gpt",
             "bucketed+pp=2+mb=2+1f1b+gpt",
             "zero=1+pp=2+mb=4+gpipe+gpt", "allreduce+tp=2+pp=2+mb=2+1f1b+gpt", "bucketed+tp=2+sp+pp=2+mb=2+1f1b+gpt",
             "zero=2+pp=2+mb=4+zb+gpt", "zero=3+pp=2+mb=4+1f1b+vpp=2+gpt", "zero=3+pp=2+mb=2+1f1b+ckpt+gpt",
             "allreduce+syncbn+pp=2+mb=1+1f1b"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=4, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r
    assert [r["strategy"] for r in records] == cases


def test_pipelines_with_activation_checkpointing_and_bf16_equal_one_process():
    """Each stage recomputes the blocks it holds, and runs its forwards under autocast (the single
    process runs under the same autocast): within verify's bound for float32, and for bfloat16's
    rounding where the run is bf16 -- with 1F1B, zero bubble and interleaving."""
    cases = ["bucketed+pp=2+mb=2+1f1b+ckpt", "bucketed+pp=2+mb=4+1f1b+bf16+gpt", "bucketed+pp=2+mb=2+zb+ckpt+gpt",
             "bucketed+pp=2+mb=4+1f1b+vpp=2+ckpt+bf16+gpt"]
    records = verify([parse_strategy(c) for c in cases], 2, steps=3, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r
    assert [r["strategy"] for r in records] == cases


def test_data_tensor_and_pipeline_parallel_together_on_8_ranks():
    """dp 2 x tp 2 x pp 2 (8 processes on 2 cores: slow, but correctness does not care)."""
    records = verify([parse_strategy("bucketed+tp=2+sp+pp=2+mb=2+1f1b+gpt")], 8, steps=3, timeout=300)
    assert records[0]["passed"] and records[0]["max_abs_param_diff"] <= records[0]["tolerance"], records[0]


def _pipeline_run(rank, world):
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:256", max_steps=6,
                                 global_batch_size=32, lr=0.05, log_every=3, progress=False, verbose=False,
                                 pp=2, microbatches=4, pp_schedule="1f1b")
    trainer = Trainer(cfg, runtime.from_process_group())
    summary = trainer.fit()
    return summary, trainer.engine.full_state_dict(), trainer.engine.schedule.stage.in_flight_peak


def test_a_pipeline_run_evaluates_reports_and_gathers_the_whole_model():
    results = run_ranks(_pipeline_run, 2, timeout=120)
    summary, state, _ = results[0]
    assert results[1][0]["test_loss"] == summary["test_loss"]  # every rank reports the same
    torch.manual_seed(0)
    whole = build_model("mlp", (1, 8, 8), 4, widths=(32, 16))
    assert list(state) == list(whole.state_dict())  # the single-process model's keys, in its order
    whole.load_state_dict(state)
    data = TrainConfig.from_flags(model="mlp", dataset="synthetic:1x8x8:4:256").load("test")
    alone = evaluate(parallelize(whole, Strategy(), build_mesh(1)), data)
    bound = evaluation_tolerance(whole, *data.batch(torch.arange(len(data))))  # rounding only
    assert abs(alone["test_loss"] - summary["test_loss"]) <= bound  # evaluated along the pipeline
    assert alone["test_accuracy"] == summary["test_accuracy"]
    pipe = summary["pipeline"]
    # layers Flatten, Linear 2080, ReLU | Linear 528, ReLU, Linear 68: cut where half the parameters are passed
    assert [s["layers"] for s in pipe["stages"]] == [[0, 3], [3, 6]]
    assert [s["parameters"] for s in pipe["stages"]] == [2080, 596]
    assert pipe["bubble_ideal"] == pytest.approx(1 / 5)
    assert 0.0 < pipe["bubble_measured"] < 1.0
    assert [r[2] for r in results] == [2, 1]  # 1F1B: stage s holds at most P - s micro-batches
    assert summary["mesh"]["pp"] == 2 and "pipelines (stage 0 first) [0, 1]" in summary["mesh"]["layout"]
    assert summary["micro_batch_size"] == 8


def test_interleaved_and_zero_bubble_pipelines_train_the_single_process_model():
    """On 4 ranks: interleaved 1F1B (2 chunks per rank) with data parallel, zero bubble with tensor
    parallel and with ZeRO-1 -- each equal to one process within verify's float32 bound (SGD)."""
    from distlab.parallel import Strategy
    from distlab.tools.verify import parse_strategy, verify
    cases = ["bucketed+pp=2+mb=4+vpp=2+gpt", "allreduce+tp=2+pp=2+mb=2+zb+gpt", "zero=1+pp=2+mb=4+zb+gpt"]
    records = verify([parse_strategy(c) for c in cases], 4, steps=3, timeout=300)
    for r in records:
        assert r["passed"] and r["max_abs_param_diff"] <= r["tolerance"], r
    s = Strategy.parse("bucketed+pp=2+mb=4+zb+vpp=2")
    assert (s.pp_schedule, s.pp_virtual) == ("zb", 2) and str(s) == "bucketed+pp=2+mb=4+zb+vpp=2"
    assert "pp_virtual" not in Strategy(pp=2).to_dict() and Strategy.from_dict(s.to_dict()) == s
    for text, message in (("pp=2+mb=3+vpp=2", "multiple of `pp` 2"), ("pp=2+gpipe+vpp=2", "GPipe"),
                          ("pp=2+balance=1:1+vpp=2", "4 positive")):
        with pytest.raises(ConfigError, match=message):
            Strategy.parse(text)


def test_zero_2_and_3_under_a_pipeline_train_from_the_command_line_and_zero_2_is_planned_exactly(run_cli, tmp_path):
    """`distlab train --pp 2 --zero 2|3` on 4 ranks (each stage's ZeRO over its data-parallel pair; refused
    before): both train; the planner's bytes a step sends equal the run's for both, its model state ZeRO-2's to
    the byte -- ZeRO-3's under a pipeline is said to be an estimate (its gathers replayed one micro-batch after
    another, not in the schedule's order)."""
    import json
    model = ["--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16",
             "--global-batch-size", "8", "--pp", "2", "--microbatches", "2"]
    for zero in ("2", "3"):
        run_cli("train", "--nproc-per-node", "4", *model, "--zero", zero, "--dataset", "synthetic-text:4000",
                "--max-steps", "2", "--no-progress", "--out", str(tmp_path / zero), check=True)
        summary = json.loads((tmp_path / zero / "summary.json").read_text())
        run_cli("plan", *model, "--dp", "2", "--zero", zero, "--dataset", "synthetic-text", "--json",
                str(tmp_path / f"plan{zero}.json"), check=True)
        plan = json.loads((tmp_path / f"plan{zero}.json").read_text())
        assert plan["comm_bytes_per_step_per_rank"] == summary["comm_bytes_per_step"], (zero, plan, summary)
        assert plan["model_state_exact"] == (zero == "2")
        if zero == "2":
            assert plan["model_state_bytes_per_rank"] == summary["model_state_bytes_per_rank"]


class _Counted(torch.autograd.Function):
    """The identity, counting its backward calls (as a collective after a layer's product would run)."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Counted.calls += 1
        return g


class _AfterProduct(torch.nn.Module):
    """A row-parallel layer's shape: the product, something after it in backward's way, then the bias; and an
    expert table read per expert, and a scale read only inside a custom function."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.table = torch.nn.Parameter(torch.randn(2, 4, 4, dtype=torch.float64))
        self.scale = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        y = _Counted.apply(torch.nn.functional.linear(x, self.weight)) + self.bias
        y = y @ self.table[0] + y @ self.table[1]
        return _Scaled.apply(y, self.scale)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, s):
        ctx.save_for_backward(y, s)
        return y * s

    @staticmethod
    def backward(ctx, g):
        y, s = ctx.saved_tensors
        return g * s, (g * y).sum()


def test_the_weight_pass_starts_at_each_weights_own_product_and_accumulates_each_weight_once():
    """Zero bubble's W pass (parallel/pipeline/weight_pass.py): after B computed the input's gradient (the
    collective after the product ran once), W gives every weight the gradient one plain backward gives --
    bitwise, float64 -- without running that collective again (from the module's output it would); a weight
    read twice (an expert table) is accumulated once (its post-accumulate hook fires once); a weight read
    only inside a custom autograd function is taken from the module's output."""
    from distlab.parallel.pipeline.weight_pass import capture, weight_backward
    torch.manual_seed(0)
    layer, x, g = _AfterProduct(), torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(3, 4, dtype=torch.float64)
    out = layer(x)
    out.backward(g)
    expected = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    fired = []
    layer.table.register_post_accumulate_grad_hook(lambda p: fired.append(1))
    owners = [(layer, list(layer.parameters()))]
    x.grad = None
    with capture(owners) as captured:
        out = layer(x)
    assert {tuple(p.shape) for _, ps in captured for p in ps} == {(4, 4), (4,), (2, 4, 4), ()}
    _Counted.calls = 0
    got = torch.autograd.grad(out, [x] + [o for o, _ in captured], g, retain_graph=True, allow_unused=True)
    assert _Counted.calls == 1 and torch.equal(got[0], torch.autograd.grad(layer(x), x, g)[0])
    _Counted.calls = 0
    weight_backward([(o, own, gr) for (o, own), gr in zip(captured, got[1:]) if gr is not None])
    assert _Counted.calls == 0, "the weight pass ran what lies after the product again"
    assert fired == [1]
    for n, p in layer.named_parameters():
        assert torch.equal(p.grad, expected[n]), n


def test_zero_bubble_sends_what_1f1b_sends_under_sequence_and_expert_parallel(run_cli, tmp_path):
    """TP 2 + SP x PP 2 and EP 2 x PP 2 from the command line: zero bubble's step sends 1F1B's bytes exactly
    (its weight pass runs no reduce-scatter or all-to-all again) and trains to the same losses (verify's float32
    bound for SGD)."""
    from distlab.tools.verify import sgd_tolerance
    base = ["train", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--dataset", "synthetic-text:4000",
            "--block-size", "8", "--global-batch-size", "8", "--max-steps", "2", "--log-every", "1", "--optimizer",
            "sgd", "--lr", "0.05", "--momentum", "0.9", "--nproc-per-node", "4", "--pp", "2", "--microbatches", "4",
            "--no-progress"]
    for name, extra in (("sp", ["--model", "gpt", "--tp", "2", "--sequence-parallel"]),
                        ("ep", ["--model", "gpt-moe", "--ep", "2"])):
        got = {}
        for schedule in ("1f1b", "zb"):
            out = tmp_path / f"{name}-{schedule}"
            run_cli(*base, *extra, "--pp-schedule", schedule, "--out", str(out), check=True)
            summary = json.loads((out / "summary.json").read_text())
            losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            got[schedule] = (summary["comm_bytes_per_step"], losses)
        assert got["zb"][0] == got["1f1b"][0], (name, got)
        assert max(abs(a - b) for a, b in zip(got["zb"][1], got["1f1b"][1])) <= sgd_tolerance(2, 0.05, 8, 0.9), got
