"""The report's bench sections, one per kind of bench JSON (:data:`SECTIONS`): the plot and the table
of the numbers behind it."""

from __future__ import annotations

import json
import statistics

from distlab.tools.plots import integer_ticks, pyplot, style
from distlab.tools.report.pieces import (Col, bar_chart, fmt_ms, fmt_pct, fmt_sci, fmt_size, html_table, place_legend,
                                         png, short_path)

def _collectives_section(records: list[dict]) -> str:
    plt = pyplot()
    out = []
    for world in sorted({r["world_size"] for r in records}):
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
        for i, algo in enumerate(dict.fromkeys(r["algorithm"] for r in records)):
            pts = sorted((r["numel"], r["time_s_median"], r["busbw_gbps"]) for r in records
                         if r["world_size"] == world and r["algorithm"] == algo and r["numel"] > 0)
            if pts:
                n, t, bw = zip(*pts)
                a.plot(n, t, label=algo, **style(i))
                b.plot(n, bw, label=algo, **style(i))
        a.set(xscale="log", yscale="log", xlabel="elements", ylabel="median time (s)",
              title=f"all-reduce time, world size {world}")
        b.set(xscale="log", xlabel="elements", ylabel="bus bandwidth (GB/s)", title=f"bus bandwidth, world size {world}")
        place_legend(b, len(b.lines))
        out.append(png(fig))
    cols = [Col("algorithm", "algorithm"), Col("op", "op"), Col("world_size", "ranks"), Col("numel", "elements"),
            Col("dtype", "dtype"), Col("time_s_median", "time (ms, median)", fmt_ms),
            Col("busbw_gbps", "bus bandwidth (GB/s)", "{:.3g}".format), Col("rel_err", "relative error", fmt_sci),
            Col("bytes_sent_per_rank", "sent per rank", fmt_size), Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format)]
    return "\n".join(out) + html_table(records, cols)


def _dp_section(records: list[dict]) -> str:
    labels = [f"{r['workload']} x{r['world_size']} {r['dp_sync']}:{r.get('collective', 'native')}" for r in records]
    img = bar_chart(labels, [r.get("samples_per_s_median") or 0 for r in records], "samples/s", "data parallel: throughput")
    cols = [Col("workload", "workload"), Col("world_size", "ranks"), Col("dp_sync", "method"),
            Col("collective", "collective"), Col("time_per_step_s_median", "ms/step (median)", fmt_ms),
            Col("samples_per_s_median", "samples/s", "{:,.0f}".format),
            Col("comm_bytes_per_step", "sent per step per rank", fmt_size),
            Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format), Col("final_train_loss", "final loss", "{:.4f}".format),
            Col("test_accuracy", "test accuracy", fmt_pct)]
    return img + html_table(records, cols)


def _parallel_section(records: list[dict]) -> str:
    ok = [r for r in records if r.get("supported")]
    labels = [f"{r['workload']} {r['strategy']}" for r in ok]
    imgs = bar_chart(labels, [r["model_state_bytes_per_rank"] / 2**20 for r in ok], "MiB per rank",
                "parameters + gradients + optimizer state per rank")
    imgs += bar_chart(labels, [r["comm_bytes_per_step"] / 2**20 for r in ok], "MiB per step per rank", "bytes sent per step")
    imgs += bar_chart(labels, [1000 * r["time_per_step_s_median"] for r in ok], "ms", "time per step (median)")
    cols = [Col("workload", "workload"), Col("strategy", "strategy"), Col("world_size", "ranks"),
            Col("supported", "ran"), Col("time_per_step_s_median", "ms/step (median)", fmt_ms),
            Col("vs_torch", "vs torch", "{:.2f}x".format),
            Col("comm_bytes_per_step", "sent per step per rank", fmt_size),
            Col("model_state_bytes_per_rank", "model state per rank", fmt_size),
            Col("peak_rss_mb", "peak RSS (MB)", "{:,.0f}".format), Col("final_train_loss", "loss", "{:.4f}".format)]
    return imgs + html_table(records, cols)


def _pipeline_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, key in enumerate(dict.fromkeys((r["implementation"], r["schedule"]) for r in records)):
        rs = sorted((r for r in records if (r["implementation"], r["schedule"]) == key), key=lambda r: r["microbatches"])
        ax.plot([r["microbatches"] for r in rs], [1000 * r["time_per_step_s_median"] for r in rs],
                label=" ".join(key), **style(i))
    integer_ticks(ax, [r["microbatches"] for r in records])
    ax.set(xlabel="micro-batches", ylabel="ms per step (median)", title=f"pipeline, {records[0]['stages']} stages")
    place_legend(ax, len(ax.lines))
    cols = [Col("schedule", "schedule"), Col("microbatches", "micro-batches"), Col("implementation", "implementation"),
            Col("time_per_step_s_median", "ms/step (median)", fmt_ms), Col("vs_torch", "vs torch", "{:.2f}x".format),
            Col("bubble_measured", "bubble measured", "{:.2f}".format),
            Col("bubble_ideal", "bubble (P-1)/(M+P-1)", "{:.2f}".format),
            Col("activation_peak_bytes_per_stage", "peak activations per stage",
                lambda v: " / ".join(fmt_size(b) for b in v)),
            Col("max_loss_diff_vs_torch", "max |loss diff| vs torch", fmt_sci)]
    return png(fig) + html_table(records, cols)


def _checkpointing_section(records: list[dict]) -> str:
    plt = pyplot()
    labels = [r["workload"] + (f" pp {r['pp']}" if r.get("pp", 1) > 1 else "") + f" {r.get('precision', 'fp32')}"
              for r in records]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(labels)), 3.6))
    x, w = range(len(records)), 0.4
    ax.bar([i - w / 2 for i in x], [r["activation_peak_bytes_plain"] / 2**20 for r in records], w, label="plain")
    ax.bar([i + w / 2 for i in x], [r["activation_peak_bytes_checkpointed"] / 2**20 for r in records], w,
           label="checkpointed")
    ax.set_xticks(list(x), labels, rotation=25, ha="right", fontsize=7)
    ax.set(ylabel="MiB (the largest stage's)", title="held for backward, at the peak")
    place_legend(ax, 2)
    cols = [Col("workload", "workload"), Col("pp", "stages"), Col("precision", "precision"), Col("batch", "batch"),
            Col("activation_peak_bytes_plain", "held (plain)", fmt_size),
            Col("activation_peak_bytes_checkpointed", "held (checkpointed)", fmt_size),
            Col("time_per_step_s_plain", "ms/step", fmt_ms), Col("time_per_step_s_checkpointed", "ms/step checkpointed", fmt_ms),
            Col("time_ratio", "time ratio", "{:.2f}x".format), Col("gradients_bitwise_equal", "same gradients")]
    return png(fig) + html_table(records, [c for c in cols if any(c.key in r for r in records)])


def _overhead_section(records: list[dict]) -> str:
    from distlab.tools.overhead_summary import figure, summarize
    fig, rows = figure(records), summarize(records)
    cols = [Col("workload", "workload"), Col("precision", "precision"), Col("device", "device"),
            Col("plain_s", "plain ms/step", fmt_ms), Col("distlab_s", "distlab ms/step", fmt_ms),
            Col("ratio_median", "distlab / plain", "{:.2f}x".format), Col("ratio_min", "min", "{:.2f}x".format),
            Col("ratio_max", "max", "{:.2f}x".format), Col("rounds", "rounds")]
    return png(fig) + html_table(rows, cols)


def _syncbn_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, impl in enumerate(dict.fromkeys(r["implementation"] for r in records)):
        pts = sorted((r["workers"], r["time_s_median"] * 1e3) for r in records
                     if r["implementation"] == impl and r.get("available") and r.get("time_s_median"))
        if pts:
            ax.plot(*zip(*pts), label=impl, **style(i))
    ax.set(xlabel="workers", ylabel="median time (ms)", title="batch norm forward + backward")
    integer_ticks(ax, [r["workers"] for r in records])
    place_legend(ax, len(ax.lines))
    cols = [Col("implementation", "implementation"), Col("workers", "workers"), Col("features", "features"),
            Col("batch", "batch"), Col("time_s_median", "time (ms, median)", fmt_ms),
            Col("max_abs_out_diff", "max |output diff|", fmt_sci), Col("max_abs_grad_diff", "max |grad diff|", fmt_sci),
            Col("tolerance", "float32 rounding bound", fmt_sci)]
    return png(fig) + html_table(records, [c for c in cols if any(c.key in r for r in records)])


def _scaling_section(records: list[dict]) -> str:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for i, key in enumerate(dict.fromkeys((r["mode"], r["dp_sync"], r.get("bandwidth") or "lo") for r in records)):
        rs = sorted((r for r in records if (r["mode"], r["dp_sync"], r.get("bandwidth") or "lo") == key),
                    key=lambda r: r["world_size"])
        label = " ".join(map(str, key))
        a.plot([r["world_size"] for r in rs], [r["scaling_efficiency"] or 0 for r in rs], label=label, **style(i))
        for r in rs:
            if r.get("loss_curve"):
                t, loss = zip(*r["loss_curve"])
                b.plot(t, loss, label=f"{label} N={r['world_size']}", **style(len(b.lines), len(t)))
    a.set(xlabel="workers", ylabel="scaling efficiency", title="scaling efficiency", ylim=(0, 1.1))
    integer_ticks(a, [r["world_size"] for r in records])
    b.set(xlabel="training time (s)", ylabel="loss", title="loss vs time")
    a.legend(fontsize=7)
    place_legend(b, len(b.lines))
    cols = [Col("mode", "mode"), Col("dp_sync", "method"), Col("bandwidth", "link"), Col("world_size", "workers"),
            Col("lr", "LR", "{:.3g}".format), Col("global_batch_size", "global batch"),
            Col("steps_per_epoch", "steps per epoch"), Col("epoch_time_s", "epoch (s)", "{:.2f}".format),
            Col("scaling_efficiency", "efficiency", "{:.2f}".format), Col("sync_share", "sync share", "{:.0%}".format),
            Col("overhead_share", "overhead share", "{:.0%}".format), Col("best_val_loss", "best val loss", "{:.4f}".format),
            Col("test_loss", "test loss", "{:.4f}".format), Col("test_accuracy", "test accuracy", fmt_pct)]
    return png(fig) + html_table(records, cols)


def _verify_section(records: list[dict]) -> str:
    cols = [Col("strategy", "strategy"), Col("world_size", "ranks"), Col("steps", "steps"),
            Col("max_abs_param_diff", "max |param diff|", fmt_sci), Col("max_loss_diff", "max |loss diff|", fmt_sci),
            Col("tolerance", "tolerance", fmt_sci), Col("passed", "passed")]
    return html_table(records, cols)


def _plan_section(records: list[dict]) -> str:
    """``distlab plan validate``: predicted vs measured step time, per link and world size."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    markers = "osD^v<>"
    worlds = sorted({r["world_size"] for r in records})
    kinds = list(dict.fromkeys(r.get("kind", "training") for r in records))
    for kind in kinds:
        for link in dict.fromkeys(r["link"] for r in records):
            for i, n in enumerate(worlds):
                rs = [r for r in records if r.get("kind", "training") == kind and r["link"] == link
                      and r["world_size"] == n]
                if rs:
                    ax.scatter([r["measured_step_s"] * 1e3 for r in rs], [r["predicted_step_s"] * 1e3 for r in rs],
                               marker="x+"[i % 2] if kind == "collective" else markers[i % len(markers)],
                               s=18 if kind == "collective" else None, alpha=0.7 if kind == "collective" else 1,
                               label=(f"{kind}s, " if len(kinds) > 1 else "") + f"{link}, {n} workers")
    lo = min(min(r["measured_step_s"], r["predicted_step_s"]) for r in records) * 1e3 / 1.5
    hi = max(max(r["measured_step_s"], r["predicted_step_s"]) for r in records) * 1e3 * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="exact")
    ax.fill_between([lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="grey", alpha=0.2, label="±20%")
    medians = ", ".join(f"{kind}s {statistics.median(abs(r['time_rel_err']) for r in records if r.get('kind', 'training') == kind):.0%}"
                        for kind in kinds)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms (per step or collective)",
           ylabel="predicted ms",
           title=f"distlab plan: predicted vs measured (median |error|: {medians})")
    ax.legend(fontsize=6)
    cols = [Col("kind", "kind"), Col("run", "run", short_path), Col("world_size", "ranks"), Col("link", "link"),
            Col("dp_sync", "method"), Col("zero", "ZeRO"), Col("measured_step_s", "measured (ms)", fmt_ms),
            Col("predicted_step_s", "predicted (ms)", fmt_ms), Col("time_rel_err", "error", "{:+.1%}".format),
            Col("predicted_compute_s", "compute (ms)", fmt_ms), Col("predicted_exposed_comm_s", "exposed comm (ms)", fmt_ms),
            Col("measured_model_state_bytes", "model state measured", fmt_size),
            Col("predicted_model_state_bytes", "model state predicted", fmt_size)]
    if any("measured_compute_s" in r for r in records):  # traced runs: their phases, measured
        cols[9:9] = [Col("measured_compute_s", "compute measured (ms)", fmt_ms),
                     Col("measured_exposed_comm_s", "exposed comm measured (ms)", fmt_ms)]
    return png(fig) + html_table(records, cols)


def _sweep_section(records: list[dict]) -> str:
    """``distlab plan --sweep --json``: memory per rank and scaling efficiency vs world size."""
    plt = pyplot()
    timed = all("step_s" in r for r in records)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 6.5, 4.5), squeeze=False)
    a, b = axes[0][0], axes[0][-1]
    rows = []
    for i, name in enumerate(dict.fromkeys(json.dumps(r["strategy"], sort_keys=True) for r in records)):
        rs = sorted((r for r in records if json.dumps(r["strategy"], sort_keys=True) == name),
                    key=lambda r: r["layout"]["world_size"])
        label = rs[0].get("strategy_text") or ",".join(f"{k}={v}" for k, v in json.loads(name).items()) or "as given"
        worlds = [r["layout"]["world_size"] for r in rs]
        a.plot(worlds, [r["memory_bytes_per_rank"] / 2**30 for r in rs], label=label, **style(i))
        if timed:
            b.plot(worlds, [r["scaling_efficiency"] for r in rs], label=label, **style(i))
        rows += [{**r, "strategy": label, "world_size": w} for w, r in zip(worlds, rs)]
    limit = records[0].get("device_memory_bytes")
    if limit:
        a.axhline(limit / 2**30, color="black", ls="--", lw=1, label="device memory")
    a.set(xscale="log", yscale="log", xlabel="data-parallel ranks", ylabel="GiB per rank",
          title=f"planned memory per rank ({records[0]['num_parameters']:,} parameters)")
    a.legend(fontsize=7)
    if timed:
        b.set(xscale="log", xlabel="data-parallel ranks", ylabel="scaling efficiency", ylim=(0, 1.05),
              title=f"planned scaling efficiency, link {records[0]['link']['name']}")
        b.legend(fontsize=7)
    cols = [Col("strategy", "strategy"), Col("world_size", "ranks"), Col("memory_bytes_per_rank", "memory per rank", fmt_size),
            Col("fits", "fits"), Col("step_s", "step (ms)", fmt_ms), Col("samples_per_s", "samples/s", "{:,.0f}".format),
            Col("scaling_efficiency", "efficiency", "{:.2f}".format)]
    return png(fig) + html_table(rows, cols)


def _search_section(records: list[dict]) -> str:
    """``distlab plan --search --json``: each ranked layout's step split into compute, recomputation, pipeline
    bubble and exposed communication (:func:`~distlab.plan.search.step_parts`), its memory against the GPU's,
    the table, and why the first wins as the search said it."""
    import html

    from distlab.plan.search import kept, step_parts
    search, plt = records[0]["search"], pyplot()
    cluster = search.get("cluster") or {}
    names = [f"{i}. {r['strategy_text']}" for i, r in enumerate(records, 1)][::-1]  # the first on top
    parts = [step_parts(r) for r in records][::-1]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.9 + 0.32 * len(records)), width_ratios=(3, 1), sharey=True)
    left = [0.0] * len(records)
    for i, (label, width) in enumerate((
            ("compute", [r["compute_s"] - p["bubble_s"] - p["recompute_s"] for r, p in zip(records[::-1], parts)]),
            ("recomputation", [p["recompute_s"] for p in parts]), ("pipeline bubble", [p["bubble_s"] for p in parts]),
            ("exposed communication", [p["exposed_s"] for p in parts]))):
        a.barh(names, width, left=left, label=label, color=f"C{i}")
        left = [x + w for x, w in zip(left, width)]
    a.set(xlabel="seconds per step", ylabel="layout (rank)", title="where each layout's step goes")
    a.tick_params(axis="y", labelsize=7)
    b.barh(names, [r["memory_bytes_per_rank"] / 2**30 for r in records][::-1], color="C4", label="memory")
    if cluster.get("memory_gib"):
        b.axvline(cluster["memory_gib"], color="black", ls="--", lw=1, label="the GPU's memory")
    b.set(xlabel="GiB per GPU", title="memory at the peak, GiB per GPU")
    handles = a.get_legend_handles_labels()[0] + b.get_legend_handles_labels()[0]
    b.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside: no bar hidden
    nodes = f"{cluster.get('nodes')} node{'s' if cluster.get('nodes') != 1 else ''}"
    keeping = f", {kept(search['fixed'])} kept" if search.get("fixed") else ""
    head = (f"<p>{search.get('gpus')} x {html.escape(str(cluster.get('machine')))} ({nodes}){html.escape(keeping)}: "
            f"{search.get('tried')} layouts tried, {search.get('fit')} fit</p>")
    rows = [{**r, "rank": i, "bubble": (r.get("pipeline") or {}).get("bubble_ideal", 0.0)} for i, r in enumerate(records, 1)]
    cols = [Col("rank", "#"), Col("strategy_text", "layout"), Col("tokens_per_s_per_gpu", "tokens/s per GPU",
            "{:,.0f}".format), Col("mfu", "MFU", fmt_pct), Col("memory_bytes_per_rank", "memory per GPU", fmt_size),
            Col("bubble", "bubble", fmt_pct), Col("exposed_comm_s", "exposed communication (ms)", fmt_ms),
            Col("step_s", "step (ms)", fmt_ms)]
    return head + png(fig) + html_table(rows, cols) + f"<pre>{html.escape(search.get('why') or '')}</pre>"


SECTIONS = {"collectives": ("Collectives", _collectives_section), "dp": ("Data parallel", _dp_section),
            "syncbn": ("Synchronized batch norm", _syncbn_section),
            "parallel": ("Tensor parallel and ZeRO", _parallel_section),
            "pipeline": ("Pipeline parallel", _pipeline_section),
            "scaling": ("Scaling", _scaling_section), "verify": ("Equivalence (distlab verify)", _verify_section),
            "plan": ("Cost model (distlab plan validate)", _plan_section),
            "sweep": ("Plan sweep (distlab plan --sweep)", _sweep_section),
            "search": ("Layouts of a GPU cluster (distlab plan --search)", _search_section),
            "overhead": ("Single-process overhead (distlab bench overhead)", _overhead_section),
            "checkpointing": ("Activation checkpointing (distlab bench checkpointing)", _checkpointing_section)}
