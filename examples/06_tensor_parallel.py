"""Tensor parallel: one layer's weights split over ranks -- naive (gather every layer) vs Megatron.

    torchrun --standalone --nproc-per-node 2 examples/06_tensor_parallel.py

An MLP 784-512-512-512-512-10 is built from one seed, then sharded over the ranks two ways. Both compute
exactly what the unsharded model computes (outputs and gradients are checked); they differ in
what they send. Megatron pairs a column-parallel layer with a row-parallel one so the activation
between them stays split: one all-reduce forward and one backward per pair (the classifier head
stays whole). Naive makes every
layer column parallel and all-gathers its output. Tutorial: docs/06-tensor-parallel.md.
"""

import copy

import torch
import torch.nn.functional as F

from distlab import comm, runtime
from distlab.models import build_model
from distlab.parallel import apply_tensor_parallel
from distlab.parallel.placement import full_parameters
from distlab.runtime import print0
from distlab.tools.verify import sum_tolerance

BATCH = 32


def shard(reference, x, y, style: str):
    """``reference`` split over the ranks in ``style``; one forward and backward on the whole batch.
    Returns the sharded model, its output, its gathered gradients and the bytes sent each way."""
    model = apply_tensor_parallel(copy.deepcopy(reference), style=style)
    model.zero_grad()
    with comm.counting() as fwd:  # the counts are filled in when the block ends
        out = model(x)
    with comm.counting() as bwd:
        F.cross_entropy(out, y).backward()
    grads = full_parameters(_grads_as_params(model))  # gather the gradient shards like parameters
    return model, out, grads, fwd.bytes_sent, bwd.bytes_sent


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    n = rt.world_size
    torch.manual_seed(0)
    reference = build_model("mlp", (1, 28, 28), 10, widths=(512, 512, 512, 512))
    x = torch.randn(BATCH, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(2))
    # The comparison runs in float64 (the bytes are float32's): its rounding bound then holds on every
    # machine and lies many orders below what a wrong shard or a missing all-reduce moves.
    ref64, x64 = copy.deepcopy(reference).double(), x.double()
    F.cross_entropy(ref64(x64), y).backward()  # every rank runs the whole batch: TP splits weights, not data
    ref_grads = [p.grad for p in ref64.parameters()]
    # every output and gradient entry sums at most BATCH x (784 + 4 x 512) terms along its chain
    scale = max([ref64(x64).abs().max().item(), 1.0] + [g.abs().max().item() for g in ref_grads])
    bound = sum_tolerance(BATCH * (784 + 4 * 512), scale, torch.float64)
    full = sum(p.numel() for p in reference.parameters())
    print0(f"MLP 784-512-512-512-512-10 ({full:,} parameters), batch {BATCH}, tensor parallel over {n} ranks")
    for style in ("naive", "megatron"):
        model, _, _, fwd, bwd = shard(reference, x, y, style)
        _, out, grads, _, _ = shard(ref64, x64, y, style)
        out_err = (out - ref64(x64)).abs().max().item()
        grad_err = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
        mine = sum(p.numel() for p in model.parameters())
        print0(f"  {style:<9} parameters on this rank {mine:>8,} ({mine / full:.0%})  output err {out_err:.1e}  "
               f"grad err {grad_err:.1e}  bytes sent: forward {fwd:,}, backward {bwd:,}")
        assert out_err <= bound and grad_err <= bound, (style, out_err, grad_err, bound)
    print0("Both equal the unsharded model. Megatron all-reduces each block's output (forward) and input\n"
           "gradient (backward; none for the first block: the images need no gradient); naive all-gathers\n"
           "every layer's output and all-reduces every layer's input gradient.")
    runtime.shutdown()


def _grads_as_params(model):
    """A copy of ``model`` whose parameters hold its gradients (so full_parameters gathers those)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            q.copy_(p.grad)
    return twin


if __name__ == "__main__":
    main()
