"""Markdown tables from bench JSON, for the README (``distlab bench markdown FILE...``)."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt_ratio(t: float, base: float | None) -> str:
    return f"{t / base:.2f}x" if base else "-"


def collectives(records: list[dict]) -> str:
    algos = list(dict.fromkeys(r["algorithm"] for r in records if r["algorithm"] != "native"))
    head = "| world | elements | native (ms) | " + " | ".join(algos) + " |"
    rows = [head, "|" + "---|" * (3 + len(algos))]
    cells = {(r["world_size"], r["numel"], r["algorithm"]): r for r in records if r["op"] == records[0]["op"]}
    for world, numel in dict.fromkeys((r["world_size"], r["numel"]) for r in records):
        nat = cells.get((world, numel, "native"))
        base = nat["time_s_median"] if nat else None
        row = [str(world), f"{numel:.0e}".replace("e+0", "e"), f"{1000 * base:.2f}" if base else "-"]
        row += [_fmt_ratio(cells[(world, numel, a)]["time_s_median"], base) if (world, numel, a) in cells else "-"
                for a in algos]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def dp(records: list[dict]) -> str:
    from distlab.bench.dp import rows as dp_rows
    traced = any("hidden_communication" in r for r in records)  # bench dp --trace
    lines = ["| workload | procs | method | ms/step | samples/s | vs DDP | MB sent/step | peak RSS MB | loss | test acc |"
             + (" comm hidden |" if traced else ""), "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if traced else "")]
    for c in dp_rows(records):
        lines.append(f"| {c['workload']} | {c['procs']} | {c['method']} | {c['ms']} | {c['sps']} | {c['vs_ddp']} | "
                     f"{c['mb']} | {c['rss']} | {c['loss']} | {c['acc']} |" + (f" {c['hidden']} |" if traced else ""))
    return "\n".join(lines)


def syncbn(records: list[dict]) -> str:
    rows = ["| workers | features | batch | local BN (ms) | distlab SyncBN (ms) | ratio | SyncBN max out / grad diff | local BN max out diff | float32 rounding bound |",
            "|---|---|---|---|---|---|---|---|---|"]
    cells = {(r["workers"], r["features"], r["batch"], r["implementation"]): r for r in records if r.get("available")}
    for w, f, b in dict.fromkeys((r["workers"], r["features"], r["batch"]) for r in records):
        loc, mine = cells.get((w, f, b, "local")), cells.get((w, f, b, "distlab"))
        if not (loc and mine):
            continue
        rows.append(f"| {w} | {f} | {b} | {1000 * loc['time_s_median']:.3f} | {1000 * mine['time_s_median']:.3f} | "
                    f"{mine['time_s_median'] / loc['time_s_median']:.2f}x | {mine['max_abs_out_diff']:.1e} / "
                    f"{mine['max_abs_grad_diff']:.1e} | {loc['max_abs_out_diff']:.1e} | "
                    f"{'-' if mine.get('tolerance') is None else format(mine['tolerance'], '.1e')} |")
    return "\n".join(rows)


def verify_records(records: list[dict]) -> str:
    """``distlab verify --json`` records: each strategy's largest differences from one process."""
    from distlab.bench.common import format_table
    rows = [[r["strategy"], str(r["world_size"]), str(r["steps"]), f"{r['max_abs_param_diff']:.2e}",
             f"{r['max_loss_diff']:.2e}", "-" if r.get("tolerance") is None else f"{r['tolerance']:.1e}",
             "approximate" if r["passed"] is None else ("pass" if r["passed"] else "FAIL")] for r in records]
    return format_table(["strategy", "ranks", "steps", "max abs param diff", "max loss diff", "tolerance", "result"],
                        rows, markdown=True)


def fault_records(records: list[dict]) -> str:
    """``distlab verify --faults --json`` records: each drill against an uninterrupted run."""
    from distlab.bench.common import format_table
    rows = [[r["strategy"], str(r["world_size"]), r["drill"],
             "-" if r.get("max_abs_param_diff") is None else f"{r['max_abs_param_diff']:.2e}",
             "skipped" if r["passed"] is None else ("pass" if r["passed"] else "FAIL"),
             str(r.get("detail", "")).replace("|", "/")[:120]] for r in records]
    return format_table(["strategy", "ranks", "drill", "max abs param diff", "result", "detail"], rows, markdown=True)


def mapped_corpus(records: list[dict]) -> str:
    """``scripts/mapped_corpus_memory.py``: a run's peak memory against the size of its memory-mapped corpus."""
    from distlab.bench.common import format_table
    base = min(records, key=lambda r: r["train_file_bytes"])
    anon = all(r.get("peak_anon_rss_mb") is not None for r in records)  # older records measured RSS only
    rows = [[r["corpus"], f"{r['train_file_bytes'] / 1e9:.3g} GB", f"{r['windows']:,}", str(r["nproc"]),
             f"{r['peak_rss_mb']:.0f}", f"{r['peak_rss_mb'] - base['peak_rss_mb']:+.0f}"]
            + ([f"{r['peak_anon_rss_mb']:.0f}", f"{r['peak_anon_rss_mb'] - base['peak_anon_rss_mb']:+.0f}"]
               if anon else [])
            + [f"{1000 * r['time_per_step_s_median']:.1f}"] for r in records]
    return format_table(["corpus", "token file", "windows", "ranks", "peak RSS MB / rank", "vs smallest"]
                        + (["anonymous MB / rank", "vs smallest"] if anon else []) + ["ms/step"], rows, markdown=True)


def variant_cost(records: list[dict]) -> str:
    """``scripts/clipping_cost.py``, ``scripts/tracing_cost.py``: the main job's step in each variant
    (the first the baseline), interleaved rounds: per round the ratio to the baseline."""
    import statistics

    from distlab.bench.common import format_table
    by = {(r["variant"], r["round"]): r["time_per_step_s_median"] for r in records}
    rounds = sorted({r["round"] for r in records})
    variants = list(dict.fromkeys(r["variant"] for r in records))
    rows = []
    for variant in variants:
        times = [by[(variant, i)] for i in rounds if (variant, i) in by]
        ratios = [by[(variant, i)] / by[(variants[0], i)] for i in rounds if (variant, i) in by and (variants[0], i) in by]
        ratio = "1.000x" if variant == variants[0] else \
            f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
        rows.append([variant, f"{1e3 * statistics.median(times):.2f}", ratio, str(len(times))])
    return format_table(["variant", "ms/step (median of rounds)", f"vs {variants[0]} (range)", "rounds"], rows,
                        markdown=True)


def trace_table(trace: dict) -> str:
    """A run's ``trace.json`` (``--trace``): per rank, its time per traced step, compute, communication,
    the share hidden behind compute and the exposed rest (``plan.timeline_analysis.analyze``)."""
    from distlab.bench.common import format_table
    from distlab.plan.timeline_analysis import analyze
    found = analyze(trace)
    rows = [[str(r["rank"]), f"{1e3 * r['window_s_per_step']:.2f}", f"{1e3 * r['compute_s_per_step']:.2f}",
             f"{1e3 * r['communication_s_per_step']:.2f}",
             "-" if r["hidden_communication"] is None else f"{100 * r['hidden_communication']:.1f}%",
             f"{1e3 * r['exposed_communication_s_per_step']:.2f}"] for r in found["ranks"]]
    return format_table(["rank", "traced ms/step", "compute ms", "communication ms", "hidden", "exposed ms"], rows,
                        markdown=True) + f"\n{found['steps']} steps traced; slowest rank {found['slowest_rank']}"


def grpo_split(records: list[dict]) -> str:
    """``scripts/bench_grpo.py``'s runs: per world size the medians of a step, its rollout and its update, the
    rollout's share (range), and the tokens generated and trained a second."""
    import statistics

    from distlab.bench.common import format_table
    rows = []
    for n in sorted({r["nproc"] for r in records}):
        mine = [r for r in records if r["nproc"] == n]
        med = {k: statistics.median(r[k] for r in mine) for k in ("step_s", "rollout_s", "update_s", "rollout_share",
                                                                    "generated_tokens_per_s", "trained_tokens_per_s")}
        shares = [r["rollout_share"] for r in mine]
        rows.append([str(n), f"{1e3 * med['step_s']:.0f}", f"{1e3 * med['rollout_s']:.0f}", f"{1e3 * med['update_s']:.0f}",
                     f"{med['rollout_share']:.2f} ({min(shares):.2f}-{max(shares):.2f})",
                     f"{med['generated_tokens_per_s']:,.0f}", f"{med['trained_tokens_per_s']:,.0f}", str(len(mine))])
    return format_table(["ranks", "ms/step", "rollout ms", "update ms", "rollout share (range)", "generated tokens/s",
                         "trained tokens/s", "runs"], rows, markdown=True)


def grpo_walkthrough(data: dict) -> str:
    """``scripts/grpo_walkthrough.py``'s: the test prompts' greedy reward at each evaluation (step 0: the start)."""
    from distlab.bench.common import format_table
    return format_table(["GRPO step", "test reward (greedy)"],
                        [[str(step), f"{reward:.3f}"] for step, reward in data["test_reward_greedy"]], markdown=True)


def optimizer_state(data: dict) -> str:
    """``scripts/bench_optimizer_state.py``'s: each moments' dtype, its medians over the rounds."""
    from distlab.bench.common import format_table
    return format_table(["moments", "runs", "final train loss", "test loss", "ms/step", "model state B"],
                        [[r["state"], str(r["runs"]), f"{r['final_train_loss']:.4f}", f"{r['test_loss']:.4f}",
                          f"{r['step_s'] * 1e3:.0f}", f"{r['model_state_bytes_per_rank']:,}"] for r in data["rows"]],
                        markdown=True)


def muon(data: dict) -> str:
    """``scripts/bench_muon.py``'s: Muon against AdamW at the same steps, medians of the rounds."""
    from distlab.bench.common import format_table
    return format_table(["optimizer", "runs", "lr", "final train loss", "test loss (range)", "ms/step",
                         "model state B"],
                        [[r["optimizer"], str(r["runs"]), f"{r['lr']:g}", f"{r['final_train_loss']:.4f}",
                          f"{r['test_loss']:.4f} ({r['test_loss_range'][0]:.4f}-{r['test_loss_range'][1]:.4f})",
                          f"{r['step_s'] * 1e3:.0f}", f"{r['model_state_bytes_per_rank']:,}"] for r in data["rows"]],
                        markdown=True)


def hsdp(data: dict) -> str:
    """``scripts/bench_hsdp.py``'s: ZeRO over every rank and over shard groups on the emulated cluster, medians of
    the rounds (the speedup against ZeRO over every rank at the same stage: the median of the rounds' ratios)."""
    from distlab.bench.common import format_table
    return format_table(["strategy", "runs", "ms/step", "speedup", "bytes/step/rank (counted)",
                         "bytes/step on the links", "model state B"],
                        [[r["strategy"], str(r["runs"]), f"{r['step_s'] * 1e3:.1f}",
                          f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})",
                          f"{r['comm_bytes_per_step']:,}", f"{r['link_bytes_per_step']:,.0f}",
                          f"{r['model_state_bytes_per_rank']:,}"] for r in data["rows"]], markdown=True)


def offload(data: dict) -> str:
    """``scripts/bench_offload.py``'s: ZeRO-3 with nothing, the optimizer's state, or the shards too offloaded --
    the steps' peak resident memory and step time (medians of the rounds, their range, against nothing offloaded),
    the device's model state and the files' bytes beside the planner's, the bytes a step moves (planned)."""
    from distlab.bench.common import format_table

    def mark(got: int, planned: int) -> str:
        return "=" if got == planned else "!="
    rows = []
    for r in data["rows"]:
        (lo, hi), (slo, shi) = r["peak_rss_steps_range"], r["step_s_range"]
        rows.append([r["mode"], str(r["runs"]),
                     f"{r['peak_rss_steps_mb'] / 1024:.2f} GiB ({lo / 1024:.2f}-{hi / 1024:.2f}), {r['rss_vs_full']:.2f}x",
                     f"{r['peak_anon_rss_mb'] / 1024:.2f} GiB",
                     f"{r['model_state_bytes_per_rank'] / 2**30:.2f} GiB "
                     f"({mark(r['model_state_bytes_per_rank'], r['planned_model_state_bytes_per_rank'])})",
                     f"{r['offload_bytes_per_rank'] / 2**30:.2f} GiB "
                     f"({mark(r['offload_bytes_per_rank'], r['planned_offload_bytes_per_rank'])})",
                     f"{r['planned_moved_bytes_per_step'] / 2**30:.2f} GiB",
                     f"{r['step_s']:.1f} ({slo:.1f}-{shi:.1f}), {r['step_vs_full']:.2f}x"])
    return format_table(["offload", "runs", "peak RSS of the steps / rank (range)", "anonymous",
                         "device state / rank (= plan)", "in the files / rank (= plan)", "moved / step (plan)",
                         "s/step (range)"], rows, markdown=True)


def offload_overlap(data: dict) -> str:
    """``scripts/bench_offload_overlap.py``'s: the offloaded step waited for, or overlapped with the next forward --
    the step time (median of the rounds, its range; the speedup the median of the rounds' ratios) and how long the
    training thread waited for the overlapped steps, in the forwards and in all (medians, over the run)."""
    from distlab.bench.common import format_table
    rows = [[r.get("layout", "dp"), r.get("offload", "optimizer"), str(r["ranks"]),
             "overlapped" if r["overlap"] else "waited for", str(r["runs"]),
             f"{1000 * r['step_s']:.0f} ({1000 * r['step_s_range'][0]:.0f}-{1000 * r['step_s_range'][1]:.0f})",
             f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f})",
             f"{r['forward_waited_s']:.2f} s / {r['waited_s']:.2f} s" if r["overlap"] else "--",
             "yes" if r["same_loss"] else "no"] for r in data["rows"]]
    return format_table(["layout", "offload", "ranks", "step", "runs", "ms/step (range)", "speedup", "waited: in forwards / in all",
                         "same loss"], rows, markdown=True)


def plan_search(data: dict) -> str:
    """``plan --search --json``'s: the layouts that fit, fastest first (what offload spends over the host link)."""
    from distlab.bench.common import format_table
    rows = [[str(i), p["strategy_text"], f"{p['tokens_per_s_per_gpu']:,.0f}", f"{p['mfu']:.1%}",
             f"{p['memory_bytes_per_rank'] / 2**30:.1f} GiB", f"{p['step_s']:.3g} s",
             f"{(p.get('offload') or {}).get('seconds_per_step', 0):.3g} s"] for i, p in enumerate(data["ranked"], 1)]
    return format_table(["#", "layout", "tokens/s/GPU", "MFU", "memory", "step", "over the host link"], rows,
                        markdown=True) + "\n" + data["why"].splitlines()[0]


def _kind(first: dict):
    """The table of a file whose records start with ``first`` (by the fields only that bench writes)."""
    from distlab.bench import (checkpointing, compression, dry_run, elastic, finetune, load_peak, overhead, parallel,
                               pipeline, scaling, snapshot_format, snapshot_stall)
    tables = [
        (("algorithm",), collectives),
        (("drill",), fault_records),
        (("max_abs_param_diff", "passed"), verify_records),
        (("mlp_widths", "strategy"), lambda r: parallel.table(r, markdown=True)),
        # before pipeline's: with --pp a checkpointing record names a schedule too
        (("time_per_step_s_checkpointed",), lambda r: checkpointing.table(r, markdown=True)),
        (("schedule", "microbatches"), lambda r: pipeline.table(r, markdown=True)),
        (("scaling_efficiency",), lambda r: scaling.table(r, markdown=True)),
        (("speedup", "test_accuracies"), lambda r: compression.table(r, markdown=True)),
        (("killed_node",), lambda r: elastic.table(r, markdown=True)),
        (("side", "round"), lambda r: overhead.table(r, markdown=True)),
        (("save_s_median", "format"), lambda r: snapshot_format.table(r, markdown=True)),
        (("samples_per_s_median",), dp),
        (("features",), syncbn),
        (("train_file_bytes", "peak_rss_mb"), mapped_corpus),
        (("variant", "round", "time_per_step_s_median"), variant_cost),
        (("snapshot_stall_s_median", "mode"), lambda r: snapshot_stall.table(r, markdown=True)),
        (("load_peak_bytes", "largest_tensor_bytes"), lambda r: load_peak.table(r, markdown=True)),
        (("variant", "model_state_bytes_per_rank", "step_s"), lambda r: finetune.table(r, markdown=True)),
        (("mode", "real_tokens_per_s"), lambda r: finetune.table(r, markdown=True)),
        (("measured_model_state_bytes", "planned_model_state_bytes"), lambda r: dry_run.table(r, markdown=True)),
        (("rollout_s", "update_s", "rollout_share"), grpo_split),
    ]
    return next((table for fields, table in tables if all(f in first for f in fields)), None)


def render(path: str | Path) -> str:
    """The Markdown table of any JSON file a ``distlab bench`` command (or ``verify --json``, or the main
    job's script) writes."""
    from distlab.bench import mainjob
    data = json.loads(Path(path).read_text())
    if mainjob.is_results(data):
        return mainjob.table(data, markdown=True)
    if isinstance(data, dict) and "traceEvents" in data:  # a run's --trace: what its spans say, per rank
        return trace_table(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-plan-published":  # `plan published --json`
        from distlab.bench.published_table import markdown
        return markdown(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-grpo-walkthrough":
        return grpo_walkthrough(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-optimizer-state":
        return optimizer_state(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-hsdp":
        return hsdp(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-muon":
        return muon(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-offload":
        return offload(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-offload-overlap":
        return offload_overlap(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-plan-search":
        return plan_search(data)
    if isinstance(data, dict) and data.get("kind") == "distlab-collectives-fit":  # bench collectives' alpha-beta
        from distlab.bench.collectives import fit_markdown
        return fit_markdown(data)
    if not isinstance(data, list):
        raise ValueError("not a list of bench records")
    if not data:
        return f"(no records in {path})"
    table = _kind(data[0]) if isinstance(data[0], dict) else None
    if table is None:
        raise ValueError(f"{path}: not a bench file distlab knows (collectives, dp, syncbn, scaling, parallel, "
                         f"pipeline, checkpointing, compression, elastic, overhead, snapshot-format, snapshot, load, verify, "
                         f"dry-run, plan published, the main job's results, the mapped corpus's memory)")
    return table(data)
