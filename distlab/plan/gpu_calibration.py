"""A GPU's measured rates for the planner: ``distlab plan calibrate --device cuda`` times the model's own layer
shapes -- its matrix multiplications forward and backward, and its attention -- on the device at hand and
stores the fraction of the datasheet's peak each reached. A plan for that GPU then computes at those
fractions instead of :data:`~distlab.plan.gpu.DEFAULT_EFFICIENCY`.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from distlab.errors import ConfigError

KIND = "distlab-plan-gpu-calibration"


@dataclass
class GpuCalibration:
    device: str             # the device's name (torch.cuda.get_device_name) or "cpu"
    peak_flops: float | None  # its datasheet peak at the precision measured (None: a CPU has none)
    matmul_flops: float     # FLOP/s its matrix multiplications reached (forward and backward)
    attention_flops: float  # FLOP/s its attention reached (forward and backward)
    precision: str
    shapes: list[dict]
    host: str = ""
    date: str = ""

    @property
    def efficiency(self) -> float | None:
        """The FLOP-weighted fraction of the peak (matrix multiplications and attention together)."""
        if not self.peak_flops:
            return None
        total = sum(s["flops"] for s in self.shapes)
        seconds = sum(s["seconds"] for s in self.shapes)
        return total / seconds / self.peak_flops

    def apply(self, cluster) -> None:
        """Compute on ``cluster`` at the measured efficiency (refused for another GPU's measurement)."""
        if self.efficiency is None:
            raise ConfigError(f"this calibration was measured on {self.device}, which has no datasheet peak: "
                              f"calibrate on one of the cluster's GPUs (`distlab plan calibrate --device cuda`)")
        cluster.efficiency = self.efficiency
        cluster.efficiency_source = (f"measured on {self.device} ({self.host}, {self.date[:10]}): matrix "
                                     f"multiplications {self.matmul_flops / 1e12:.0f} TFLOP/s, attention "
                                     f"{self.attention_flops / 1e12:.0f} TFLOP/s")
        cluster.calibrated_on = self.device

    def to_dict(self) -> dict:
        return {"kind": KIND, "device": self.device, "peak_flops": self.peak_flops, "precision": self.precision,
                "matmul_flops_per_s": self.matmul_flops, "attention_flops_per_s": self.attention_flops,
                "efficiency": self.efficiency, "shapes": self.shapes, "host": self.host, "date": self.date}

    @classmethod
    def load(cls, path: str) -> "GpuCalibration":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"calibration {path} not found: make it with `distlab plan calibrate --device cuda "
                              f"-o {path}` on one of the machine's GPUs") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"calibration {path} cannot be read ({exc})") from None
        if not isinstance(d, dict) or d.get("kind") != KIND:
            raise ConfigError(f"{path} is not a GPU calibration (`distlab plan calibrate --device cuda` makes one); "
                              f"a CPU calibration from bench results plans this machine, without --machine")
        try:
            return cls(str(d["device"]), d["peak_flops"], float(d["matmul_flops_per_s"]),
                       float(d["attention_flops_per_s"]), str(d["precision"]), list(d["shapes"]),
                       str(d.get("host", "")), str(d.get("date", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: not a valid GPU calibration ({exc}); make it again") from None


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after a warm-up, synchronised on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(linear_shapes: list[tuple[int, int]], heads: int, head_dim: int, tokens: int, device: torch.device,
            precision: str = "bf16", repeats: int = 5) -> GpuCalibration:
    """Time each distinct (in, out) matrix multiplication of the model over ``tokens`` rows, forward and both
    backward products, and causal attention of ``heads`` x ``head_dim`` over ``tokens``, forward and backward."""
    from distlab.runtime.device import peak_tflops
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    shapes = []
    for k, n in sorted(set(linear_shapes)):
        x = torch.randn(tokens, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)

        def step(x=x, w=w):
            y = torch.nn.functional.linear(x, w)
            y.backward(torch.ones_like(y))

        shapes.append({"op": "linear", "in": k, "out": n, "tokens": tokens, "flops": 6.0 * tokens * k * n,
                       "seconds": _time(step, device, repeats)})
    q, kk, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(3))

    def attend():
        o = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
        o.backward(torch.ones_like(o))

    # PaLM's count, as MFU and the planner count attention: 12 x width x tokens per token, forward and backward
    shapes.append({"op": "attention", "heads": heads, "head_dim": head_dim, "tokens": tokens,
                   "flops": 12.0 * heads * head_dim * tokens * tokens, "seconds": _time(attend, device, repeats)})
    mm = [s for s in shapes if s["op"] == "linear"]
    at = [s for s in shapes if s["op"] == "attention"]
    peak, _ = peak_tflops(device, precision)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return GpuCalibration(name, peak * 1e12 if peak else None,
                          sum(s["flops"] for s in mm) / sum(s["seconds"] for s in mm),
                          sum(s["flops"] for s in at) / sum(s["seconds"] for s in at), precision, shapes,
                          platform.node(),
                          datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
