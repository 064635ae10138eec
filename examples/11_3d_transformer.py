"""A transformer on a data x tensor x pipeline mesh: who holds what, and equal to one process.

    torchrun --standalone --nproc-per-node 8 examples/11_3d_transformer.py

Eight ranks as 2 pipeline stages x 2 data-parallel replicas x 2 tensor-parallel shards (tensor
innermost: its pairs talk in every layer; pipeline outermost: its neighbours talk once per
micro-batch). A small GPT is built from one seed on every rank; ``parallelize`` shards each layer
over the TP pair (attention by heads, MLP by columns/rows, vocabulary in embedding and head, the
LayerNorm regions by sequence), keeps this rank's stage of the layers, and syncs gradients over
the DP pair. Four SGD steps later the gathered model is compared with one process trained on the
same global batches, to float32 rounding. About 30 s on 2 cores (8 processes share them).
Tutorial: docs/11-3d-parallel-transformer.md.
"""

import torch

from distlab import comm, runtime
from distlab.models import GPT, task_loss
from distlab.parallel import Mesh, Strategy, parallelize
from distlab.runtime import ordered_print, print0

STEPS, GLOBAL_BATCH, CONTEXT, LR, MOMENTUM = 4, 16, 16, 0.1, 0.9
NAMES = ["embedding", "block 1", "block 2", "head"]


def gpt() -> GPT:
    torch.manual_seed(0)  # the same full model on every rank; parallelize shards and cuts it
    return GPT(256, CONTEXT, n_layer=2, n_head=4, n_embd=32)


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, CONTEXT + 1), generator=g)
        yield tokens[:, :-1], tokens[:, 1:]  # predict every next token


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    strategy = Strategy.parse("bucketed+tp=2+sp+pp=2+mb=2").check(rt.world_size)
    mesh = Mesh.of(strategy)
    print0(f"{strategy} on {rt.world_size} ranks -- {mesh.describe()}")
    print0(f"GPT of {sum(p.numel() for p in gpt().parameters()):,} parameters: {', '.join(NAMES)}")
    engine = parallelize(gpt(), strategy, mesh)
    first, end = engine.schedule.stages()[mesh.pp_rank]["layers"]  # this stage's layers of the whole model
    held = NAMES[first:end]
    mine = sum(p.numel() for p in engine.module.parameters())
    ordered_print(f"rank {mesh.rank}: stage {mesh.pp_rank}, replica {mesh.dp_rank}, shard {mesh.tp_rank}: "
                  f"{' + '.join(held)}, {mine:,} parameters")

    opt = torch.optim.SGD(engine.parameters(), lr=LR, momentum=MOMENTUM)
    local = GLOBAL_BATCH // mesh.dp  # each replica takes its slice; a TP pair and a pipeline share one
    for step, (x, y) in enumerate(batches()):
        xs, ys = (t[mesh.dp_rank * local:(mesh.dp_rank + 1) * local] for t in (x, y))
        opt.zero_grad(set_to_none=True)
        with comm.counting() as sent:
            loss = engine.forward_backward(xs, ys, engine.loss)  # the pipeline's schedule, then DP sync
            engine.step(opt)
        if step == 0:
            ordered_print(f"step 0: rank {mesh.rank} sent {sent.bytes_sent:>7,} bytes")
        print0(f"step {step}: loss {loss:.4f} (replica 0)")

    ref = gpt()  # the reference: one process, the whole model, the same global batches
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in batches():
        ref_opt.zero_grad()
        task_loss(ref(x), y).backward()
        ref_opt.step()
    full = engine.full_state_dict()  # shards gathered over TP, stages over the pipeline
    assert list(full) == list(ref.state_dict()), "the gathered model has the single-process keys"
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    tolerance = 2 * STEPS * LR / (1 - MOMENTUM) * GLOBAL_BATCH * torch.finfo(torch.float32).eps
    assert diff <= tolerance, f"parameters differ from one process by {diff:.2e} > {tolerance:.1e}"
    print0(f"max |parameter - one process| {diff:.1e} (float32 tolerance {tolerance:.1e}): equal to single-process "
           f"training")
    runtime.shutdown()


if __name__ == "__main__":
    main()
