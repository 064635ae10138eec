"""Mixture of experts with expert parallel: experts sharded over the ranks, tokens sent to them.

    torchrun --standalone --nproc-per-node 2 examples/13_experts.py

A GPT whose MLPs are mixtures of 4 experts (each token to its top 2) trains 3 SGD steps with the
experts split over 2 ranks (`ep` 2, each rank its own half of the batch), and the script checks
what docs/13-mixture-of-experts.md claims: the parameters equal one process's on the same batches
(float32 rounding, the bound `distlab verify` uses), each rank holds half of the experts, and the
bytes each rank sends are the tokens it routed to the other rank's experts and the outputs it sent
back (forward and backward) plus the all-reduce of the replicated parameters' gradients.
"""

import torch
import torch.distributed as dist

from distlab import comm
from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.data import load_dataset
from distlab.data.sampler import sequential_batches
from distlab.models import GPT, task_loss
from distlab.models.moe import MoE
from distlab.parallel import Strategy, build_mesh, parallelize
from distlab.parallel.expert_parallel import exchange_bytes
from distlab.runtime import print0, shutdown
from distlab.tools.verify import sgd_tolerance

T, BATCH, STEPS, LR, LAYERS, HEADS, WIDTH, EXPERTS, TOP_K = 32, 8, 3, 0.1, 2, 4, 32, 4, 2


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(256, T, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, experts=EXPERTS, top_k=TOP_K)


def moe_layers(net) -> list[MoE]:
    return [m for m in net.modules() if isinstance(m, MoE)]


def main() -> None:
    dist.init_process_group("gloo")
    ep, rank = dist.get_world_size(), dist.get_rank()
    data = load_dataset("synthetic-text:20000", "train", block_size=T)
    batches = [data.batch(torch.tensor(idx)) for idx in sequential_batches(len(data), batch_size=BATCH, seed=1)[:STEPS]]

    ref = model()  # one process, the whole batch
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        task_loss(ref(x), y).backward()
        opt.step()

    net = model()
    strategy = Strategy(ep=ep).check(ep)
    engine = parallelize(net, strategy, build_mesh(ep=ep))
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    local = BATCH // ep
    for step, (x, y) in enumerate(batches):
        for m in moe_layers(net):
            m.reset_statistics()
        with comm.counting() as c:
            opt.zero_grad()
            mine = slice(rank * local, (rank + 1) * local)  # this rank's share of the batch (data parallel)
            engine.forward_backward(x[mine], y[mine], engine.loss)
            engine.step(opt)
        if step == 0:
            sent, loads = c.bytes_sent, [m.routing_statistics()["load"] for m in moe_layers(net)]
    params = engine.full_parameters()
    diff = max((a - b.detach()).abs().max().item() for a, b in zip(params, ref.parameters()))
    bound = sgd_tolerance(STEPS, LR, BATCH * T)

    held = [p.shape[0] for m in moe_layers(net) for p in m.experts.parameters()]
    every = [None] * ep
    dist.all_gather_object(every, loads)  # each rank's slots per expert, per layer, in the first step
    per = EXPERTS // ep
    ours = range(rank * per, (rank + 1) * per)
    expected = allreduce_bytes_per_rank(4 * sum(p.numel() for n, p in net.named_parameters() if "experts" not in n), ep)
    for layer in range(LAYERS):
        out = sum(v for e, v in enumerate(every[rank][layer]) if e not in ours)
        back = sum(every[s][layer][e] for s in range(ep) if s != rank for e in ours)
        expected += exchange_bytes(out, back, WIDTH, ep, per)
    load = [sum(every[s][layer][e] for s in range(ep) for layer in range(LAYERS)) for e in range(EXPERTS)]
    print0(f"parameters within {diff:.1e} of one process (bound {bound:.1e}); each rank holds {held[0]} of "
           f"{EXPERTS} experts per layer; first step's token-slots per expert {load}; rank 0 sent {sent:,} bytes "
           f"(the all-to-alls and the replicated gradients' all-reduce)")
    assert diff <= bound, f"parameters differ from one process by {diff:.2e}"
    assert all(h == EXPERTS // ep for h in held), held
    assert sent == expected, f"rank {rank} sent {sent}, expected {expected}"
    assert sum(load) == BATCH * T * TOP_K * LAYERS
    print0("experts split over the ranks train the single-process model, tokens travelling to their experts")
    shutdown()


if __name__ == "__main__":
    main()
