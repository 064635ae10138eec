"""Throughput you can compare across runs and machines: tokens per second and model FLOPs utilisation.

A language model's sample is a window of ``block_size`` tokens, so tokens/s is samples/s times that.
MFU (PaLM's *model FLOPs utilisation*) is the model's training FLOPs per token (its own count:
:func:`distlab.models.flops_per_token`) times tokens/s, over the peak of every device the run uses:
``--peak-tflops`` per device, else the GPU's data-sheet peak at the run's precision
(:func:`distlab.runtime.device.peak_tflops`). Recomputation under activation checkpointing and the
extra work of a layout are not model FLOPs: they lower MFU, as they lower useful throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from distlab.models import flops_per_token
from distlab.runtime.device import peak_tflops


@dataclass(frozen=True)
class Throughput:
    tokens_per_sample: int | None  # None: not a language model
    flops_per_token: float | None
    peak_tflops: float | None      # per device
    peak_basis: str
    devices: int

    @classmethod
    def of(cls, model: nn.Module, data, cfg, rt) -> "Throughput":
        """For ``model`` (whole, before a layout cuts it) trained on ``data`` by ``cfg`` on ``rt``'s ranks."""
        tokens = data.input_shape[0] if data.predicts_tokens else None  # per sample: a window's (a pair: two)
        tokens = tokens * 2 if tokens and data.pairs else tokens
        flops = flops_per_token(model) if tokens else None
        if cfg.peak_tflops:
            peak, basis = cfg.peak_tflops, f"--peak-tflops {cfg.peak_tflops:g} per device"
        else:
            peak, basis = peak_tflops(rt.device, cfg.strategy.precision)
        return cls(tokens, flops, peak, basis, rt.world_size)

    def of_rate(self, samples_per_s: float | None) -> dict:
        """``tokens_per_s`` and ``mfu`` (a fraction) at ``samples_per_s``: what is known of them."""
        if not self.tokens_per_sample or not samples_per_s:
            return {}
        tokens = samples_per_s * self.tokens_per_sample
        out = {"tokens_per_s": tokens}
        if self.flops_per_token and self.peak_tflops:
            out["mfu"] = tokens * self.flops_per_token / (self.peak_tflops * 1e12 * self.devices)
        return out

    @staticmethod
    def words(record: dict) -> str:
        """The log line's words for a record's ``tokens_per_s`` and ``mfu``."""
        text = f" | {record['tokens_per_s']:,.0f} tokens/s" if record.get("tokens_per_s") else ""
        return text + (f" | MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else "")

    def summary(self, samples_per_s: float | None) -> dict:
        """summary.json's fields: at the median step's rate, with the counts behind them."""
        if not self.tokens_per_sample:
            return {}
        return {"tokens_per_s": None, "mfu": None, **self.of_rate(samples_per_s),
                "flops_per_token": self.flops_per_token, "peak_tflops_per_device": self.peak_tflops,
                "peak_basis": self.peak_basis}
