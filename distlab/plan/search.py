"""``distlab plan --search``: every layout of a GPU cluster, predicted, the ones that fit ranked by tokens/s per GPU.

:func:`candidates` enumerates the strategies a cluster of ``gpus`` GPUs can run a model with -- tensor parallel
inside a node (a divisor of its GPUs), pipeline stages (each at most the model's layers, with 1F1B over
``2 pp`` and ``4 pp`` micro-batches, interleaved with two chunks per rank, and zero bubble), context
parallel (a divisor of the window that leaves each rank whole chunks), expert parallel for a mixture of
experts, ZeRO stages 1-3 (ZeRO-1 where a pipeline runs: a stage's shards are its own; each over every replica or,
where the replicas span nodes, hybrid over a node's of them), activation
checkpointing (none, every block, one block in two, per op: :data:`AC_MODES`) and the memory levers (bf16 moments,
the optimizer's state offloaded, under ZeRO-3 the shards too, either's step beside the next forward where the
layout allows: :data:`LEVERS`) -- data parallel taking what is left;
each is checked as a run checks it
(:meth:`~distlab.parallel.Strategy.check`, the batch's split), so what the search proposes a run accepts.
:func:`search` predicts each on the cluster (:func:`~distlab.plan.predict.predict`), keeps those whose peak
fits the GPU's memory, ranks them by tokens/s per GPU and says why the best wins (:func:`why`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.plan.machine import Link
from distlab.plan.predict import Layout, predict

MAX_TP = 8  # tensor parallel stays inside a node of 8 (beyond it every layer's collectives cross the network)
# activation checkpointing: none, every block, one block in two (selective per layer), per op (selective per op)
AC_MODES = ((False, 1, "block"), (True, 1, "block"), (True, 2, "block"), (True, 1, "ops"))


def _divisors(n: int, most: int) -> list[int]:
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


SEARCHED = ("tp", "pp", "cp", "ep", "zero", "dp_shard", "activation_checkpointing", "ac_every", "ac_policy",
            "sequence_parallel", "microbatches", "pp_schedule", "pp_virtual")  # the strategy's fields a search chooses
# the memory levers beside the strategy: (optimizer state dtype, offload, its step overlapped) -- bf16 moments for
# Adam's family, the optimizer's state off the device, under ZeRO-3 the shards too, each offload's step beside the
# next forward where the layout allows (distlab.parallel.offload, step_ahead)
LEVERS = (("fp32", "none", False), ("bf16", "none", False), ("fp32", "optimizer", False), ("fp32", "optimizer", True),
          ("fp32", "params", False), ("fp32", "params", True))
LEVER_FIELDS = ("optimizer_state", "offload", "offload_overlap")


def _levers(lay: Layout, fixed: dict) -> Iterator[Layout]:
    """``lay`` with each memory lever that applies to it (and keeps what ``fixed`` holds)."""
    for state, off, overlap in LEVERS:
        if (off == "params" and lay.zero != 3) or (state != "fp32" and lay.optimizer == "sgd") or \
                (overlap and (lay.zero in (1, 2) or lay.optimizer == "muon")):
            continue
        if any(fixed.get(k, v) != v for k, v in zip(LEVER_FIELDS, (state, off, overlap))):
            continue
        yield replace(lay, optimizer_state=state, offload=off, offload_overlap=overlap)


def label(lay: Layout) -> str:
    """A searched layout in the strategy's text form, its memory levers after it (``+state=bf16``,
    ``+offload=params``, ``+overlap``: the offloaded step beside the next forward)."""
    return str(lay.strategy) + (f"+state={lay.optimizer_state}" if lay.optimizer_state != "fp32" else "") + \
        (f"+offload={lay.offload}" if lay.offload != "none" else "") + ("+overlap" if lay.offload_overlap else "")


def _shard_groups(zero: int, replicas: int, local: int) -> list[int]:
    """ZeRO over every replica (0), and -- where the replicas span nodes -- hybrid sharding over a node's
    ``local`` of them (its gathers on NVLink, the reduced shard alone crossing the network)."""
    return [0] + ([local] if zero and 1 < local < replicas and replicas % local == 0 else [])


def candidates(t, base: Layout, gpus: int, gpus_per_node: int, experts: int = 0,
               fixed: dict | None = None) -> Iterator[Layout]:
    """Every valid layout of ``gpus`` GPUs for trace ``t`` with ``base``'s batch, optimizer and precision; ``fixed``:
    the fields of :data:`SEARCHED` a layout must keep (those the user gave)."""
    layers = len(t.layers) - 2 if t.layers else 1  # a decoder's blocks (its embedding and head are layers too)
    window = t.tokens_per_sample
    seen = set()
    for tp in _divisors(gpus, min(MAX_TP, gpus_per_node)):
        for pp in [p for p in (1, 2, 4, 8, 16, 32) if gpus % (tp * p) == 0 and p <= max(1, layers)]:
            for cp in [c for c in (1, 2, 4, 8) if gpus % (tp * pp * c) == 0 and (c == 1 or window % (2 * c) == 0)]:
                dp = gpus // (tp * pp * cp)
                for ep in ([e for e in _divisors(dp, experts) if experts % e == 0] if experts else [1]):
                    # (under a pipeline ZeRO-3's memory is not exact, nor ZeRO-2's with experts: predict's estimate)
                    for zero in ((1,) if experts else (1, 2)) if pp > 1 else (1, 2, 3):
                        local = gpus_per_node // tp  # a node's replicas (tensor parallel inside it)
                        for ckpt, every, policy, shard in ((*mode, s) for mode in AC_MODES
                                                           for s in _shard_groups(zero, dp * cp, local)):
                            for sched in (_schedules(pp, base.global_batch // dp) if pp > 1 else [{}]):
                                try:
                                    st = replace(base.strategy, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, dp_shard=shard,
                                                 activation_checkpointing=ckpt, ac_every=every, ac_policy=policy,
                                                 sequence_parallel=tp > 1,
                                                 **{"dp_sync": None, "collective": None, "microbatches": None,
                                                    "pp_schedule": "1f1b", "pp_virtual": 1, **sched})
                                    lay = replace(base, dp=dp, strategy=st).check()
                                except (ConfigError, ValueError, TypeError):
                                    continue
                                if any(getattr(st, k) != v for k, v in (fixed or {}).items() if k in SEARCHED):
                                    continue
                                if str(st) not in seen:
                                    seen.add(str(st))
                                    yield from _levers(lay, fixed or {})


def _schedules(pp: int, local: int) -> list[dict]:
    """A pipeline's schedules worth trying with ``local`` samples per data-parallel rank."""
    out = []
    for m in (2 * pp, 4 * pp):
        if local and local % m == 0:
            out.append(dict(pp_schedule="1f1b", microbatches=m))
            out.append(dict(pp_schedule="1f1b", microbatches=m, pp_virtual=2))
            out.append(dict(pp_schedule="zb", microbatches=m))
    return out or ([dict(pp_schedule="1f1b", microbatches=local)] if local >= pp else [])


def search(t, base: Layout, cluster, top: int = 10, experts: int = 0, fixed: dict | None = None) -> dict:
    """The cluster's layouts predicted (keeping ``fixed``, :func:`candidates`): ``ranked`` (those that fit, fastest
    first, at most ``top``), ``tried``/``fit`` counts, and ``why``: what makes the first beat the others."""
    rows, tried = [], 0
    limit = cluster.machine.memory_bytes
    import sys

    from tqdm import tqdm
    layouts = list(candidates(t, base, cluster.gpus, cluster.machine.gpus_per_node, experts, fixed))
    for lay in tqdm(layouts, desc="layouts", unit="layout", disable=not sys.stderr.isatty(), leave=False):
        tried += 1
        try:
            p = predict(t, lay, Link(), None, cluster)
        except ConfigError:
            continue
        p["strategy_text"] = label(lay)
        p["fits"] = p["memory_bytes_per_rank"] <= limit
        rows.append(p)
    fit = sorted((p for p in rows if p["fits"]), key=lambda p: -p["tokens_per_s_per_gpu"])
    out = {"kind": "distlab-plan-search", "cluster": cluster.describe(), "gpus": cluster.gpus, "tried": tried,
           "predicted": len(rows), "fit": len(fit), "ranked": fit[:top], "fixed": dict(fixed or {})}
    if not fit:
        least = min(rows, key=lambda p: p["memory_bytes_per_rank"]) if rows else None
        out["why"] = ("no layout fits: " + (f"the smallest peak, {least['memory_bytes_per_rank'] / 2**30:.1f} GiB "
                                            f"({least['strategy_text']}), is above the GPU's "
                                            f"{limit / 2**30:.1f} GiB; use more GPUs or a shorter window"
                                            if least else "no valid layout of this many GPUs"
                                            + (f" that keeps {kept(fixed)}" if fixed else "")))
    else:
        out["why"] = why(fit)
        over = [p for p in rows if not p["fits"] and p["tokens_per_s_per_gpu"] > fit[0]["tokens_per_s_per_gpu"]]
        if over:  # faster on paper, but its peak is above the GPU's memory
            q = max(over, key=lambda p: p["tokens_per_s_per_gpu"])
            out["why"] += (f"\n  {q['strategy_text']} would run {q['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU but "
                           f"needs {q['memory_bytes_per_rank'] / 2**30:.1f} GiB per GPU, above the "
                           f"{limit / 2**30:.1f} GiB it has")
    return out


def kept(fixed: dict) -> str:
    """``tp=2 zero=1``: the dimensions a search was told to keep, as the strategy's text writes them."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fixed.items())


def step_parts(p: dict) -> dict:
    """Where a predicted step's time goes: the compute itself, what recomputation adds, the pipeline's bubble,
    exposed communication."""
    bubble = p.get("pipeline", {}).get("bubble_ideal", 0.0)
    recompute = p.get("activation_checkpointing", {}).get("recompute_flops_share", 0.0)
    compute = p["compute_s"]
    return {"bubble_s": compute * bubble, "recompute_s": compute * (1 - bubble) * recompute / (3 + recompute),
            "exposed_s": p["exposed_comm_s"]}


def why(fit: list[dict]) -> str:
    """Why the first layout wins: against the runner-up and the best of each other shape, the time it saves
    in the bubble, in recomputation and in exposed communication, and what each spends memory on."""
    best, lines = fit[0], []
    b = step_parts(best)
    lines.append(f"{best['strategy_text']} predicts {best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
                 f"(MFU {best['mfu']:.1%}) at {best['memory_bytes_per_rank'] / 2**30:.1f} GiB per GPU: of its "
                 f"{best['step_s']:.3g} s step, {b['exposed_s']:.3g} s is exposed communication, {b['bubble_s']:.3g} s "
                 f"pipeline bubble, {b['recompute_s']:.3g} s recomputation")
    shown = set()
    for p in fit[1:]:
        shape = _shape(p)
        if shape in shown or shape == _shape(best):
            continue
        shown.add(shape)
        o = step_parts(p)
        costs = [(o[k] - b[k], k) for k in ("exposed_s", "bubble_s", "recompute_s")]
        delta, what = max(costs)
        names = {"exposed_s": "exposed communication", "bubble_s": "pipeline bubble", "recompute_s": "recomputation"}
        lines.append(f"  vs {p['strategy_text']} ({p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                     f"{p['memory_bytes_per_rank'] / 2**30:.1f} GiB): that one spends {delta:+.3g} s more per step "
                     f"on {names[what]}" if delta > 0 else
                     f"  vs {p['strategy_text']} ({p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU): "
                     f"{p['step_s'] - best['step_s']:+.3g} s per step")
        if len(shown) >= 4:
            break
    return "\n".join(lines)


def _shape(p: dict) -> tuple:
    lay = p["layout"]
    return (lay["tp"] > 1, lay["pp"] > 1, lay["cp"] > 1, lay["zero"], bool(lay.get("dp_shard")), lay.get("offload"),
            lay.get("offload_overlap"), lay.get("optimizer_state"))
