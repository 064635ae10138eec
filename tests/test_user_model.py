"""Your own model: ``--model path/to/file.py:build`` (or ``package.module:build``) with
``--model-arg key=value``, trained by the same strategies as the built-in models and refused
before launch, naming the method, where a strategy needs what the model does not declare."""

import textwrap

import pytest
import torch

from distlab import runtime
from distlab.errors import ConfigError
from distlab.launch.spawn import run_ranks
from distlab.tools.verify import reference_run, tolerance
from distlab.train import Trainer, TrainConfig

MODEL = textwrap.dedent('''
    """A small CNN with its own block class; it knows nothing of distlab."""
    import torch
    from torch import nn


    class ConvBlock(nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.conv, self.act = nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()

        def forward(self, x):
            return self.act(self.conv(x))


    class TinyNet(nn.Module):
        def __init__(self, channels, classes, width):
            super().__init__()
            self.blocks = nn.Sequential(ConvBlock(channels, width), ConvBlock(width, width))
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.head = nn.Linear(width, classes)

        def forward(self, x):
            return self.head(self.pool(self.blocks(x)).flatten(1))


    def build(input_shape, num_classes, width=8):
        return TinyNet(input_shape[0], num_classes, width)


    class TinyNetWithPlan(TinyNet):
        """The same network with a two-layer head it declares for tensor parallel."""

        def __init__(self, channels, classes, width):
            super().__init__(channels, classes, width)
            self.head = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, classes))

        def tensor_parallel_plan(self, tp, style, sequence_parallel):
            return {"head.0": "colwise", "head.2": "rowwise"}


    def build_with_plan(input_shape, num_classes, width=8):
        return TinyNetWithPlan(input_shape[0], num_classes, width)


    def not_a_model():
        return 42
''')


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "tinynet.py"
    path.write_text(MODEL)
    return path


def _config(model_file, **overrides):
    settings = dict(model=f"{model_file}:build", model_args=("width=6",), dataset="synthetic:3x8x8:4:96",
                    max_steps=6, global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9,
                    seed=3, log_every=1, progress=False)
    return TrainConfig.from_flags(**{**settings, **overrides})


def _train_each(rank, world, cfgs):
    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg, runtime.from_process_group())
        trainer.fit()
        out.append(([p.detach().clone() for p in trainer.engine.full_parameters()], type(trainer.engine.module).__name__))
    return out


def test_your_model_trains_under_zero_and_data_parallel_equal_to_one_process(model_file, tmp_path):
    cfgs = [_config(model_file, zero=2, out=str(tmp_path / "zero2")),
            _config(model_file, dp_sync="bucketed", grad_accum=2, out=str(tmp_path / "dp"))]
    per_rank = run_ranks(_train_each, 2, cfgs, timeout=300)
    ref_params, _ = reference_run(cfgs[0])  # width 6 passed to the builder: the same shapes
    assert [tuple(p.shape) for p in ref_params][0] == (6, 3, 3, 3)
    for i, cfg in enumerate(cfgs):
        params, kind = per_rank[0][i]
        assert kind == "TinyNet"
        assert max((a - b).abs().max().item() for a, b in zip(params, ref_params)) <= tolerance(cfg), cfg.strategy


def test_the_same_file_with_a_declared_plan_runs_tensor_parallel_equal_to_one_process(model_file, tmp_path):
    cfg = _config(model_file, model=f"{model_file}:build_with_plan", tp=2, out=str(tmp_path / "tp")).validate(2)
    (params, kind), = run_ranks(_train_each, 2, [cfg], timeout=300)[0]
    ref_params, _ = reference_run(cfg)
    assert kind == "TinyNetWithPlan"
    assert max((a - b).abs().max().item() for a, b in zip(params, ref_params)) <= tolerance(cfg)


def test_what_the_model_does_not_declare_is_refused_before_launch_naming_the_method(model_file):
    with pytest.raises(ConfigError, match=r"tensor_parallel_plan\(tp, style, sequence_parallel\).*TinyNet has none"):
        _config(model_file, tp=2).validate(2)
    with pytest.raises(ConfigError, match=r"TinyNet is not an nn.Sequential and has no pipeline_layers\(\)"):
        _config(model_file, pp=2).validate(2)
    with pytest.raises(ConfigError, match="has no BatchNorm layer"):
        _config(model_file, sync_bn="distlab").validate(2)
    _config(model_file, activation_checkpointing=False).validate(2)  # data parallel and ZeRO need nothing


def test_a_bad_model_spec_is_one_line_naming_the_file(model_file, tmp_path):
    cases = {f"{tmp_path}/missing.py:build": "there is no file",
             f"{model_file}:nothing": "has no callable 'nothing'",
             f"{model_file}:not_a_model": "returned a int, not a torch nn.Module",
             "no_such_package_xyz:build": "failed to load: ModuleNotFoundError"}
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise RuntimeError('the file itself fails')\n")
    cases[f"{broken}:build"] = "failed to load: RuntimeError: the file itself fails"
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            TrainConfig.from_flags(model=spec, dataset="synthetic:3x8x8:4:96").validate(1)._meta_model()
    with pytest.raises(ConfigError, match="write it as key=value"):
        _config(model_file, model_args=("width",)).validate(1)
    with pytest.raises(ConfigError, match="are for your own model's builder"):
        TrainConfig.from_flags(model="mlp", model_args=("width=3",)).validate(1)


def test_the_cli_trains_your_model_and_the_header_says_where_it_came_from(run_cli, model_file, tmp_path):
    r = run_cli("train", "--model", f"{model_file}:build", "--model-arg", "width=4", "--dataset",
                "synthetic:3x8x8:4:96", "--max-steps", "2", "--global-batch-size", "12", "--out", str(tmp_path / "run"),
                check=True)
    assert f"(your model: a TinyNet that {model_file}'s build(width=4) returns)" in r.stdout
    summary = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == f"{model_file}:build" and summary["config"]["model_args"] == ["width=4"]
    assert summary["num_parameters"] == sum(p.numel() for p in torch.nn.Conv2d(3, 4, 3).parameters()) + \
        sum(p.numel() for p in torch.nn.Conv2d(4, 4, 3).parameters()) + 4 * 4 + 4


def test_verify_proves_your_model_under_the_strategies_it_supports(refused_here, run_cli, model_file, tmp_path):
    out = tmp_path / "verify.json"
    run_cli("verify", "--model", f"{model_file}:build", "--model-arg", "width=4", "--nproc", "2", "--steps", "3",
            "--strategy", "zero=2", "--strategy", "bucketed+ckpt", "--json", str(out), check=True)
    records = __import__("json").loads(out.read_text())
    assert [(r["strategy"], r["model"], r["passed"]) for r in records] == [
        ("zero=2", f"{model_file}:build", True), ("bucketed+ckpt", f"{model_file}:build", True)]
    refused = refused_here("verify", "--model", f"{model_file}:build", "--nproc", "2", "--strategy", "allreduce+tp=2")
    assert refused.returncode == 2 and "tensor_parallel_plan(tp, style, sequence_parallel)" in refused.stderr


MISFITS = textwrap.dedent('''
    import sys
    import torch
    from torch import nn


    def seven_outputs(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 7))


    def wrong_width(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(100, num_classes))


    def no_parameters():
        return nn.Sequential(nn.Flatten())


    def exits():
        sys.exit(3)


    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(64, 4)

        def forward(self, x):
            return self.head(x.flatten(1)), None


    def flat_lm(input_shape, num_classes):
        return nn.Sequential(nn.Embedding(num_classes, 8), nn.Flatten(), nn.Linear(8 * input_shape[0], num_classes))


    class Reads(nn.Module):  # reads a value in its forward: the meta device cannot run it
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(64, 7)

        def forward(self, x):
            scale = 1.0 + 0.0 * x.abs().max().item()
            return self.head(x.flatten(1)) * scale
''')


@pytest.mark.parametrize("builder,dataset,message", [
    ("seven_outputs", "synthetic:1x8x8:10:64", r"given inputs \(B, 1, 8, 8\), it returned \(B, 7\); it should return "
                                               r"\(B, 10\): a score per class"),
    ("wrong_width", "synthetic:1x8x8:10:64", r"gives inputs \(B, 1, 8, 8\), and the model's forward failed on them: "
                                             r"RuntimeError: .*64.*100"),
    ("no_parameters", "synthetic:1x8x8:10:64", "has no parameters: there is nothing to train"),
    ("exits", "synthetic:1x8x8:10:64", r"exits\(\) called sys.exit\(3\) instead of returning a model"),
    ("Pair", "synthetic:1x8x8:4:64", r"it returned a tuple; it should return \(B, 4\)"),
    ("flat_lm", "synthetic-text:2000", r"token ids, it returned \(B, 256\); it should return \(B, 16, 256\): a score "
                                       r"per token"),
    ("Reads", "synthetic:1x8x8:10:64", r"given inputs \(B, 1, 8, 8\), it returned \(B, 7\); it should return "
                                       r"\(B, 10\)"),  # checked on real zeros: .item() cannot run on the meta device
])
def test_a_model_that_does_not_fit_the_data_is_one_line_before_any_work(tmp_path, builder, dataset, message):
    path = tmp_path / "misfits.py"
    path.write_text(MISFITS)
    with pytest.raises(ConfigError, match=message) as info:
        TrainConfig.from_flags(model=f"{path}:{builder}", dataset=dataset, block_size=16).validate(1)
    assert "\n" not in str(info.value)


def test_a_misfit_model_is_one_line_from_train_and_verify(run_cli, tmp_path):
    path = tmp_path / "misfits.py"
    path.write_text(MISFITS)
    for argv in (["train", "--nproc-per-node", "2", "--out", str(tmp_path / "run")], ["verify", "--nproc", "2"]):
        r = run_cli(*argv, "--model", f"{path}:seven_outputs", "--dataset", "synthetic:1x8x8:10:64")
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("distlab: error:"), r.stderr
        assert "it returned (B, 7); it should return (B, 10)" in lines[0]
