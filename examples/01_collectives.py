"""Point-to-point messages, then all-reduce built from them, beside torch's own.

    torchrun --standalone --nproc-per-node 4 examples/01_collectives.py

Every rank starts with the vector ``[rank+1] * 6``. First a blocking send/recv pair and a
non-blocking ring pass (each rank sends to its right neighbour and receives from its left one);
then ``distlab.comm.all_reduce`` with each algorithm, which must all give ``1+2+...+N`` in every
element; and the bytes each algorithm sent, next to the textbook volume. Tutorial:
docs/01-collectives.md.
"""

import torch
import torch.distributed as dist

from distlab import comm, runtime
from distlab.runtime import ordered_print, print0


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    rank, n = rt.rank, rt.world_size
    if n < 2:
        raise SystemExit("run me with torchrun --standalone --nproc-per-node 2 (or 4) examples/01_collectives.py")

    # 1. Blocking point-to-point: rank 0 sends a tensor, rank 1 receives it into its own buffer.
    t = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
    if rank == 0:
        dist.send(t, dst=1)
    elif rank == 1:
        dist.recv(t, src=0)
    ordered_print(f"rank {rank}: after send/recv {t.tolist()}")

    # 2. Non-blocking ring pass: post the receive and the send together, then wait for both.
    #    (Two blocking calls in the wrong order on every rank would deadlock; isend/irecv cannot.)
    mine, theirs = torch.tensor([float(rank)]), torch.zeros(1)
    reqs = [dist.irecv(theirs, src=(rank - 1) % n), dist.isend(mine, dst=(rank + 1) % n)]
    for r in reqs:
        r.wait()
    ordered_print(f"rank {rank}: received {theirs.item():.0f} from rank {(rank - 1) % n}")

    # 3. All-reduce from point-to-point messages, each algorithm against gloo's native one.
    expected = n * (n + 1) / 2
    size = 6 * 4  # bytes in the vector
    print0(f"\nall-reduce of [rank+1]*6 over {n} ranks: every element must be {expected:g}")
    for algorithm in ("native", "ring", "butterfly", "direct", "gather_scatter"):
        x = torch.full((6,), float(rank + 1))
        with comm.counting() as sent:
            comm.all_reduce(x, op="sum", algorithm=algorithm)
        assert torch.all(x == expected), (algorithm, x)
        per_rank = [torch.zeros(1) for _ in range(n)]
        dist.all_gather(per_rank, torch.tensor([float(sent.bytes_sent)]))
        print0(f"  {algorithm:<15} result {x[0].item():g}  bytes sent by rank 0 {per_rank[0].item():4.0f}, "
               f"by rank 1 {per_rank[1].item():4.0f}")
    print0(f"  textbook: ring, butterfly, direct 2(n-1)/n x {size} = {2 * (n - 1) / n * size:.0f} bytes on every rank; "
           f"gather/scatter (n-1) x {size} = {(n - 1) * size} at rank 0 and {size} elsewhere")

    # 4. The other collectives, same API: reduce-scatter hands each rank one chunk of the sum,
    #    all-gather puts every rank's chunk back together.
    full = torch.arange(2 * n, dtype=torch.float32) + rank
    chunk = torch.empty(2)
    comm.reduce_scatter(chunk, full, op="sum", algorithm="ring")
    gathered = torch.empty(2 * n)
    comm.all_gather(gathered, chunk, algorithm="ring")
    ordered_print(f"rank {rank}: reduce-scatter chunk {chunk.tolist()}")
    print0(f"all-gather of the chunks: {gathered.tolist()}")
    runtime.shutdown()


if __name__ == "__main__":
    main()
