"""``distlab plan published``'s rows as a table: the text the command prints and the Markdown
``distlab bench markdown`` writes from its JSON (the rows come from :func:`distlab.plan.published.compare`)."""

from __future__ import annotations

from distlab.bench.common import format_table

HEADERS = ["run", "model", "GPUs", "layout (as distlab runs it)", "published", "predicted", "error",
           "memory published", "predicted", "error"]


def _cells(r: dict, markdown: bool) -> list[str]:
    """One row's cells: what was published (tokens/s or TFLOP/s per GPU, memory), the prediction, the errors."""
    if r["published_tokens_per_s_per_gpu"]:
        pub, pred = f"{r['published_tokens_per_s_per_gpu']:,.0f} tok/s", f"{r['predicted_tokens_per_s_per_gpu']:,.0f}"
    elif r["published_tflops_per_gpu"]:
        pub, pred = f"{r['published_tflops_per_gpu']:,.0f} TFLOP/s", f"{r['predicted_tflops_per_gpu']:,.0f}"
    else:  # a memory-only row
        pub, pred = "-", f"({r['predicted_tokens_per_s_per_gpu']:,.0f} tok/s)"
    return [r["key"], r["model"], f"{r['gpus']:,}", f"`{r['layout']}`" if markdown else r["layout"], pub, pred,
            f"{r['throughput_err']:+.0%}" if "throughput_err" in r else "-",
            f"{r['published_memory_gib']:.1f} GiB" if r["published_memory_gib"] else "-",
            f"{r['predicted_memory_gib']:.1f} GiB", f"{r['memory_err']:+.0%}" if "memory_err" in r else "-"]


def format_compare(result: dict) -> str:
    """The rows as a table, then the median errors and where the compute rate came from."""
    t, m = result["median_abs_throughput_err"], result["median_abs_memory_err"]
    return (format_table(HEADERS, [_cells(r, False) for r in result["rows"]]) + "\nmedian |error|: "
            + ", ".join(f"{what} {v:.1%}" for what, v in (("throughput", t), ("memory", m)) if v is not None)
            + f" (compute at {result['efficiency']:.1%} of each GPU's datasheet peak: {result['efficiency_source']})")


def markdown(result: dict) -> str:
    """``distlab plan published --json``'s rows as a Markdown table (``distlab bench markdown``)."""
    return format_table(HEADERS, [_cells(r, True) for r in result["rows"]], markdown=True)
