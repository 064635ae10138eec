"""Tables of :mod:`distlab.plan`'s predictions, sweeps and validations."""

from __future__ import annotations


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.3g} GiB" if b >= 2**30 else f"{b / 2**20:.3g} MiB"


def _ms(s) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s" if s < 600 else f"{s / 3600:.3g} h"


def format_prediction(p: dict) -> str:
    lay = p["layout"]
    mesh = f"dp {lay['dp']}" + (f" (ep {lay['ep']})" if lay.get("ep", 1) > 1 else "") + f" x tp {lay['tp']}" \
        + (f" x cp {lay['cp']}" if lay.get("cp", 1) > 1 else "") \
        + (f" x pp {lay['pp']}" if lay.get("pp", 1) > 1 else "")
    hybrid = f" over shard groups of {lay['dp_shard']}" if lay.get("dp_shard") else ""  # (HSDP: replicated across)
    lines = [f"layout        {mesh} = {lay['world_size']} ranks, zero {lay['zero']}{hybrid}, "
             f"{lay['dp_sync']}/{lay['collective']}, global batch {lay['global_batch_size']}, "
             f"grad accum {lay['grad_accum']}, {lay['optimizer']}"
             + (", sequence parallel" if lay.get("sequence_parallel") else ""),
             _where(p),
             f"parameters    {p['num_parameters']:,}" + (f" ({p['trained_parameters']:,} trained: the rest frozen)"
                                                         if "trained_parameters" in p else ""),
             f"at rest       parameters {_gib(p['parameter_bytes_per_rank'])}, gradients "
             f"{_gib(p['gradient_bytes_per_rank'])}, optimizer state {_gib(p['optimizer_bytes_per_rank'])} per rank",
             f"model state   {_gib(p['model_state_bytes_per_rank'])} per rank "
             f"({'exact: what distlab will measure' if p['model_state_exact'] else 'estimate'}; "
             f"{p['model_state_bytes_per_rank']:,} bytes: parameters + gradients + optimizer state at their peak)",
             f"activations   {_gib(p['activation_bytes_per_rank'])} per rank (estimate: {p['activation_basis']})",
             f"memory        {_gib(p['memory_bytes_per_rank'])} per rank" + _fits(p),
             f"loading       {_gib(p['load_peak_bytes_per_rank'])} per rank at most, before the first step "
             f"(its parameters as placed + the largest tensor whole, made or read, then cut)",
             f"sends         {p['comm_bytes_per_step_per_rank']:,} bytes per step from rank 0 ("
             + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in p["comm_bytes_by"].items() if v) + ")"]
    if p.get("offload"):
        o = p["offload"]
        lines.append(f"offloaded     {_gib(o['bytes_per_rank'])} per rank off the device ({o['mode']}: state "
                     f"{_gib(o['state_bytes_per_rank'])}, parameter shards {_gib(o['shard_bytes_per_rank'])}, "
                     f"gradient shards {_gib(o['gradient_bytes_per_rank'])}); {_gib(o['moved_bytes_per_step'])} moved "
                     f"a step" + (f", {o['seconds_per_step'] * 1e3:,.0f} ms over the host link (in the step"
                                  + (f"; {o['hidden_s'] * 1e3:,.0f} ms of it behind the next forward" if o["hidden_s"]
                                     else "") + ")" if "seconds_per_step" in o else ""))
    if p.get("activation_checkpointing"):
        a = p["activation_checkpointing"]
        lines.append(f"recompute     {a['blocks']} checkpointed blocks: {_gib(a['recompute_bytes_per_rank'])} per rank more "
                     f"while one is recomputed in backward (in memory), {a['recompute_flops_share']:.0%} of the forward "
                     f"FLOPs run again")
    if p.get("context_parallel"):
        c = p["context_parallel"]
        lines.append(f"context       cp {c['cp']} ({c['style']}): each rank holds 1/{c['cp']} of every sequence, sends "
                     f"{_gib(c['bytes_per_step_per_rank'])} per step in attention ({c['bytes_basis']}); "
                     f"{c['attention_balance']}")
    if p.get("rollout"):
        lines.extend(_rollout(p["rollout"]))
    if p.get("expert_parallel"):
        x = p["expert_parallel"]
        lines.append(f"experts       ep {x['ep']}: each rank holds 1/{x['ep']} of the experts ({x['memory_basis']}), sends "
                     f"{_gib(x['bytes_per_step_per_rank'])} per step in all-to-alls ({x['bytes_basis']})")
    if p.get("pipeline"):
        pl = p["pipeline"]
        virtual = pl.get("virtual", 1)
        formula = ("(P-1)/(M+P-1)" if pl["schedule"] in ("gpipe", "1f1b") and virtual == 1 else
                   "(P-1)/(VM+P-1)" if pl["schedule"] == "1f1b" else "its unit-cost schedule's")
        chunks = f", {virtual} chunks per rank" if virtual > 1 else ""
        lines.append(f"pipeline      {len(pl['stages'])} stages, {pl['schedule']}{chunks}, {pl['microbatches']} "
                     f"micro-batches: bubble {formula} = {pl['bubble_ideal']:.2f}; sends "
                     f"{_gib(pl['p2p_bytes_per_step_per_rank'])} per step between stages (the busiest rank)")
        for st in pl["stages"]:
            where = (", ".join(f"{a}-{b - 1}" for a, b in st["chunks"]) if st.get("chunks") else
                     f"{st['layers'][0]}-{st['layers'][1] - 1}")
            lines.append(f"  stage {st['stage']}     layers {where} ({st['first']} .. "
                         f"{st['last']}), {st['parameters']:,} parameters per rank: model state "
                         f"{_gib(st['model_state_bytes'])}, activations {_gib(st['activation_bytes'])}, "
                         f"{st['flops_share']:.0%} of the FLOPs")
    if "step_s" in p:
        lines += [f"compute       {_ms(p['compute_s'])} per step ({p['compute_basis']}"
                  + (f", {p['oversubscription']:.2g}x oversubscribed" if p["oversubscription"] > 1 else "") + ")",
                  f"communication {_ms(p['comm_s'])} per step, {_ms(p['exposed_comm_s'])} of it exposed"
                  + "".join(f"; {name} {_ms(c['seconds'])}, {_ms(c['seconds'] - c['exposed_s'])} of it beside the compute"
                            for name, c in p.get("component_comm", {}).items() if c["exposed_s"] < c["seconds"]),
                  f"step          {_ms(p['step_s'])}: {p['samples_per_s']:,.0f} samples/s"
                  + (f", {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU" if "tokens_per_s_per_gpu" in p else "")
                  + (f", MFU {p['mfu']:.1%}" if "mfu" in p else "")
                  + f", scaling efficiency {p['scaling_efficiency']:.2f}"]
    else:
        lines.append("time          no calibration given: memory only (`distlab plan calibrate` makes one)")
    lines += [f"warning       {w}" for w in p.get("warnings", [])]
    return "\n".join(lines)


def _where(p: dict) -> str:
    """The machine line: a GPU cluster's, or the link's."""
    c = p.get("cluster")
    if c:
        return (f"machine       {c['nodes']} x {c['machine']} ({c['gpus']} GPUs, {c['gpus_per_node']} per node): "
                f"{c['description']}")
    return f"link          {p['link']['name']}" + (f", latency {p['link']['latency_s'] * 1e6:.3g} us"
                                                  if p['link']['latency_s'] else "")


def _rollout(r: dict) -> list[str]:
    """A GRPO step's rollout (:mod:`distlab.plan.rollout`): what it does, holds and, on a GPU cluster, takes."""
    lines = [f"GRPO          {r['rows_per_step']:,} completions a step, the update training each as a window; the "
             f"rollout before it: {r['basis']}",
             f"rollout       {r['decode_steps_per_rank']:,} decoding steps a rank reading "
             f"{_gib(r['decode_bytes_per_rank'])}, {r['generated_tokens_per_rank']:,} tokens generated; holds "
             f"{_gib(r['memory_bytes_per_rank'])} more ({r['memory_basis']}): {_gib(r['peak_bytes_per_rank'])} at its "
             f"peak (in memory)"]
    if "seconds" in r:
        lines.append(f"rollout time  {_ms(r['seconds'])} (gather {_ms(r['gather_s'])}, prefill {_ms(r['prefill_s'])}, "
                     f"decode {_ms(r['decode_s'])} at {_ms(r['decode_step_s'])} a step, scoring {_ms(r['scoring_s'])}; "
                     f"{r['time_basis']}): {r['why']}, {_ms(r['step_s'])} a GRPO step")
    return lines


def _fits(p: dict) -> str:
    limit = p.get("device_memory_bytes")
    if limit is None:
        return ""
    return f" of {_gib(limit)}: " + ("fits" if p["memory_bytes_per_rank"] <= limit else "DOES NOT FIT")


def _strategy_name(s: dict) -> str:
    """The strategy's text form (``zero=3``, ``bucketed:ring``)."""
    from distlab.parallel import Strategy
    return str(Strategy.from_dict(s))


def format_sweep(rows: list[dict], min_efficiency: float = 0.5) -> str:
    timed = "step_s" in rows[0]
    w = max(8, *(len(_strategy_name(r["strategy"])) for r in rows))
    head = f"{'strategy':<{w}} {'ranks':>6} {'memory/rank':>12} {'fits':>4}" + (
        f" {'step':>10} {'samples/s':>12} {'eff':>5}" if timed else "")
    lines = [head]
    verdicts = []
    for name in dict.fromkeys(_strategy_name(r["strategy"]) for r in rows):
        mine = [r for r in rows if _strategy_name(r["strategy"]) == name]
        for r in mine:
            line = f"{name:<{w}} {r['layout']['world_size']:>6} {_gib(r['memory_bytes_per_rank']):>12} " \
                   f"{'yes' if r['fits'] else 'NO':>4}"
            if timed:
                line += f" {_ms(r['step_s']):>10} {r['samples_per_s']:>12,.0f} {r['scaling_efficiency']:>5.2f}"
            lines.append(line)
        fit = [r["layout"]["world_size"] for r in mine if r["fits"]]
        no_fit = [r["layout"]["world_size"] for r in mine if not r["fits"]]
        words = []
        if not fit:
            words.append("never fits in memory")
        elif no_fit:
            words.append(f"fits from {min(fit)} ranks" if min(no_fit) < min(fit) else f"stops fitting at {min(no_fit)} ranks")
        else:
            words.append("fits at every size")
        if timed:
            low = [r["layout"]["world_size"] for r in mine if r["scaling_efficiency"] < min_efficiency]
            words.append(f"stops scaling (efficiency < {min_efficiency:.2g}) at {min(low)} ranks" if low
                         else f"scales (efficiency >= {min_efficiency:.2g}) to {max(r['layout']['world_size'] for r in mine)}")
        verdicts.append(f"{name}: " + "; ".join(words))
    return "\n".join(lines + [""] + verdicts)


def format_validation(rows: list[dict], summaries: dict[str, dict]) -> str:
    lines = [f"{'run':<34} {'N':>2} {'link':<8} {'measured':>10} {'predicted':>10} {'error':>7} {'state bytes':>13} "
             f"{'predicted':>13}"]
    for r in rows:
        mem = "" if r["measured_model_state_bytes"] is None else \
            f" {r['measured_model_state_bytes']:>13,} {r['predicted_model_state_bytes']:>13,}"
        lines.append(f"{r['run'][:34]:<34} {r['world_size']:>2} {r['link']:<8} {_ms(r['measured_step_s']):>10} "
                     f"{_ms(r['predicted_step_s']):>10} {r['time_rel_err']:>+7.1%}{mem}")
    traced = [r for r in rows if "measured_compute_s" in r]
    if traced:  # runs with a --trace: the step's phases, measured against predicted
        lines += ["", f"{'traced run, per step':<34} {'compute':>10} {'predicted':>10} {'exposed comm':>13} "
                      f"{'predicted':>10} {'bubble':>7} {'predicted':>9}"]
        for r in traced:
            bubble = "" if r.get("measured_bubble") is None else \
                f" {r['measured_bubble']:>7.1%} {r['predicted_bubble']:>9.1%}"
            lines.append(f"{r['run'][:34]:<34} {_ms(r['measured_compute_s']):>10} {_ms(r['predicted_compute_s']):>10} "
                         f"{_ms(r['measured_exposed_comm_s']):>13} {_ms(r['predicted_exposed_comm_s']):>10}{bubble}")
    for kind, summary in summaries.items():
        what = "step time" if kind == "training" else "collective time"
        line = (f"{what}: median |error| {summary['median_abs_time_err']:.1%}, max {summary['max_abs_time_err']:.1%} "
                f"over {summary['runs']} {'runs' if kind == 'training' else 'collectives'}")
        if summary["memory_checked_runs"]:
            line += f"; memory: {summary['memory_exact_runs']} of {summary['memory_checked_runs']} exact"
        if summary.get("bytes_checked_runs"):
            line += f"; bytes sent: {summary['bytes_exact_runs']} of {summary['bytes_checked_runs']} exact"
        lines.append(line)
    return "\n".join(lines)


def format_search(r: dict) -> str:
    """``plan --search``'s table: the layouts that fit, fastest first, and why the first wins."""
    c = r["cluster"]
    from distlab.plan.search import kept
    nodes = f"{c['nodes']} node{'s' if c['nodes'] != 1 else ''}"
    keeping = f", {kept(r['fixed'])} kept" if r.get("fixed") else ""
    w = max([44] + [len(p["strategy_text"]) for p in r["ranked"]])  # the longest layout, whole
    lines = [f"search        {r['gpus']} x {c['machine']} ({nodes}){keeping}: {r['tried']} layouts tried, "
             f"{r['fit']} fit in its {c['memory_gib']:g} GiB",
             f"{'#':>2} {'layout':<{w}} {'tokens/s/GPU':>12} {'MFU':>6} {'memory':>10} {'bubble':>7} "
             f"{'exposed comm':>12} {'step':>9}"]
    for i, p in enumerate(r["ranked"], 1):
        bubble = p.get("pipeline", {}).get("bubble_ideal", 0.0)
        lines.append(f"{i:>2} {p['strategy_text']:<{w}} {p['tokens_per_s_per_gpu']:>12,.0f} {p['mfu']:>6.1%} "
                     f"{_gib(p['memory_bytes_per_rank']):>10} {bubble:>7.2f} {_ms(p['exposed_comm_s']):>12} "
                     f"{_ms(p['step_s']):>9}")
    lines += ["", "why           " + r["why"].replace("\n", "\n              ")]
    return "\n".join(lines)
