"""The report's training-run sections: one per data set and task -- loss and accuracy curves, the
table, scaling across world sizes, a classifier's predictions, a mixture's expert load."""

from __future__ import annotations

import html
import statistics
from pathlib import Path

from distlab.tools.plots import integer_ticks, pyplot, style
from distlab.tools.report.pieces import (Col, fmt_date, fmt_loss, fmt_ms, fmt_pct, fmt_size, html_table, place_legend,
                                         png, run_label, short_path, strategy_label)

def _task(summary: dict | None) -> tuple[str, str, str]:
    """(what the runs do, the loss's unit, what accuracy counts) from a run's summary."""
    if not summary:
        return "runs without a summary.json", "", ""
    if summary.get("loss_unit") == "grpo":
        return "learning from rewards (GRPO)", "GRPO loss", "test prompts whose greedy completion earned a reward"
    if summary.get("loss_unit") == "dpo":
        return "preference tuning (DPO)", "DPO loss", "test pairs whose chosen completion has the larger reward"
    if summary.get("loss_unit") == "nats/token":
        return "next-token prediction", "nats/token", "next tokens predicted"
    return "classification", "cross-entropy, nats/sample", "test samples classified"


def runs_sections(runs: list[dict], problems: list[tuple[str, str]]) -> list[str]:
    """One section per data set and task: only runs that measure the same thing share axes."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        s = r["summary"] or {}
        groups.setdefault((str(s.get("dataset") or ""), _task(r["summary"])[0]), []).append(r)
    return [_runs_section(dataset, rs, problems) for (dataset, _), rs in sorted(groups.items())]


def _runs_section(dataset: str, runs: list[dict], problems: list[tuple[str, str]]) -> str:
    """One data set's runs: loss curves, accuracy bars, the table, scaling, the best run's mistakes; what
    cannot be drawn of one run goes into ``problems`` (path, why)."""
    plt = pyplot()
    task, unit, counted = _task(runs[0]["summary"])
    unit_text = f" ({unit})" if unit else ""
    out = [f"<h2>Training runs: {html.escape(dataset or 'unknown data set')} &mdash; {html.escape(task)}</h2>",
           f"<p>{len(runs)} run(s); losses{html.escape(unit_text)}" + (f", accuracy: {html.escape(counted)}"
                                                                       if counted else "") + ".</p>"]
    with_metrics = [r for r in runs if r["metrics"]]
    if with_metrics:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
        for i, r in enumerate(with_metrics):
            label, kw = run_label(r), style(i, len(r["metrics"]))
            a.plot([m["step"] for m in r["metrics"]], [m["loss"] for m in r["metrics"]], label=label, **kw)
            b.plot([m.get("time_s", 0) for m in r["metrics"]], [m["loss"] for m in r["metrics"]], label=label, **kw)
        a.set(xlabel="step", ylabel=f"training loss{unit_text}", title=f"{dataset}: loss vs step")
        b.set(xlabel="wall time (s)", ylabel=f"training loss{unit_text}", title=f"{dataset}: loss vs time")
        place_legend(b, len(with_metrics))
        out.append(png(fig))
    clipped = [r for r in with_metrics if any("grad_norm" in m for m in r["metrics"])]
    if clipped:  # --clip-grad-norm: the norm before clipping, every logged step
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for i, r in enumerate(clipped):
            steps = [m for m in r["metrics"] if "grad_norm" in m]
            line, = ax.plot([m["step"] for m in steps], [m["grad_norm"] for m in steps], label=run_label(r),
                            **style(i, len(steps)))
            limit = ((r["summary"] or {}).get("config") or {}).get("clip_grad_norm")
            if isinstance(limit, (int, float)):  # where clipping starts: a norm above the line was scaled down to it
                ax.axhline(limit, linestyle=":", color=line.get_color(), label=f"{run_label(r)}: max norm {limit:g}")
        ax.set(xlabel="step", ylabel="gradient norm before clipping", title=f"{dataset}: gradient norm")
        place_legend(ax, len(clipped))
        out.append(png(fig))
    out.append(_rewards([r for r in with_metrics if any("reward_margin" in m for m in r["metrics"])], dataset))
    out.append(_grpo([r for r in with_metrics if any("completion_length" in m for m in r["metrics"])], dataset))
    evaluated = [r for r in runs if len((r["summary"] or {}).get("evals") or []) >= 2]
    if evaluated:  # --eval-every (or several epochs): the held-out loss over the run: test solid, validation dashed
        fig, ax = plt.subplots(figsize=(9, 3.6))
        for i, r in enumerate(evaluated):
            evals = r["summary"]["evals"]
            line, = ax.plot([e["step"] for e in evals], [e["test_loss"] for e in evals], label=f"{run_label(r)} test",
                            **{**style(i, len(evals)), "linestyle": "-"})
            val = [e for e in evals if e.get("val_loss") is not None]
            if val:
                ax.plot([e["step"] for e in val], [e["val_loss"] for e in val], linestyle="--", color=line.get_color(),
                        label=f"{run_label(r)} validation")
        ax.set(xlabel="step", ylabel=f"evaluation loss{unit_text}", title=f"{dataset}: evaluations")
        place_legend(ax, len(evaluated))
        out.append(png(fig))
    done = [r for r in runs if r["summary"]]
    if done:
        acc = [r for r in done if r["summary"].get("test_accuracy") is not None]
        if acc:  # horizontal bars: a run's label reads along its bar, however many runs
            fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * len(acc)))
            values = [100 * r["summary"]["test_accuracy"] for r in acc]
            ax.barh(range(len(acc)), values)
            ax.set_yticks(range(len(acc)), [run_label(r) for r in acc], fontsize=7)
            ax.invert_yaxis()
            for i, v in enumerate(values):
                ax.text(v, i, f" {v:.2f}%", va="center", fontsize=7)
            ax.set_xlim(0.0, min(100.0, max(values) * 1.12 + 1))  # from 0: a bar's length is its accuracy
            ax.set(xlabel=f"test accuracy (%, {counted})", title=f"{dataset}: test accuracy")
            out.append(png(fig))
        rows = [{**r["summary"], "run": short_path(r["path"]),
                 "strategy_label": strategy_label(r["summary"].get("strategy") or {}, r["summary"].get("world_size"))}
                for r in done]
        columns = RUN_COLUMNS if unit != "nats/token" else \
            [c if c.key != "test_loss" else Col("test_loss", "test loss (nats/token)") for c in RUN_COLUMNS[:6]] + \
            [Col("test_loss_per_byte", "test loss (nats/byte)"), Col("tokenizer", "tokenizer")] + RUN_COLUMNS[6:8] + \
            [Col("tokens_per_s", "tokens/s", "{:,.0f}".format), Col("mfu", "MFU", fmt_pct)] + RUN_COLUMNS[8:]
        out.append(html_table(rows, columns))
        out.append(_scaling_from_runs(done))
        out.append(_best_predictions(done, problems))
        out.append(_expert_load([r for r in done if (r["summary"].get("experts") or {}).get("load")]))
    return "\n".join(out)


def _rewards(runs: list[dict], dataset: str) -> str:
    """Preference tuning (DPO): the training pairs' reward margin (chosen minus rejected, each ``beta (log pi -
    log ref)``) and the share of pairs preferred, every logged step."""
    if not runs:
        return ""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
    for i, r in enumerate(runs):
        steps = [m for m in r["metrics"] if "reward_margin" in m]
        kw = style(i, len(steps))
        a.plot([m["step"] for m in steps], [m["reward_margin"] for m in steps], label=run_label(r), **kw)
        b.plot([m["step"] for m in steps], [100 * m["reward_accuracy"] for m in steps], label=run_label(r), **kw)
    a.set(xlabel="step", ylabel="reward margin (chosen - rejected)", title=f"{dataset}: reward margin")
    b.set(xlabel="step", ylabel="pairs preferred (%)", title=f"{dataset}: preference accuracy", ylim=(0, 100))
    place_legend(b, len(runs))
    return png(fig)


def _grpo(runs: list[dict], dataset: str) -> str:
    """Learning from rewards (GRPO): the rollouts' mean reward every logged step beside the test prompts' greedy
    one at each evaluation, and the KL to the reference with the share of tokens clipped."""
    if not runs:
        return ""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
    for i, r in enumerate(runs):
        steps = [m for m in r["metrics"] if "reward" in m]
        kw = style(i, len(steps))
        line, = a.plot([m["step"] for m in steps], [m["reward"] for m in steps], label=f"{run_label(r)} rollouts", **kw)
        evals = [e for e in (r["summary"] or {}).get("evals") or [] if e.get("test_reward") is not None]
        if evals:
            a.plot([e["step"] for e in evals], [e["test_reward"] for e in evals], linestyle="--", marker="o",
                   color=line.get_color(), label=f"{run_label(r)} test (greedy)")
        lossy = [m for m in r["metrics"] if "clip_fraction" in m]
        b.plot([m["step"] for m in lossy], [100 * m["clip_fraction"] for m in lossy], label=f"{run_label(r)} clipped %",
               **kw)
        b.plot([m["step"] for m in lossy], [m["kl"] for m in lossy], linestyle=":", color=line.get_color(),
               label=f"{run_label(r)} KL")
    a.set(xlabel="step", ylabel="mean reward", title=f"{dataset}: reward")
    b.set(xlabel="step", ylabel="KL to the reference; tokens clipped (%)", title=f"{dataset}: KL and clipping")
    place_legend(a, len(runs))
    place_legend(b, len(runs))
    return png(fig)


def _expert_load(runs: list[dict]) -> str:
    """Mixture-of-experts runs: the token-slots each expert received, all layers, one bar group per run
    (a balanced router gives equal bars; the summary's max/mean in the legend)."""
    if not runs:
        return ""
    plt = pyplot()
    width = 0.8 / len(runs)
    experts = max(len(r["summary"]["experts"]["load"]) for r in runs)
    fig, ax = plt.subplots(figsize=(min(12, max(10, 0.5 * experts * len(runs))), 3.8))
    for i, r in enumerate(runs):
        x = r["summary"]["experts"]
        share = [v / max(sum(x["load"]), 1) for v in x["load"]]
        ax.bar([e + i * width for e in range(len(share))], share, width,
               label=f"{run_label(r)} (max/mean {x['max_over_mean']:.2f}, dropped {100 * x['dropped_fraction']:.1f}%)")
    ax.axhline(1 / experts, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks([e + 0.4 - width / 2 for e in range(experts)], [str(e) for e in range(experts)])
    ax.set(xlabel="expert", ylabel="share of routed token-slots", title="mixture of experts: load per expert "
           "(dashed: balanced)")
    place_legend(ax, len(runs))
    return png(fig)


def _best_predictions(runs: list[dict], problems: list[tuple[str, str]]) -> str:
    """The confusion matrix and mistakes of the section's most accurate classifier (one per section keeps
    the page short; every run's are in its own predictions.npz). A predictions file that cannot be read
    is named and skipped: the next most accurate run's are shown instead."""
    ranked = sorted((r for r in runs if r["summary"].get("predictions")),
                    key=lambda r: -(r["summary"].get("test_accuracy") or 0.0))
    for r in ranked:
        try:
            shown = _predictions(r)
        except Exception as exc:  # noqa: BLE001 - a file distlab did not write as it is now: skip it, say which
            pyplot().close("all")
            problems.append((str(Path(r["path"]) / str(r["summary"]["predictions"])),
                             f"predictions could not be drawn: {type(exc).__name__}: {exc}"[:300]))
            continue
        if shown:
            others = len(ranked) - 1
            return shown + (f"<p>The most accurate run's; {others} other run(s) of this section keep theirs in their "
                            f"predictions.npz.</p>" if others > 0 else "")
    return ""


def _predictions(run: dict) -> str:
    """The final model's confusion matrix and misclassified test images (the run's predictions.npz)."""
    name = (run["summary"] or {}).get("predictions")
    if not isinstance(name, str) or Path(name).name != name or not (Path(run["path"]) / name).is_file():
        return ""
    import numpy as np
    with np.load(Path(run["path"]) / name, allow_pickle=False) as f:
        d = {k: f[k] for k in ("step", "confusion", "images", "labels", "predictions", "class_names")}
    confusion, names = d["confusion"].astype(float), [str(n) for n in d["class_names"]]
    k = len(confusion)
    if confusion.shape != (k, k) or len(names) != k or len(d["images"]) != len(d["labels"]):
        raise ValueError(f"{run['path']}/{name}: arrays of inconsistent shapes")
    plt = pyplot()
    shown = len(d["images"])
    cols = 6
    rows = max(1, -(-shown // cols))
    fig = plt.figure(figsize=(13, max(5.0, 1.25 * rows)))
    grid = fig.add_gridspec(rows, 2 * cols, width_ratios=[1] * cols + [0.55] * cols)
    ax = fig.add_subplot(grid[:, :cols])
    rates = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    labels = names if k <= 20 else [str(i) if i % max(1, k // 10) == 0 else "" for i in range(k)]
    ax.set_xticks(range(k), labels, rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(k), labels, fontsize=7)
    if k <= 12:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, f"{int(confusion[i, j])}", ha="center", va="center", fontsize=6,
                        color="white" if rates[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=f"{run_label(run)}: confusion (step {int(d['step'])}; "
                                                      + ("counts; " if k <= 12 else "")
                                                      + "colour: the share of each true class's samples)")
    for n in range(shown):
        sub = fig.add_subplot(grid[n // cols, cols + n % cols])
        img = d["images"][n].astype(float)
        img = (img - img.min()) / max(img.max() - img.min(), 1e-12)  # any stored range shown in full
        sub.imshow(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0), cmap="gray" if img.shape[0] == 1
                   else None)
        sub.set_title(f"{names[d['labels'][n]][:10]}\n-> {names[d['predictions'][n]][:10]}", fontsize=6)
        sub.axis("off")
    out = png(fig)
    return (f"<h3>{html.escape(run_label(run))}: what the final model gets wrong</h3><p>Confusion matrix of the "
            f"test set (counts; colour: share of the true class) and the first {shown} misclassified test images, "
            f"true -> predicted.</p>{out}")


RUN_COLUMNS = [Col("run", "run"), Col("world_size", "ranks"), Col("strategy_label", "strategy"), Col("steps", "steps"),
               Col("test_accuracy", "test accuracy", fmt_pct), Col("test_loss", "test loss", fmt_loss),
               Col("time_per_step_s_median", "ms/step (median)", fmt_ms), Col("samples_per_s", "samples/s", "{:,.0f}".format),
               Col("comm_bytes_per_step", "sent per step per rank", fmt_size),
               Col("model_state_bytes_per_rank", "model state per rank", fmt_size),
               Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format),
               Col("peak_anon_rss_mb", "of it anonymous (MB)", "{:,.0f}".format), Col("torch_version", "torch"),
               Col("hostname", "host"), Col("date", "date", fmt_date)]


def _scaling_from_runs(runs: list[dict]) -> str:
    """Samples/s and efficiency vs world size for runs of one model, data set, strategy and per-rank
    batch (weak scaling) at several world sizes."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        s = r["summary"]
        if s.get("samples_per_s"):
            key = (f"{s.get('model')} {s.get('dataset')} {strategy_label(s.get('strategy') or {})} "
                   f"{s.get('local_batch_size')}/rank")
            groups.setdefault(key, []).append(s)
    groups = {k: v for k, v in groups.items() if len({s["world_size"] for s in v}) > 1}
    if not groups:
        return ""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    rows, all_worlds = [], []
    for i, (name, summaries) in enumerate(groups.items()):
        by_world: dict[int, list[float]] = {}
        for s in summaries:
            by_world.setdefault(s["world_size"], []).append(s["samples_per_s"])
        worlds = sorted(by_world)
        all_worlds += worlds
        sps = [statistics.median(by_world[w]) for w in worlds]
        eff = [x / (w * sps[0] / worlds[0]) for w, x in zip(worlds, sps)]
        a.plot(worlds, sps, label=name, **style(i))
        b.plot(worlds, eff, label=name, **style(i))
        rows += [{"strategy": name, "world_size": w, "samples_per_s": x, "efficiency": e}
                 for w, x, e in zip(worlds, sps, eff)]
    a.set(xlabel="world size", ylabel="samples/s", title="throughput vs world size")
    b.set(xlabel="world size", ylabel="efficiency (per-rank throughput / smallest run's)", title="scaling efficiency")
    for ax in (a, b):
        integer_ticks(ax, all_worlds)
    place_legend(b, len(groups))
    cols = [Col("strategy", "model, data, strategy, batch per rank"), Col("world_size", "ranks"),
            Col("samples_per_s", "samples/s (median)", "{:,.0f}".format), Col("efficiency", "scaling efficiency", "{:.2f}".format)]
    return "<h3>Scaling across runs (same per-rank batch)</h3>" + png(fig) + html_table(rows, cols)
