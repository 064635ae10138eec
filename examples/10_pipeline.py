"""Pipeline parallel: a transformer in two stages, GPipe and 1F1B, each equal to the unsplit step.

    torchrun --standalone --nproc-per-node 2 examples/10_pipeline.py

Both ranks build the same seeded GPT (embedding, 4 blocks, head); each keeps its stage. One
training step of 8 sequences goes through the pipeline as M micro-batches, and every gradient of
this rank's layers is compared with one step of the whole model on one process. Then the bubble:
the share of the step each schedule spends waiting for the other stage, beside (P-1)/(M+P-1), and
how many micro-batches' activations each stage held at once. About 20 s on 2 cores.
"""

import torch
import torch.distributed as dist

from distlab.models import GPT, task_loss
from distlab.parallel import PipelineStage, partition
from distlab.runtime import ordered_print, print0, shutdown
from distlab.tools.verify import sum_tolerance


def gpt():
    torch.manual_seed(0)
    return GPT(256, 32, n_layer=4, n_head=4, n_embd=64).double()  # float64: a bound far below any bug


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (8, 32), generator=g), torch.randint(0, 256, (8, 32), generator=g)
    full = gpt()
    task_loss(full(x), y).backward()  # the reference: one step of the whole model
    # a gradient entry sums over the 8 x 32 tokens the terms of every layer's fan-in along its chain
    scale = max([1.0] + [p.grad.abs().max().item() for p in full.parameters()])
    bound = sum_tolerance(x.numel() * (4 * (64 + 4 * 64) + 256), scale, torch.float64)

    names = ["embedding", "block 1", "block 2", "block 3", "block 4", "head"]
    print0(f"stages, balanced by parameters: {[names[a:b] for a, b in partition(full, world)]}")
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8):
            stage = PipelineStage(gpt(), dist.group.WORLD, microbatches=m, schedule=schedule)
            for _ in range(3):  # the last of three steps is timed (the first ones warm up)
                stage.zero_grad(set_to_none=True)
                stage.train_step(x if stage.first else None, y if stage.last else None, task_loss)
            diff = max((p.grad - q.grad).abs().max().item() for i, layer in stage.layers.items()
                       for p, q in zip(layer.parameters(), full[int(i)].parameters()))
            t = stage.last_timing
            ordered_print(f"{schedule:5} M={m}  stage {rank}: held {t['in_flight_peak']} micro-batch(es), "
                          f"bubble {t['bubble_measured']:.2f} (ideal {t['bubble_ideal']:.2f}), "
                          f"max |grad - one process| {diff:.1e}")
            assert diff <= bound, (diff, bound)
    print0("both schedules compute the unsplit step; 1F1B holds at most P - s micro-batches on stage s")
    shutdown()


if __name__ == "__main__":
    main()
