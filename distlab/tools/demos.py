"""``distlab demo``: the building blocks, runnable (see the CLI for flags)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.data.sampler import rank_batches, sequential_batches
from distlab.errors import ConfigError
from distlab.runtime import Runtime, ordered_print, print0


def ordered_print_demo(rt: Runtime) -> None:
    """Each rank prints ``rank R of W``; the output is in rank order whatever the scheduling."""
    ordered_print(f"rank {rt.rank} of {rt.world_size}")


def p2p_demo(rt: Runtime) -> None:
    """Point-to-point and all-reduce, as in PyTorch's c10d walkthrough."""
    if rt.world_size < 2:
        raise ConfigError("demo p2p sends from rank 0 to rank 1: run it with --nproc-per-node 2 or more")
    dev = rt.device
    ordered_print(f"rank {rt.rank}: world size {rt.world_size}")

    # Blocking: a 3x4 tensor of ones on rank 0, zeros elsewhere; rank 0 sends it to rank 1.
    t = torch.ones(3, 4, device=dev) if rt.rank == 0 else torch.zeros(3, 4, device=dev)
    if rt.rank == 0:
        dist.send(t, dst=1)
    elif rt.rank == 1:
        dist.recv(t, src=0)
    ordered_print(f"rank {rt.rank}: after blocking send/recv sum={t.sum().item():g}\n{t}")

    # Non-blocking: the same transfer with isend/irecv, then wait on the request.
    t = torch.ones(3, 4, device=dev) if rt.rank == 0 else torch.zeros(3, 4, device=dev)
    req = dist.isend(t, dst=1) if rt.rank == 0 else dist.irecv(t, src=0) if rt.rank == 1 else None
    if req is not None:
        req.wait()
    ordered_print(f"rank {rt.rank}: after isend/irecv sum={t.sum().item():g}\n{t}")

    # All-reduce SUM of [[1..4],[5..8],[9..12]] on every rank: every entry times the world size.
    m = torch.arange(1, 13, dtype=torch.float32, device=dev).reshape(3, 4)
    dist.all_reduce(m, op=dist.ReduceOp.SUM)
    ordered_print(f"rank {rt.rank}: all_reduce(SUM)\n{m}")


def sampler_demo(rt: Runtime, *, length: int, num_replicas: int | None, shuffle: bool, seed: int, epoch: int,
                 drop_last: bool, batch_size: int, batch_drop_last: bool) -> None:
    """Show each rank's sampler indices, items (10*i) and batches, then the global minibatches."""
    replicas = num_replicas or rt.world_size
    if length < 1 or batch_size < 1:
        raise ConfigError(f"--length {length} and --batch-size {batch_size} must be positive")
    print0(f"dataset: {length} items, item i = 10*i; DistributedSampler(num_replicas={replicas}, "
           f"shuffle={shuffle}, seed={seed}, drop_last={drop_last}), epoch {epoch}; "
           f"BatchSampler(batch_size={batch_size}, drop_last={batch_drop_last})")
    # Under N processes each shows its own shard; on one process, show every replica's.
    shown = [rt.rank] if rt.world_size == replicas else range(replicas)
    lines = []
    all_batches = {}
    for r in shown:
        batches = rank_batches(length, num_replicas=replicas, rank=r, batch_size=batch_size, shuffle=shuffle,
                               seed=seed, epoch=epoch, drop_last=drop_last, batch_drop_last=batch_drop_last)
        all_batches[r] = batches
        idx = [i for b in batches for i in b]
        lines.append(f"rank {r}: items {[10 * i for i in idx]} in batches {[[10 * i for i in b] for b in batches]}")
    if rt.world_size == replicas:
        ordered_print(lines[0])
    else:
        print0("\n".join(lines))
    if rt.is_main:
        # The union of every rank's b-th batch is the b-th sequential minibatch of size replicas*batch_size.
        seq = sequential_batches(length, batch_size=replicas * batch_size, shuffle=shuffle, seed=seed,
                                 epoch=epoch, drop_last=False)
        print(f"one process, batch size {replicas * batch_size}: {[[10 * i for i in b] for b in seq]}", flush=True)
        print("local batch b of every rank together = global minibatch b (when nothing is padded or dropped)",
              flush=True)
