"""distlab's pieces in a training loop of your own: Strategy, parallelize, the Engine, comm, placements.

    torchrun --standalone --nproc-per-node 4 examples/own_training_loop.py

No Trainer, no config: a hand-written loop trains an MLP on Fashion-MNIST (the real IDX files,
through the public loading API: ``load_dataset`` and ``batch``, and the sampler's ``rank_batches``)
on 4 ranks laid out as 2 data-parallel x 2 tensor-parallel, with ZeRO-1 over the data-parallel pairs and 2 accumulated micro-batches --
one ``Strategy`` -- and checks at the end that it computed what one process computes on the same
global batches (to float32 rounding). Along the way it uses the library directly: the mesh's
groups, ``comm.all_reduce`` with torch's ``ReduceOp``, the Engine's full gradients and its map of
where each parameter's piece sits in the whole model, and the tensor-parallel layers built from
shards alone -- only public methods of the Engine. Tutorial: docs/README.md.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab import comm
from distlab.data import load_dataset
from distlab.data.sampler import rank_batches, sequential_batches
from distlab.parallel import ColumnParallelLinear, Mesh, Strategy, parallelize
from distlab.parallel.placement import placements_of
from distlab.runtime import print0, shutdown
from distlab.tools.verify import gradient_tolerance, sgd_tolerance

STEPS, GLOBAL_BATCH = 6, 32


def model() -> nn.Module:
    torch.manual_seed(0)  # the same full model on every rank; parallelize shards it
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))


def local_batches(data, replicas: int, replica: int):
    """This data-parallel rank's first STEPS batches: torch's DistributedSampler over the data set's
    indices (every rank the same permutation, rank r its strided share), read with ``batch``."""
    for idx in rank_batches(len(data), num_replicas=replicas, rank=replica, batch_size=GLOBAL_BATCH // replicas,
                            seed=1)[:STEPS]:
        yield data.batch(torch.tensor(idx))  # (normalised images, labels)


def main() -> None:
    dist.init_process_group("gloo")
    strategy = Strategy.parse("zero=1+tp=2+accum=2").check(dist.get_world_size())
    mesh = Mesh.of(strategy)
    data = load_dataset("fashion-mnist", "train")  # 60,000 images from the real IDX files (`make data`)
    engine = parallelize(model(), strategy, mesh)
    opt = engine.attach(torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9))
    # Each data-parallel rank reads its share; the two ranks of a TP pair read the same one.
    for xs, ys in local_batches(data, mesh.dp, mesh.dp_rank):
        opt.zero_grad(set_to_none=True)
        loss = engine.forward_backward(xs, ys, F.cross_entropy)  # 2 micro-batches, one reduce-scatter
        full_grads = engine.full_gradients()  # every parameter's averaged gradient (ZeRO: its shards gathered)
        engine.step(opt)  # the optimizer step, then ZeRO-1's all-gather of the updated shards
        mean = loss.reshape(1).clone()  # this rank's loss: a float64 tensor (no wait for the device until read)
        comm.all_reduce(mean, op=dist.ReduceOp.AVG, group=mesh.dp_group)  # torch's op; gloo has no AVG, distlab does
        print0(f"step loss {mean.item():.4f}")

    first = placements_of(engine)["1.weight"]  # where this rank's piece of the model's tensor sits in it
    piece = math.prod(first.piece_shape())
    print0(f"rank 0 owns elements {first.start}..{first.start + first.length} of its {piece} elements of layer 1's "
           f"weight {list(first.shape)} (tensor-parallel part {first.part} of {first.parts} along dim {first.dim})")

    # The reference: one process, the whole model, the same global batches.
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for idx in sequential_batches(len(data), batch_size=GLOBAL_BATCH, seed=1)[:STEPS]:  # the same global batches
        x, y = data.batch(torch.tensor(idx))
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
        ref_opt.step()
    mine = engine.full_state_dict()
    diff = max((mine[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    head_grad = (full_grads["5.weight"] - ref_grads["5.weight"]).abs().max().item()
    # float32 summation order only: bounds derived in distlab.tools.verify (the same ones `distlab verify` uses)
    assert diff <= sgd_tolerance(STEPS, 0.1, GLOBAL_BATCH, 0.9), f"parameters differ from one process by {diff:.2e}"
    assert head_grad <= gradient_tolerance(GLOBAL_BATCH), f"the last step's gradient differs by {head_grad:.2e}"

    # A tensor-parallel layer from this rank's shard alone (no full layer built anywhere).
    w = torch.randn(16 // mesh.tp, 8, generator=torch.Generator().manual_seed(mesh.tp_rank))
    col = ColumnParallelLinear.from_shard(w, None, group=mesh.tp_group)
    out = col(torch.ones(3, 8))
    assert out.shape == (3, 16) and col.out_features == 16
    print0(f"{strategy} on {mesh.describe()}: parameters within {diff:.1e} of one process "
           f"(gradients {head_grad:.1e}); equal to single-process training")
    shutdown()  # frees what holds gloo work, distlab's extra groups, then destroy_process_group


if __name__ == "__main__":
    main()
