"""A compact human-readable view of ``summary.json`` (rank 0 prints it at the end of a run)."""

from __future__ import annotations


def _fmt(value, spec: str = "", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_summary(summary: dict, out: str | None) -> None:
    s = summary
    rows = [
        ("model / dataset", f"{s['model']} ({s['num_parameters']:,} params) / {s['dataset']}"),
        ("world size", f"{s['world_size']} x {s['threads_per_rank']} threads, {s['backend']} on {s['device']}"),
        ("strategy", f"dp-sync {s['strategy']['dp_sync']}"),
        ("global batch", f"{s['global_batch_size']} ({s['local_batch_size']} per rank)"),
        ("steps / epochs", f"{s['steps']} / {s['epochs']:g}"),
        ("final train loss", _fmt(s["final_train_loss"], ".4f")),
        ("test accuracy", _fmt(None if s["test_accuracy"] is None else 100 * s["test_accuracy"], ".2f", "%")),
        ("test loss", _fmt(s["test_loss"], ".4f")),
        ("time/step (median)", _fmt(None if s["time_per_step_s_median"] is None
                                    else 1000 * s["time_per_step_s_median"], ".2f", " ms")),
        ("samples/s", _fmt(s["samples_per_s"], ",.0f")),
        ("comm bytes/step/rank", _fmt(s["comm_bytes_per_step"], ",")),
        ("peak RSS per rank", _fmt(s["peak_rss_mb"], ".0f", " MB")),
        ("wall time", _fmt(s["wall_time_s"], ".1f", " s")),
    ]
    if s.get("best_val_loss") is not None:
        rows.insert(8, ("best val loss", f"{s['best_val_loss']:.4f} (step {s['best_val_step']})"))
    if s.get("lr_scaling", "none") != "none":
        rows.insert(4, ("effective lr", f"{s['lr_effective']:.4g} (--lr {s['lr']:g}, {s['lr_scaling']} scaling "
                                        f"from batch {s['base_batch_size']})"))
    if s.get("resumed_from"):
        rows.append(("resumed from", s["resumed_from"]))
    if s.get("stopped") == "time_budget":
        rows.append(("stopped", f"time budget {s['time_budget_s']:g} s reached after {s['time_used_s']:.1f} s"))
    if s.get("snapshot"):
        rows.append(("last snapshot", s["snapshot"]))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)
    if out:
        print(f"summary: {out}/summary.json  metrics: {out}/metrics.jsonl", flush=True)
