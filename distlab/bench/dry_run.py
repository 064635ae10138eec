"""``distlab bench dry-run``: the planner's model state and activations at real size, against distlab's own code.

For each published model (``--presets``) and each language-model layout ``distlab verify`` checks that a dry run
can follow (no pipeline or expert routing: they read values), scaled to ``--world`` ranks (its tensor and
context parallel sizes kept, data parallel taking the rest), one rank is dry-run at full size
(:func:`distlab.plan.dry_run.dry_run`: the meta device, torch's fake process group) beside the plan
(:func:`distlab.plan.predict`): the measured model state against the plan's exact figure, the activations
autograd saves against its estimate. Attention as a GPU runs it (the flash kernel's saved tensors).
"""

from __future__ import annotations

from distlab.bench.common import format_table, machine, write


def layouts(world: int, strategies: str | None = None) -> list:
    """The layouts to dry-run at ``world`` ranks, as a GPU runs them (bfloat16, not compiled; duplicates dropped):
    ``strategies`` (text forms, comma-separated; one a dry run cannot follow, or one the world does not fit, is
    refused) or, without it, verify's language-model strategies that a dry run follows."""
    from distlab.errors import ConfigError
    from distlab.parallel.strategy import Strategy
    from distlab.plan.dry_run import unfollowable
    from distlab.tools.verify import default_strategies
    if strategies is not None:
        given = Strategy.parse_list(strategies, world)
        for st in given:
            if unfollowable(st):
                raise ConfigError(f"--strategies {st}: a dry run cannot follow it ({unfollowable(st)})")
    else:
        given = [case.strategy for case in default_strategies(4)
                 if case.model in ("gpt", "llama") and not (case.dpo or case.lora or unfollowable(case.strategy))]
    seen, out = set(), []
    for st in given:
        st = st.replace(compile=False, precision="bf16", bucket_mb=25.0)
        if world % st.model_ways == 0 and str(st) not in seen:
            seen.add(str(st))
            out.append(st)
    return out


def run(presets: list[str], world: int, window: int, local_batch: int, progress=print, out: str | None = None,
        strategies: str | None = None) -> list[dict]:
    from distlab.parallel.strategy import Strategy  # noqa: F401  (the layouts' type)
    from distlab.plan import presets as known
    from distlab.plan.dry_run import dry_run
    from distlab.plan.machine import Link
    from distlab.plan.predict import Layout, predict
    from distlab.plan.trace import trace
    chosen = layouts(world, strategies)
    records = []
    for name in presets:
        family, options, vocab = known.options(name)
        t = trace(family, (window,), vocab, options=options, attention="flash")
        for st in chosen:
            dp = st.dp_size(world)
            lay = Layout(dp=dp, strategy=st, optimizer="adamw", global_batch=local_batch * dp * st.grad_accum)
            p = predict(t, lay, Link(), None)
            rank = world - 1
            m = dry_run(family, options, vocab, (window,), st, world, rank, lay.global_batch, "adamw",
                        attention="flash")
            planned = p["activation_bytes_float32_per_rank"]
            records.append({"preset": name, "strategy": str(st), "world_size": world, "rank": rank, "window": window,
                            "global_batch_size": lay.global_batch, "parameters": t.num_parameters,
                            "planned_model_state_bytes": p["model_state_bytes_per_rank"],
                            "measured_model_state_bytes": m["model_state_bytes"],
                            "state_equal": p["model_state_bytes_per_rank"] == m["model_state_bytes"],
                            "planned_activation_bytes": planned, "measured_activation_bytes": m["activation_bytes"],
                            "activation_rel_err": planned / m["activation_bytes"] - 1 if m["activation_bytes"] else None,
                            "seconds": m["seconds"], **machine(1, 1)})
            r = records[-1]
            progress(f"{name} {r['strategy']}: state {'equal' if r['state_equal'] else 'DIFFERS'} "
                     f"({r['measured_model_state_bytes'] / 2**30:.2f} GiB), activations "
                     f"{r['measured_activation_bytes'] / 2**30:.2f} GiB measured, {r['activation_rel_err']:+.1%} "
                     f"planned ({r['seconds']:.1f} s)")
    write(records, out, "dry-run")
    return records


def table(records: list[dict], markdown: bool = False) -> str:
    rows = [[r["preset"], r["strategy"], str(r["world_size"]), f"{r['measured_model_state_bytes'] / 2**30:.2f}",
             "equal" if r["state_equal"] else f"{r['planned_model_state_bytes'] / 2**30:.2f}",
             f"{r['measured_activation_bytes'] / 2**30:.2f}", f"{r['activation_rel_err']:+.1%}"] for r in records]
    return format_table(["model", "layout", "ranks", "state GiB (measured)", "plan", "activations GiB (measured)",
                         "plan error"], rows, markdown)


def plot(records: list[dict], plot_dir: str) -> list:
    return []
