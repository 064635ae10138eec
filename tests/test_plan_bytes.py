"""The planner's communication bytes against a run's counted ones: ``distlab plan`` predicts what one
rank sends per step (``comm_bytes_per_step_per_rank``) from the model's trace and the layout, and a run
counts it (``comm_bytes_per_step``: distlab's messages counted, torch's native collectives by their
analytic volume). Bytes are arithmetic, not timing: where the planner prices a layout exactly, the two
are equal."""

from __future__ import annotations

from distlab.data import dataset_shape
from distlab.launch.spawn import run_ranks
from distlab.plan import Layout, Link, predict, trace
from distlab.tools.verify import config_for, default_strategies

WORLD = 2


def _counted(rank, world, configs):
    from distlab import runtime
    from distlab.train import Trainer
    out = []
    for cfg in configs:
        summary = Trainer(cfg, runtime.from_process_group()).fit()
        out.append(summary["comm_bytes_per_step"] if rank == 0 else None)
    return out


def _predicted(cfg) -> dict:
    s = cfg.strategy
    shape, classes = dataset_shape(cfg.dataset, cfg.block_size, cfg.tokenizer)
    t = trace(cfg.model, shape, classes, options=cfg.options)
    lay = Layout(dp=WORLD // (s.tp * s.pp * s.cp), strategy=s, optimizer=cfg.optimizer, momentum=cfg.momentum,
                 global_batch=cfg.global_batch_size, ignored_targets="masked=" in cfg.dataset,
                 label_smoothing=cfg.label_smoothing > 0)
    return predict(t, lay, Link(), None)


def test_the_planner_counts_the_bytes_a_run_sends():
    cases = default_strategies(WORLD)
    configs = [config_for(case, WORLD, steps=3) for case in cases]  # the median step: past the first
    counted = run_ranks(_counted, WORLD, configs, timeout=600)[0]
    rows = []
    for case, cfg, sent in zip(cases, configs, counted):
        p = _predicted(cfg)
        rows.append((case.name, sent, p["comm_bytes_per_step_per_rank"], p["comm_bytes_by"]))
    table = "\n".join(f"{name:45} counted {sent:>10,} predicted {pred:>10,} {by}" for name, sent, pred, by in rows)
    wrong = {name for name, sent, pred, _ in rows if sent != pred}
    assert wrong == NOT_YET_EXACT, (f"layouts priced inexactly: {sorted(wrong - NOT_YET_EXACT)}; now exact: "
                                    f"{sorted(NOT_YET_EXACT - wrong)} (take them off NOT_YET_EXACT)\n{table}")


# What the planner does not price exactly yet, each for its reason: this list only shrinks.
NOT_YET_EXACT = {
    # expert parallel's exchange follows the routing: priced for balanced routing (92,480 bytes here), the
    # run's routing sent 92,864 -- the gradient sync beside it is exact
    "bucketed+ep=2+gpt-moe",
}
