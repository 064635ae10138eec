"""What a step schedule costs on a model's trace, beside the schedules (``distlab plan`` reads it): the
model cut into ``P`` stages as a run cuts it (one stage without a pipeline), what each stage holds --
its model state, the activations its schedule keeps in flight, the recomputation of checkpointed
blocks -- its share of the FLOPs, the bytes it sends to its neighbours, and the pipeline's report and
messages. Tensor and context parallel shrink a stage's activations as they split them (the
replicated LayerNorm and embedding regions stay whole without sequence parallel).
"""

from __future__ import annotations

import math
from dataclasses import replace

from distlab.errors import ConfigError
from distlab.parallel.cost import Call, CallGroup
from distlab.parallel.pipeline.actions import ideal_bubble, schedule_actions
from distlab.parallel.pipeline.partition import cut
from distlab.runtime.trace_file import SCHEDULE


HEADER = 10  # int64s ahead of every message between stages: dtype code, ndim, up to 8 sizes


def activation_note(lay) -> str:
    """What a stage holds for backward at once, as the schedule keeps it (the plan's activation basis)."""
    if lay.pp == 1:
        return ""
    v = lay.strategy.pp_virtual
    return (f"; a pipeline stage holds {lay.strategy.microbatches} micro-batches (gpipe)"
            if lay.strategy.pp_schedule == "gpipe" else
            f"; rank s holds min(V M, 2 (P - s - 1) + (V - 1) P + 1) chunk-micro-batches of its {v} chunks "
            f"(interleaved)" if v > 1 else
            f"; stage s holds min(M, P - s) micro-batches ({lay.strategy.pp_schedule}"
            + (": a graph kept until its weight pass" if lay.strategy.pp_schedule == "zb" else "") + ")")


def report(lay, stages: list[dict]) -> dict:
    """What the plan says about the pipeline (nothing without one)."""
    if lay.pp == 1:
        return {}
    return {"pipeline": {
        "stages": [{k: v for k, v in st.items() if k != "trace"} for st in stages],
        "microbatches": lay.strategy.microbatches, "schedule": lay.strategy.pp_schedule,
        "virtual": lay.strategy.pp_virtual,
        "bubble_ideal": ideal_bubble(lay.pp, lay.strategy.microbatches, lay.strategy.pp_schedule,
                                     lay.strategy.pp_virtual),
        "p2p_bytes_per_step_per_rank": max(st["sent_bytes_per_step"] for st in stages)}}


def calls(lay, stages: list[dict]) -> list[CallGroup]:
    """A stage's sends and receives, one message each per micro-batch and direction, on the critical
    path (none without a pipeline)."""
    if lay.pp == 1:
        return []
    boundary = max(st["boundary_bytes_per_microbatch"] for st in stages)
    return [CallGroup([Call("native", "send", boundary)] * (2 * lay.strategy.microbatches), 2, dim="pp")]


def timeline(lay, forward_s: float, backward_s: float) -> list[tuple[int, str, str, float, float]]:
    """Every stage's predicted schedule of one step, ``(stage, name, lane, start_s, end_s)``: its
    forwards and backwards per chunk and micro-batch (named as a traced stage names them), each unit of
    :func:`schedule_actions`' simulation lasting ``(forward_s + backward_s) / 3 M V`` -- ``forward_s``
    and ``backward_s`` the pacing stage's compute for the whole step --, its waits for neighbours on
    the pipeline lane and the whole schedule around them."""
    p, v, m = lay.pp, lay.strategy.pp_virtual, lay.strategy.microbatches
    unit = (forward_s + backward_s) / (3 * m * v)
    plan = schedule_actions(lay.strategy.pp_schedule, p, v, m)
    end = max(a[3] + a[4] for acts in plan for a in acts) * unit
    spans = []
    for s, acts in enumerate(plan):
        free = 0.0
        for kind, chunk, mb, start, cost in acts:
            a, b = start * unit, (start + cost) * unit
            if a > free:
                spans.append((s, "wait for a gradient" if kind != "F" else "wait for an activation", "pipeline", free, a))
            where = f"stage {s} chunk {chunk}" if v > 1 else f"stage {s}"
            spans.append((s, f"{where} {kind} mb {mb}", "compute", a, b))
            free = b
        if end > free:
            spans.append((s, "wait for the pipeline to drain", "pipeline", free, end))
        spans.append((s, SCHEDULE, "pipeline", 0.0, end))
    return spans


def _runs(t, a: int, b: int, blocks: list) -> list[tuple[list[int], bool]]:
    """Layers ``a..b-1`` as consecutive runs ``(indices, checkpointed)``: each part of one of the
    ``blocks`` activation checkpointing recomputes a run (as a pipeline stage recomputes them), other layers alone."""
    block_of = {name: k for k, names in enumerate(blocks) for name in names}
    runs: list[tuple[list[int], int | None]] = []
    for i in range(a, b):
        k = block_of.get(t.layers[i].name)
        if runs and k is not None and runs[-1][1] == k:
            runs[-1][0].append(i)
        else:
            runs.append(([i], k))
    return [(run, k is not None) for run, k in runs]


def stages(t, lay, micro: int, optim, sync_cost) -> list[dict]:
    """Per pipeline stage (one stage: the whole model): its trace, model state (as ``sync_cost``, the
    gradient sync's cost model, holds it), activations held, share of the FLOPs and bytes it sends per
    micro-batch. Cut as the training run cuts (:func:`~distlab.parallel.pipeline.partition.cut`, by
    parameters or ``pp_balance``)."""
    if lay.pp > 1 and not t.layers:
        raise ConfigError("`pp`: this model is not a sequence of layers a pipeline can cut; plan it with `pp` 1")
    layers = t.layers or []
    v = lay.strategy.pp_virtual if lay.pp > 1 else 1
    cuts = cut([layer.parameters for layer in layers], lay.pp * v, lay.strategy.pp_balance) if lay.pp > 1 else \
        [(0, len(layers))]
    total_flops = sum(layer.forward_flops for layer in layers) or 1.0
    sp, out, m_total = lay.strategy.sequence_parallel, [], lay.strategy.microbatches
    for s in range(lay.pp):
        chunks = [cuts[c * lay.pp + s] for c in range(v)]  # rank s holds virtual stages s, s + P, ...
        mine = [layer for a, b in chunks for layer in layers[a:b]]
        sub = t.stage([layer.name for layer in mine]) if lay.pp > 1 else t
        if lay.tp > 1:  # the units the model's tensor plan shards (every unit where the trace has no plan)
            key = t.tensor_key(lay.strategy, lay.tp)
            if (tp := ("tp", lay.tp, *key)) not in sub.memo:
                split, plan = t.tensor_split.get(key), t.tensor_plans.get(key, {})
                sharded = [split is None or name in split for name in sub.names]
                style = [plan.get(name.rsplit(".", 1)[0]) for name in sub.names]
                sub.memo[tp] = replace(sub, numels=[tp_share(m, shape, lay.tp, kind) if c else m for m, shape, kind, c
                                                    in zip(sub.numels, sub.shapes or [()] * len(sub.numels), style,
                                                           sharded)],
                                       splits={u: (1 if style[u] == "rowwise" else 0, lay.tp) for u, kind in
                                               enumerate(sub.base) if kind == "nf4" and sharded[u]})  # (4-bit parts)
            sub = sub.memo[tp]
        if lay.ep > 1 and sub.expert_names:  # each rank's 1 / ep of every expert tensor (split along experts)
            if (ep := ("ep", lay.ep)) not in sub.memo:
                experts = set(sub.expert_names)
                sub.memo[ep] = replace(sub, numels=[m // lay.ep if name in experts else m
                                                    for name, m in zip(sub.names, sub.numels)])
            sub = sub.memo[ep]
        state = sync_cost.planned_memory(sub, optim, lay.strategy, lay.replicas)
        recompute = recompute_flops = 0.0
        if mine and lay.strategy.activation_checkpointing:
            saved = replicated = 0.0
            for a, b in chunks:
                for run, checkpointed in _runs(t, a, b, lay.strategy.checkpointed(t.blocks)):
                    if checkpointed:  # the block's input kept (replicated over TP unless sequence parallel)
                        kept = layers[run[0] - 1].output_bytes if run[0] else t.input_bytes_per_sample
                        saved, replicated = saved + kept, replicated + (0.0 if sp else kept)
                        inside = sum(layers[i].saved_bytes for i in run)  # while recomputed, one at a time
                        rep = 0.0 if sp else sum(layers[i].replicated_saved_bytes for i in run)
                        recompute = max(recompute, ((inside - rep) / lay.tp + rep) / lay.cp * micro)
                        if lay.strategy.ac_policy == "ops":  # attention's and every other matmul's outputs kept
                            saved += sum(layers[i].ops_kept_bytes for i in run)
                            recompute_flops += sum(layers[i].ops_recompute_flops for i in run)
                        else:
                            recompute_flops += sum(layers[i].forward_flops for i in run)
                    else:
                        saved += sum(layers[i].saved_bytes for i in run)
                        replicated += 0.0 if sp else sum(layers[i].replicated_saved_bytes for i in run)
        elif mine:
            saved = sum(layer.saved_bytes for layer in mine)
            replicated = 0.0 if sp else sum(layer.replicated_saved_bytes for layer in mine)
        else:  # a model without a layer profile: the whole-model estimate
            saved, replicated = t.activation_bytes_per_sample, 0.0
        per_sample = ((saved - replicated) / lay.tp + replicated) / lay.cp
        if lay.pp == 1:
            held = 1.0
        elif lay.strategy.pp_schedule == "gpipe":
            held = m_total
        elif v > 1:  # Megatron's warm-up chunks in flight, each a V-th of the rank's layers
            held = min(m_total * v, (lay.pp - s - 1) * 2 + (v - 1) * lay.pp + 1) / v
        else:
            held = min(m_total, lay.pp - s)
        boundary = before = 0.0
        headed = 0  # activations sent per micro-batch, each after its header (a gradient's shape is known)
        inside = t.tensor_open.get(t.tensor_key(lay.strategy, lay.tp), set()) if lay.tp > 1 else set()

        def crossing(layer) -> float:  # what leaves a layer for the next stage: this rank's share of it
            split = lay.tp if sp or layer.name in inside else 1  # sequence-split, or inside a column-parallel region
            return layer.output_bytes * micro / split / lay.cp

        for k, (a, b) in ((c * lay.pp + s, chunks[c]) for c in range(v)):
            if k < len(cuts) - 1 and b > a:
                boundary += crossing(layers[b - 1])
                headed += 1
            if a > 0:
                before += crossing(layers[a - 1])
        out.append({"stage": s, "layers": [chunks[0][0], chunks[-1][1]], "first": mine[0].name if mine else None,
                    "last": mine[-1].name if mine else None, "parameters": sum(sub.numels),
                    **({"chunks": [list(c) for c in chunks]} if v > 1 else {}),
                    "model_state_bytes": int(state), "activation_bytes": int(per_sample * micro * held),
                    "micro_batches_held": held,
                    "flops_share": sum(layer.forward_flops for layer in mine) / total_flops if lay.pp > 1 else 1.0,
                    "recompute_flops_share": recompute_flops / total_flops, "recompute_bytes": int(recompute),
                    "boundary_bytes_per_microbatch": int(boundary),
                    "sent_bytes_per_step": int((boundary + before + 8 * HEADER * headed) * m_total),
                    "trace": sub})
    return out


VOCABULARY_STYLES = ("vocab_embedding", "vocab_output")  # split by rows as torch.chunk cuts them, unevenly if need be


def tp_share(numel: int, shape: tuple[int, ...], tp: int, style: str | None) -> int:
    """The elements of a tensor-parallel rank's part of a unit (the most any rank holds): a vocabulary's
    ``ceil(V / tp)`` rows (:func:`distlab.parallel.tensor_parallel.vocabulary.vocab_rows`: the first rank's,
    where ``tp`` does not divide ``V``), any other split unit ``numel / tp``."""
    if style in VOCABULARY_STYLES and shape:
        return math.ceil(shape[0] / tp) * math.prod(shape[1:])
    return math.ceil(numel / tp)

