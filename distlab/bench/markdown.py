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
    lines = ["| workload | procs | method | ms/step | samples/s | vs DDP | MB sent/step | peak RSS MB | loss | test acc |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in dp_rows(records):
        lines.append(f"| {c['workload']} | {c['procs']} | {c['method']} | {c['ms']} | {c['sps']} | {c['vs_ddp']} | "
                     f"{c['mb']} | {c['rss']} | {c['loss']} | {c['acc']} |")
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


def render(path: str | Path) -> str:
    """The Markdown table of any JSON file a ``distlab bench`` command writes."""
    records = json.loads(Path(path).read_text())
    if not isinstance(records, list):
        raise ValueError("not a list of bench records")
    if not records:
        return f"(no records in {path})"
    first = records[0]
    if "algorithm" in first:
        return collectives(records)
    if "mlp_widths" in first and "strategy" in first:
        from distlab.bench import parallel
        return parallel.table(records, markdown=True)
    if "activation_peak_bytes_checkpointed" in first:  # before pipeline's: with --pp it names a schedule too
        from distlab.bench import checkpointing
        return checkpointing.table(records, markdown=True)
    if "schedule" in first and "microbatches" in first:
        from distlab.bench import pipeline
        return pipeline.table(records, markdown=True)
    if "scaling_efficiency" in first:
        from distlab.bench import scaling
        return scaling.table(records, markdown=True)
    if "samples_per_s_median" in first:
        return dp(records)
    if "features" in first:
        return syncbn(records)
    raise ValueError(f"{path}: not a bench file distlab knows (collectives, dp, syncbn, scaling, parallel, pipeline, "
                     f"checkpointing)")
