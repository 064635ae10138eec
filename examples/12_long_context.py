"""Context parallel: every sequence split over the ranks for the whole model, attention exact.

    torchrun --standalone --nproc-per-node 2 examples/12_long_context.py

A GPT with a context of 256 tokens trains 3 SGD steps with each sequence split over 2 ranks --
ring attention, then Ulysses -- and the script checks what docs/12-long-context.md claims: the
parameters equal one process's on the same batches (float32 rounding, the bound `distlab verify`
uses), each rank holds about half of one process's activations (autograd's saved tensors,
measured), and the bytes each rank sends in attention are the analytic volume.
"""

import torch
import torch.distributed as dist

from distlab import comm
from distlab.comm.accounting import allreduce_bytes_per_rank
from distlab.data import load_dataset
from distlab.data.sampler import sequential_batches
from distlab.models import GPT, task_loss
from distlab.parallel import Mesh, Strategy, parallelize
from distlab.parallel.context_parallel import ring_bytes, ulysses_bytes
from distlab.parallel.pipeline import ActivationMeter
from distlab.runtime import print0, shutdown
from distlab.tools.verify import sgd_tolerance

T, BATCH, STEPS, LR, LAYERS, HEADS, WIDTH = 256, 4, 3, 0.1, 2, 4, 32


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(256, T, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH)


def train(strategy: Strategy | None, data) -> tuple[list[torch.Tensor], int, int]:
    """(parameters after STEPS steps, activation bytes held at the first step's peak, bytes sent per step)."""
    net = model()
    if strategy is None:
        ref_opt = torch.optim.SGD(net.parameters(), lr=LR)
    else:
        engine = parallelize(net, strategy, Mesh.of(strategy))
        opt = torch.optim.SGD(engine.parameters(), lr=LR)
    held = sent = 0
    for i, idx in enumerate(sequential_batches(len(data), batch_size=BATCH, seed=1)[:STEPS]):
        x, y = data.batch(torch.tensor(idx))  # every rank the whole batch of whole sequences
        with ActivationMeter(net.parameters()) as meter, comm.counting() as c:
            if strategy is None:
                ref_opt.zero_grad()
                task_loss(net(x), y).backward()
                ref_opt.step()
            else:
                opt.zero_grad()
                engine.forward_backward(x, y, engine.loss)  # this rank's tokens of each sequence
                engine.step(opt)  # the optimizer step (and what the layout needs after it)
        if i == 0:
            held, sent = meter.peak, c.bytes_sent
    params = [p.detach().clone() for p in (net.parameters() if strategy is None else engine.full_parameters())]
    return params, held, sent


def main() -> None:
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    data = load_dataset("synthetic-text:20000", "train", block_size=T)
    ref, ref_held, _ = train(None, data)
    for style, volume in (("ring", ring_bytes), ("ulysses", ulysses_bytes)):
        strategy = Strategy(cp=cp, cp_style=style).check(cp)
        params, held, sent = train(strategy, data)
        diff = max((a - b).abs().max().item() for a, b in zip(params, ref))
        bound = sgd_tolerance(STEPS, LR, BATCH * T)
        expected = LAYERS * volume(BATCH, HEADS, T, WIDTH // HEADS, cp) + allreduce_bytes_per_rank(4 * sum(p.numel() for p in ref), cp)
        print0(f"{style:8s} parameters within {diff:.1e} of one process (bound {bound:.1e}); activations "
               f"{held / 2**20:.2f} MiB vs {ref_held / 2**20:.2f} MiB ({held / ref_held:.2f}); sent {sent:,} bytes per "
               f"step (attention {LAYERS} x {volume(BATCH, HEADS, T, WIDTH // HEADS, cp):,} + the gradient all-reduce)")
        assert diff <= bound, f"{style}: parameters differ from one process by {diff:.2e}"
        assert held < 0.6 * ref_held, f"{style}: {held} activation bytes, one process {ref_held}"
        assert sent == expected, f"{style}: sent {sent}, expected {expected}"
    print0("ring and Ulysses both equal single-process training, each rank holding its share of the activations")
    shutdown()


if __name__ == "__main__":
    main()
