"""ZeRO stages 1 -> 3: shard optimizer state, then gradients, then parameters -- and predict the memory.

    torchrun --standalone --nproc-per-node 2 examples/07_zero.py

The same MLP is trained for 5 Adam steps with plain data parallel and with ZeRO stages 1, 2 and 3.
For each, the script prints the peak bytes of parameters + gradients + optimizer state one rank
held and the bytes it sent per step, then asks ``distlab.plan`` to predict that peak from the
model's shapes alone and checks the prediction is exact. The same runs with SGD + momentum show how
far the parameters are from single-process training, within the float32 bound
``distlab.tools.verify.sgd_tolerance`` derives (Adam has none: it divides each gradient entry by its own
size, so rounding noise can move an entry by up to lr). Tutorial: docs/07-zero.md.
"""

import torch
import torch.nn.functional as F

from distlab import comm, runtime
from distlab.models import build_model
from distlab.parallel import DataParallel, Zero
from distlab.parallel.state_bytes import model_state_bytes
from distlab.parallel.cost import Optim
from distlab.plan.trace import trace
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.runtime import print0
from distlab.tools.verify import sgd_tolerance

STEPS, GLOBAL_BATCH, WIDTHS = 5, 32, (256, 128)
SGD_LR, MOMENTUM = 0.05, 0.9


BUCKET_MB = 0.25  # stages 1-2: the first weight (784 KB) alone, the rest in one more bucket


def model():
    torch.manual_seed(0)
    return build_model("mlp", (1, 28, 28), 10, widths=WIDTHS)


def optimizer(name: str, params):
    return torch.optim.Adam(params, lr=1e-3) if name == "adam" else torch.optim.SGD(params, lr=SGD_LR, momentum=MOMENTUM)


def train(stage: int, x, y, rank: int, n: int, opt_name: str = "adam"):
    net = model()
    if stage == 0:
        wrapped = DataParallel(net, "allreduce")
        opt = optimizer(opt_name, net.parameters())
    else:
        wrapped = Zero(net, stage, bucket_mb=BUCKET_MB)  # shards live in wrapped; the optimizer sees only its own
        opt = optimizer(opt_name, wrapped.shard_parameters())
        wrapped.track(opt)
    peak = 0
    with comm.counting() as sent:
        for s in range(STEPS):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(wrapped(x[s][rank::n] if n > 1 else x[s]), y[s][rank::n] if n > 1 else y[s]).backward()
            wrapped.sync_gradients()  # DP: all-reduce; ZeRO: reduce-scatter (stages 2-3: already during backward)
            opt.step()
            wrapped.after_step()      # ZeRO 1-2: all-gather the updated shards into full parameters
            if stage == 0:
                peak = max(peak, model_state_bytes(net, opt))
    if stage:
        peak = wrapped.peak_bytes
        with wrapped.gathered():      # ZeRO-3: gather the full parameters to compare them
            params = [p.detach().clone() for p in net.parameters()]
    else:
        params = [p.detach().clone() for p in net.parameters()]
    return params, peak, sent.bytes_sent / STEPS


def main() -> None:
    rt = runtime.init(device="cpu", threads=1)  # a CPU tutorial: gloo, even where GPUs exist
    rank, n = rt.rank, rt.world_size
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS, GLOBAL_BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (STEPS, GLOBAL_BATCH), generator=g)
    net = model()  # single-process reference (SGD + momentum: it has a float32 bound)
    opt = optimizer("sgd", net.parameters())
    for s in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(net(x[s]), y[s]).backward()
        opt.step()
    reference = list(net.parameters())
    shapes = trace("mlp", (1, 28, 28), 10, widths=WIDTHS)  # meta device: shapes and hook order, no memory
    print0(f"MLP 784-{WIDTHS[0]}-{WIDTHS[1]}-10 ({shapes.num_parameters:,} parameters), Adam, {n} ranks")
    bound = sgd_tolerance(STEPS, SGD_LR, GLOBAL_BATCH, MOMENTUM)
    print0(f"  {'stage':<6} {'peak state/rank':>16} {'predicted':>10} {'bytes sent/step':>16} {'SGD: max |param diff|':>22}")
    for stage in (0, 1, 2, 3):
        _, peak, sent = train(stage, x, y, rank, n)
        predicted = zero_peak_bytes(shapes, stage, n, Optim.of("adam"), bucket_mb=BUCKET_MB)
        params, _, _ = train(stage, x, y, rank, n, "sgd")
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        print0(f"  {stage:<6} {peak:>16,} {predicted:>10,} {sent:>16,.0f} {diff:>22.1e}")
        assert predicted == peak, (stage, predicted, peak)
        assert diff <= bound, (stage, diff, bound)
    print0(f"(the float32 bound on the SGD difference: {bound:.1e})")
    print0("Unsharded Adam keeps 16 bytes per parameter (4 weights + 4 gradient + 8 moments). Stage 1 shards\n"
           "the moments, stage 2 the gradients too, stage 3 the weights: each rank then holds about 16/n bytes\n"
           "per parameter plus what is in flight -- stages 1-2 a bucket's gradients and their reduced shard,\n"
           "stage 3 the layer being worked on and the next one, prefetched. Here the first layer holds 85% of\n"
           "the weights, so it dominates (`distlab plan --sweep` shows the savings at scale). Stage 3 sends\n"
           "up to 1.5x: parameters are all-gathered again for backward, except the first layer's, whose\n"
           "input needs no gradient. distlab plan predicted every peak exactly.")
    runtime.shutdown()


if __name__ == "__main__":
    main()
