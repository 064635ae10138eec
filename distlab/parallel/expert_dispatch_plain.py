"""Expert dispatch as the idea reads, nothing else (``ep_dispatch=all_gather``): every rank of the EP group gets
every rank's token-slots (one all-gather), each rank runs its own experts on the slots routed to them and writes
their outputs in those slots' places (zeros everywhere else), and a reduce-scatter sums the answers and hands
each rank back its own slots -- each slot answered by exactly one rank, so the sum is that rank's answer, exact.
Backward is the same two collectives the other way round (an all-gather's gradient is a reduce-scatter), which
autograd runs from :func:`~distlab.parallel.tensor_parallel.mappings.gather_sequence` and
:func:`~distlab.parallel.tensor_parallel.mappings.scatter_sequence`.

:class:`~distlab.parallel.expert_parallel.ExpertShard`'s own dispatch (``ep_dispatch=all_to_all``) sends each slot only to the
rank whose expert it needs and its output only back home (GShard's all-to-all; ``tests/test_expert_parallel.py``
holds the two to each other bit for bit): ``(ep - 1) / ep`` of the slots cross the wire instead of ``ep - 1``
times them, ``1 / ep`` of the bytes (``ep = 8``: 64x fewer), and no rank holds the whole group's slots."""

from __future__ import annotations

import torch

from distlab.parallel.tensor_parallel.mappings import all_gather_along, gather_sequence, scatter_sequence


def dispatch(shard, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """An :class:`~distlab.parallel.expert_parallel.ExpertShard`'s forward, all-gather in and reduce-scatter out:
    ``tokens`` this rank's slots sorted by expert, ``counts[e]`` of them for expert ``e``; their outputs back."""
    n, local, rank, d = shard.ep, shard.local, shard.ep_rank, tokens.shape[1]
    mine = torch.tensor([counts], dtype=torch.int64, device=tokens.device)
    every = all_gather_along(mine, shard.group, 0).tolist()  # every[s][e]: rank s's slots for expert e
    longest = max(sum(c) for c in every)  # every rank's slots padded to the longest, then gathered
    padded = torch.cat([tokens, tokens.new_zeros(longest - len(tokens), d)])
    everyone = gather_sequence(padded[None], shard.group)[0]  # rank s's slots at rows s * longest ...
    start = [[s * longest + sum(c[:e]) for e in range(len(c))] for s, c in enumerate(every)]
    experts = range(rank * local, (rank + 1) * local)
    index = torch.cat([torch.arange(start[s][e], start[s][e] + every[s][e]) for e in experts for s in range(n)])
    index = index.to(tokens.device)
    picked = everyone.index_select(0, index)  # my experts' slots, by expert then source rank
    out = shard._compute(shard, picked, [sum(every[s][e] for s in range(n)) for e in experts])
    if not len(picked):  # nothing routed here: keep the gather in this rank's backward (every rank runs it)
        out = out + everyone.sum() * 0
    answers = torch.zeros_like(everyone).index_copy(0, index, out)
    return scatter_sequence(answers[None], shard.group)[0][:len(tokens)]  # summed; my own slots back
