"""``compile``: each block through torch.compile, equal to eager training on the layouts around it."""

from __future__ import annotations

import pytest
import torch

from distlab import runtime
from distlab.errors import ConfigError
from distlab.launch.spawn import run_ranks
from distlab.parallel import Strategy
from distlab.tools.verify import parse_strategy, verify
from distlab.train import Trainer, TrainConfig


def test_compiled_blocks_train_as_eager_around_zero3_tensor_parallel_and_a_pipeline():
    """2 ranks: ZeRO-3 (its gathers run between compiled pieces) with checkpointed blocks, TP+SP (its
    collectives likewise) and a 1F1B pipeline each train the eager single-process model within verify's
    float32 bound -- and each run compiled graphs (no silent fall-back to eager). ZeRO-3's through inductor
    (verify's own case); the others through aot_eager: where a layout meets compiling is dynamo's graphs and
    AOT autograd's joint forward and backward, which both backends share (torch's FSDP2 compile tests split
    them so too) -- inductor's kernels on a CPU are built by a C++ compiler, ~20 s per new block cold."""
    cases = ["zero=3+ckpt+compile+gpt", "allreduce+tp=2+sp+compile+compile_backend=aot_eager+gpt",
             "bucketed+pp=2+mb=2+compile+compile_backend=aot_eager+gpt"]
    for r in verify([parse_strategy(c) for c in cases], 2, steps=2, timeout=300):
        assert r["passed"], r
        assert r["compiled_graphs"] >= 1, r


def test_compile_keeps_the_modules_parameters_and_snapshot_keys():
    from distlab.models import build_model
    from distlab.parallel.compile import apply_compile, compile_units
    torch.manual_seed(0)
    model = build_model("gpt", (8,), 16, n_layer=3, n_head=2, n_embd=8)
    keys, params = list(model.state_dict()), list(model.parameters())
    assert apply_compile(model) == 3  # the transformer blocks, not the embedding or the head
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    assert all(b._compiled_call_impl is not None for b in compile_units(model))
    whole = torch.nn.Linear(2, 2)  # lists no blocks, holds no Sequential: compiled whole
    assert compile_units(whole) == [whole]


def test_compile_with_the_zero_bubble_pipeline_is_refused_before_launch(refused_here):
    with pytest.raises(ConfigError, match="zero bubble takes each weight's gradient from the product"):
        Strategy.parse("bucketed+pp=2+mb=2+zb+compile").check(2)
    proc = refused_here("train", "--model", "gpt", "--dataset", "synthetic-text:400", "--nproc-per-node", "2", "--pp", "2",
                        "--pp-schedule", "zb", "--compile")
    assert "--pp-schedule zb with --compile" in proc.stderr


def _compiled_then_eager(rank, world, tmp):
    settings = dict(model="gpt", n_layer=1, n_head=2, n_embd=8, block_size=8, dataset="synthetic-text:400",
                    global_batch_size=4, lr=0.05, lr_schedule="constant", optimizer="sgd", seed=0, epochs=5,
                    progress=False, verbose=False, eval_every_epoch=False, snapshot_dir=str(tmp), snapshot_every=2)
    compiled = TrainConfig.from_flags(**settings, max_steps=2, compile=True, compile_backend="aot_eager")
    first = Trainer(compiled.validate(1), runtime.from_process_group()).fit()
    second = Trainer(TrainConfig.from_flags(**settings, max_steps=3, resume="auto").validate(1),
                     runtime.from_process_group()).fit()
    return first, second


def test_a_compiled_runs_snapshot_resumes_without_compile_as_the_same_layout(tmp_path):
    first, second = run_ranks(_compiled_then_eager, 1, tmp_path, timeout=240)[0]
    assert first["compiled_graphs"] >= 1 and "compile+compile_backend=aot_eager" in first["strategy_text"]
    assert second["compiled_graphs"] is None and second["steps"] == 3
    assert second["resumed_from"].endswith("step-00000002") and second["resharded_from"] is None
    assert second["fingerprint"] == first["fingerprint"]


def test_models_of_torchs_own_layers_compile_too_and_train_as_eager():
    """The MLP, a BatchNorm CNN (with SyncBN) and a user's nn.Sequential: their blocks are torch's own
    layers, which ``nn.Module.compile`` alone leaves uncompiled (dynamo does not start in torch's files);
    each compiles graphs and trains within verify's bound of one eager process. Through aot_eager: where these
    layers start dynamo is a frame of distlab's, the backend's kernels are the header test's (inductor)."""
    cases = ["bucketed+compile+compile_backend=aot_eager", "bucketed+syncbn+compile+compile_backend=aot_eager",
             "zero=2+compile+compile_backend=aot_eager"]
    for r in verify([parse_strategy(c) for c in cases], 2, steps=2, timeout=300):
        assert r["passed"] and r["compiled_graphs"] >= 2, r


def test_many_layers_of_one_class_each_compile_once(tmp_path):
    """Twelve Linear layers: twelve graphs, none recompiled (a code object shared by every layer would be
    recompiled per layer until dynamo's cache limit, then run eagerly)."""
    from torch import nn
    from distlab.parallel.compile import apply_compile, compiled_graphs
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    eager = [p.detach().clone() for p in model.parameters()]
    before = compiled_graphs()
    assert apply_compile(model, backend="aot_eager") == 12
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).sum().backward()
    assert compiled_graphs() - before == 12
    assert all(torch.equal(a, b) for a, b in zip(eager, model.parameters()))  # in place: the same parameters


def test_the_header_says_what_compiles_and_a_missing_cxx_compiler_is_one_line(run_cli, tmp_path):
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:128", "--mlp-widths", "16,8", "--max-steps", "2",
                   "--compile", "--no-progress", "--out", "run", check=True)
    assert "compile  the whole model (nothing in this layout acts inside it) through torch.compile" in proc.stdout
    assert "compiled              " in proc.stdout and "graphs by torch.compile" in proc.stdout
    empty = tmp_path / "nothing-on-path"
    empty.mkdir()
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:128", "--compile", "--max-steps", "1", "--no-progress",
                   env={"PATH": str(empty), "CXX": ""})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--compile on a CPU needs a C++ compiler" in proc.stderr and "apt-get install g++" in proc.stderr


def test_the_whole_model_compiles_where_nothing_acts_inside_it():
    """One graph for the model where no hook, component, stage or recomputation sits between its blocks
    (one replica; an all-reduce after backward); blocks one by one where one does (the bucketed sync's
    gradient hooks fire between blocks; ZeRO; checkpointing; a pipeline; a component)."""
    from distlab.parallel.compile import whole_model
    assert whole_model(Strategy(), 1, 0) and whole_model(Strategy("allreduce"), 2, 0)
    assert not whole_model(Strategy("bucketed"), 2, 0) and not whole_model(Strategy("ddp"), 2, 0)
    assert not any(whole_model(Strategy.parse(s), 1, 0) for s in ("zero=1", "bucketed+ckpt", "bucketed+pp=2+mb=2"))
    assert not whole_model(Strategy(), 1, 1)  # a component (tensor, context or expert parallel)


def test_a_call_of_an_eager_function_in_compiled_code_compiles_no_frame_of_its_own():
    """A function marked eager is a graph break where compiled code calls it: dynamo compiles no frame of its
    thin wrapper (else each call with other arguments is compiled anew, up to dynamo's recompile limit)."""
    from distlab.runtime.eager import arm, eager
    calls = []

    def hook(x, *rest):
        calls.append(len(rest))
        return x

    hook = eager(hook)
    arm()

    def step(x, n):
        y = hook(x * 2, *range(n))
        return y + 1

    compiled = torch.compile(step, backend="eager")
    for n in range(4):
        assert torch.equal(compiled(torch.ones(2), n), torch.full((2,), 3.0))
    assert calls == [0, 1, 2, 3]
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(hook.__code__) == []


def test_the_aot_eager_backend_traces_as_inductor_does_and_needs_no_cxx_compiler(run_cli, refused_here, tmp_path):
    """``--compile-backend aot_eager``: dynamo's graphs and AOT autograd's joint forward and backward, run by
    torch's eager kernels -- no C++ compiler on PATH is needed, graphs are still compiled; the backend without
    ``--compile`` is refused, and the strategy's text and JSON carry it (inductor, the default, left out)."""
    empty = tmp_path / "nothing-on-path"
    empty.mkdir()
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:128", "--mlp-widths", "16,8", "--max-steps", "2",
                   "--compile", "--compile-backend", "aot_eager", "--no-progress", env={"PATH": str(empty), "CXX": ""},
                   check=True)
    assert "through torch.compile (aot_eager)" in proc.stdout
    assert "graphs by torch.compile" in proc.stdout and "compiled              0" not in proc.stdout
    proc = refused_here("train", "--dataset", "synthetic:1x8x8:4:128", "--compile-backend", "aot_eager")
    assert "--compile-backend aot_eager says how --compile compiles: turn on --compile too" in proc.stderr
    s = Strategy.parse("zero=3+compile+compile_backend=aot_eager")
    assert str(s) == "zero=3+compile+compile_backend=aot_eager" and Strategy.parse(str(s)) == s
    assert s.to_dict()["compile_backend"] == "aot_eager"
    assert "compile_backend" not in Strategy.parse("zero=3+compile").to_dict()
    with pytest.raises(ConfigError, match="unknown `compile_backend` 'cudagraphs'"):
        Strategy.parse("compile+compile_backend=cudagraphs").check(1)
