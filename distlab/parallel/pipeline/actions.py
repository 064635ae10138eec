"""A pipeline step as an explicit list of actions per rank (:func:`schedule_actions`: GPipe, 1F1B,
interleaved 1F1B, zero bubble), the checks of interleaving, and each schedule's ideal bubble: a list
scheduler plays the step on every rank with unit costs (the package docstring says how)."""

from __future__ import annotations

import functools

from distlab.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "zb")


@functools.lru_cache(maxsize=256)
def ideal_bubble(stages: int, microbatches: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """The share of a step each stage idles while the pipeline fills and drains, with equal stages:
    ``(P - 1) / (M + P - 1)`` for GPipe and 1F1B; for the action-list schedules (interleaved, zero
    bubble) the idle share of the unit-cost simulation :func:`schedule_actions` plays, mean over ranks."""
    if virtual == 1 and schedule in ("gpipe", "1f1b"):
        return (stages - 1) / (microbatches + stages - 1)
    plan = schedule_actions(schedule, stages, virtual, microbatches)
    span = max(a[3] + a[4] for acts in plan for a in acts)
    busy = [sum(a[4] for a in acts) for acts in plan]
    return sum(1 - b / span for b in busy) / stages


@functools.lru_cache(maxsize=256)
def schedule_actions(schedule: str, stages: int, virtual: int, microbatches: int) -> tuple[tuple[tuple, ...], ...]:
    """Every rank's actions for one step, in order: ``(kind, chunk, microbatch, start, cost)`` with
    kind ``F`` (forward), ``B`` (backward; under ``zb`` only the input's gradient) or ``W`` (``zb``:
    the weights' gradients). Virtual stage ``k = chunk x P + rank`` (module docstring). GPipe: every
    forward first (no limit on what a stage holds), then every backward. Immutable and remembered: a
    planner's search asks for the same few schedules hundreds of times."""
    return tuple(tuple(acts) for acts in _simulated(schedule, stages, virtual, microbatches))


def _simulated(schedule: str, stages: int, virtual: int, microbatches: int) -> list[list[tuple]]:
    P, V, M = stages, virtual, microbatches
    K, split, gpipe = P * V, schedule == "zb", schedule == "gpipe"
    cost = {"F": 1, "B": 1 if split else 2, "W": 1}
    if not split and V > 1:
        return _timed(_megatron_interleaved(P, V, M), P, cost)
    end: dict[tuple, int] = {}  # (kind, k, m) -> when it finishes
    started: set[tuple] = set()
    plan: list[list[tuple]] = [[] for _ in range(P)]
    free = [0] * P
    limit = [M if gpipe else min(M * V, (P - r - 1) * 2 + (V - 1) * P + 1) if V > 1 else P - r for r in range(P)]
    held = [0] * P  # micro-batch chunks forwarded and not yet backward (the 1F1B memory limit)
    waiting_w: list[list[tuple]] = [[] for _ in range(P)]
    total, t = M * K * (3 if split else 2), 0

    def done(key) -> bool:
        return key in end and end[key] <= t

    while len(started) < total:
        for r in range(P):
            if free[r] > t:
                continue
            ks = [c * P + r for c in range(V)]
            pick = None
            ready_b = [("B", k, m) for k in ks for m in range(M) if ("B", k, m) not in started
                       and done(("F", k, m)) and (k == K - 1 or done(("B", k + 1, m)))
                       and (m == 0 or ("B", k, m - 1) in started)]
            ready_f = [("F", k, m) for k in ks for m in range(M) if ("F", k, m) not in started
                       and (k == 0 or done(("F", k - 1, m))) and (m == 0 or ("F", k, m - 1) in started)] \
                if held[r] < limit[r] else []
            forwards_left = gpipe and any(("F", k, m) not in started for k in ks for m in range(M))
            if ready_b and not forwards_left:
                pick = min(ready_b, key=lambda a: (a[2], -a[1]))
            elif ready_f:
                pick = min(ready_f, key=lambda a: (a[2] // P, a[1], a[2]))
            if pick is None and waiting_w[r]:
                pick = waiting_w[r].pop(0)
            if pick is None:
                continue
            kind, k, m = pick
            started.add(pick)
            end[pick] = t + cost[kind]
            free[r] = end[pick]
            held[r] += {"F": 1, "B": 0 if split else -1, "W": -1}[kind]  # zb: the graph is held until W
            if kind == "B" and split:
                waiting_w[r].append(("W", k, m))
            plan[r].append((kind, k // P, m, t, cost[kind]))
        t += 1
    return plan


def _megatron_interleaved(P: int, V: int, M: int) -> list[list[tuple]]:
    """Megatron-LM's interleaved 1F1B order per rank (``M`` a multiple of ``P``): forwards in groups of
    ``P`` micro-batches per chunk, chunk 0 first; backwards the same with the chunks reversed;
    ``(P - r - 1) 2 + (V - 1) P`` warm-up forwards, then one forward one backward, then the rest."""
    total = M * V

    def unit(i: int, backward: bool) -> tuple[int, int]:
        chunk = (i // P) % V
        return (V - 1 - chunk if backward else chunk), (i // (P * V)) * P + i % P

    orders = []
    for r in range(P):
        warm = min((P - r - 1) * 2 + (V - 1) * P, total)
        acts = [("F", *unit(i, False)) for i in range(warm)]
        for i in range(total - warm):
            acts += [("F", *unit(warm + i, False)), ("B", *unit(i, True))]
        acts += [("B", *unit(i, True)) for i in range(total - warm, total)]
        orders.append(acts)
    return orders


def _timed(orders: list[list[tuple]], P: int, cost: dict) -> list[list[tuple]]:
    """Each rank's actions ``(kind, chunk, microbatch)`` in the given order, each started as soon as
    the rank is free and its inputs are there (unit costs): ``(kind, chunk, microbatch, start, cost)``."""
    K = P * max(c for acts in orders for _, c, _ in acts) + P
    end: dict[tuple, int] = {}
    nxt, free, plan, t = [0] * P, [0] * P, [[] for _ in range(P)], 0
    while any(nxt[r] < len(orders[r]) for r in range(P)):
        if t > 10 * sum(len(o) for o in orders) * max(cost.values()):
            raise RuntimeError("pipeline schedule: the action order deadlocks")  # a bug, not a user error
        for r in range(P):
            if free[r] > t or nxt[r] == len(orders[r]):
                continue
            kind, c, m = orders[r][nxt[r]]
            k = c * P + r
            need = [("F", k - 1, m)] if kind == "F" and k else []
            if kind == "B":
                need = [("F", k, m)] + ([("B", k + 1, m)] if k < K - 1 else [])
            if all(key in end and end[key] <= t for key in need):
                end[(kind, k, m)] = free[r] = t + cost[kind]
                plan[r].append((kind, c, m, t, cost[kind]))
                nxt[r] += 1
        t += 1
    return plan


def check_virtual(stages: int, virtual: int, microbatches: int, schedule: str) -> None:
    """The refusals of interleaving: V >= 1, not with GPipe, and (interleaved 1F1B) M a multiple of P."""
    if virtual < 1:
        raise ConfigError(f"`pp_virtual` must be at least 1, not {virtual}")
    if virtual > 1 and schedule == "gpipe":
        raise ConfigError(f"`pp_virtual` {virtual} interleaves 1F1B or zero-bubble schedules; GPipe runs every forward "
                          f"before any backward and gains nothing from chunks: use `pp_schedule` 1f1b or zb")
    if virtual > 1 and schedule == "1f1b" and microbatches % stages:
        raise ConfigError(f"interleaved 1F1B (`pp_virtual` {virtual}) sends micro-batches round the {stages} stages in "
                          f"groups of {stages}: `microbatches` {microbatches} must be a multiple of `pp` {stages}")
