"""The planner's communication bytes against a run's counted ones: ``distlab plan`` predicts what one
rank sends per step (``comm_bytes_per_step_per_rank``) from the model's trace and the layout, and a run
counts it (``comm_bytes_per_step``: distlab's messages counted, torch's native collectives by their
analytic volume). Bytes are arithmetic, not timing: for every layout of ``verify``'s default set, on 2 and
4 ranks, the two are equal -- but for expert parallel's exchange, which follows the routing (priced for
balanced routing, it is bounded)."""

from __future__ import annotations

import dataclasses

import pytest

from distlab.data import dataset_shape
from distlab.launch.spawn import run_ranks
from distlab.plan import Layout, Link, predict, trace
from distlab.tools.verify import config_for, default_strategies, planned, parse_strategy
from tests.conftest import patience



def _counted(rank, world, configs):
    from distlab import runtime
    from distlab.train import Trainer
    out = []
    for cfg in configs:
        summary = Trainer(cfg, runtime.from_process_group()).fit()
        out.append((summary["comm_bytes_per_step"], summary["model_state_bytes_per_rank"]) if rank == 0 else None)
    return out


def _predicted(cfg, world: int) -> dict:
    s = cfg.strategy
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size, cfg.tokenizer)
    t = trace(cfg.model, shape, classes, options=cfg.options, lora=cfg.lora, base_dtype=cfg.base_dtype)
    lay = Layout(dp=s.dp_size(world), strategy=s, optimizer=cfg.optimizer, momentum=cfg.momentum, offload=cfg.offload,
                 global_batch=cfg.global_batch_size, ignored_targets="masked=" in cfg.dataset or cfg.dataset.startswith("sft:"),
                 label_smoothing=cfg.label_smoothing > 0, pairs=cfg.dataset.startswith("synthetic-pairs"),
                 group=cfg.group_size if cfg.reward else 1)  # GRPO: the update's rows, each prompt's completions
    return predict(t, lay, Link(), None)


@pytest.mark.parametrize("world", [2, 4])
def test_the_planner_counts_the_bytes_a_run_sends(world):
    # On 4 ranks the Llama family's layouts and the compiled one are left out: the same code prices GPT's and the
    # eager ZeRO-3's there, and all of them on 2 ranks (compiling costs each rank ~15 s of CPU, 4 ranks on 2 cores)
    cases = [c for c in default_strategies(world) if planned(c.strategy) and (world == 2 or (c.model != "llama" and not c.strategy.compile))]
    # the median step: past the first; the final evaluation on one batch (its bytes are not a step's)
    configs = [dataclasses.replace(config_for(case, world, steps=3), eval_batches=1) for case in cases]
    # the compiled layout's blocks through aot_eager: the same graphs and graph breaks as inductor's, whose kernels
    # (built by a C++ compiler on a CPU) move no byte
    configs = [dataclasses.replace(c, strategy=c.strategy.replace(compile_backend="aot_eager")) if c.strategy.compile
               else c for c in configs]
    counted = run_ranks(_counted, world, configs, timeout=600)[0]
    rows = []
    states = []
    for case, cfg, (sent, state) in zip(cases, configs, counted):
        p = _predicted(cfg, world)
        rows.append((case.name, sent, p["comm_bytes_per_step_per_rank"], p["comm_bytes_by"]))
        if cfg.strategy.pp == 1:  # rank 0's state is the prediction's (a pipeline's: the heaviest stage's)
            states.append((case.name, state, p["model_state_bytes_per_rank"], p["model_state_exact"]))
    table = "\n".join(f"{name:45} counted {sent:>10,} predicted {pred:>10,} {by}" for name, sent, pred, by in rows)
    # expert parallel's exchange follows the routing, priced for balanced routing: a rank sends between none
    # and all of its token-slots where balance sends (ep-1)/ep of them -- at most twice as much for ep 2
    routed = [(name, sent, pred, by["ep"]) for name, sent, pred, by in rows if "ep=" in name]
    assert routed and all(pred - ep <= sent <= pred + ep for name, sent, pred, ep in routed), f"routing bound:\n{table}"
    wrong = [name for name, sent, pred, _ in rows if sent != pred and "ep=" not in name]
    assert not wrong, f"layouts priced inexactly: {wrong}\n{table}"
    inexact = [row for row in states if row[1] != row[2] and row[3]]
    print("\n".join(f"{name:45} state {got:>10,} predicted {pred:>10,} exact {exact}" for name, got, pred, exact in states))
    assert not inexact, f"model state called exact and not: {inexact}"


def test_the_planner_prices_a_frozen_base_held_in_bf16_or_4_bit():
    """A LoRA run's frozen base in bf16 or NF4 (each adapted weight's codes, block scales, their factors, mean and
    levels: distlab.models.nf4) on data parallel, ZeRO-1, -2 and -3 (which shards each 4-bit part) and tensor
    parallel (each rank's part of the 4-bit weight): the model state a run holds is the planner's to the byte, and
    so are the bytes it sends (ZeRO-3 gathering the narrow base; tensor parallel's are left out: its activations
    travel in bf16 under autocast, which the plan prices at float32)."""
    pytest.importorskip("torchao", reason="torchao (the test extra) is not installed: pip install -e '.[test]'")
    adapted = "+llama+lora=r=2,alpha=4,targets=q,v,o,down+bf16"
    cases = [parse_strategy(s + adapted) for s in ("bucketed+base=bf16", "bucketed+base=nf4", "zero=1+base=nf4",
                                                   "zero=2+base=nf4+accum=2", "zero=3+base=bf16", "zero=3+base=nf4",
                                                   "allreduce+tp=2+base=nf4")]
    configs = [dataclasses.replace(config_for(case, 2, steps=3), eval_batches=1) for case in cases]
    counted = run_ranks(_counted, 2, configs, timeout=patience(600))[0]
    rows = [(case.name, sent, state, _predicted(cfg, 2)) for case, cfg, (sent, state) in zip(cases, configs, counted)]
    table = "\n".join(f"{n:60} sent {s:>8,} / {p['comm_bytes_per_step_per_rank']:>8,} state {m:>8,} / "
                      f"{p['model_state_bytes_per_rank']:>8,}" for n, s, m, p in rows)
    assert all(m == p["model_state_bytes_per_rank"] and p["model_state_exact"] for _, _, m, p in rows), table
    assert all(s == p["comm_bytes_per_step_per_rank"] for n, s, _, p in rows if "tp=" not in n), table
    float32 = _predicted(dataclasses.replace(configs[1], base_dtype="float32"), 2)["model_state_bytes_per_rank"]
    assert rows[1][2] < rows[0][2] < float32  # 4-bit < bf16 < float32


def test_plan_base_dtype_from_the_command_line_is_the_runs_qlora_state(run_cli, tmp_path):
    """`distlab plan --lora ... --base-dtype nf4 --zero 3` prints the model state per rank and the bytes per step
    that `distlab train` with the same flags holds and sends, to the byte."""
    pytest.importorskip("torchao", reason="torchao (the test extra) is not installed: pip install -e '.[test]'")
    import json
    same = ["--model", "llama", "--dataset", "synthetic-text:2000", "--block-size", "16", "--global-batch-size", "4",
            "--zero", "3", "--lora", "r=2,alpha=4,targets=q,v,o,down", "--precision", "bf16", "--base-dtype", "nf4"]
    run_cli("train", *same, "--max-steps", "2", "--nproc-per-node", "2", "--no-progress", "--eval-batches", "1",
            "--out", str(tmp_path / "run"), check=True)
    run_cli("plan", *same, "--dp", "2", "--json", str(tmp_path / "plan.json"), check=True)
    ran = json.loads((tmp_path / "run" / "summary.json").read_text())
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert ran["model_state_bytes_per_rank"] == planned["model_state_bytes_per_rank"]
    assert ran["comm_bytes_per_step"] == planned["comm_bytes_per_step_per_rank"]
