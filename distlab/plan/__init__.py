"""Predict before you run: memory per rank and time per step for a model, layout and link.

The model's trace and the strategies' memory live beside the strategies
(:mod:`distlab.parallel.cost`: a meta-device trace, data parallel's bytes;
:mod:`distlab.parallel.zero.cost`: ZeRO's exact peak); here: ``cost`` (alpha-beta collectives,
FLOP-rate compute, links), ``calibration`` (fits from bench results), ``predict`` (a layout's
time and memory; sweeps), ``validate`` (predictions vs measured runs), ``text`` (tables).
"""

from distlab.parallel.cost import Optim, Trace, generic_trace, trace
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.plan.calibration import Calibration, calibrate
from distlab.plan.cost import Link
from distlab.plan.predict import Layout, predict, sweep
from distlab.plan.text import format_prediction, format_sweep, format_validation
from distlab.plan.validate import summaries, summarize, validate

__all__ = ["Calibration", "Layout", "Link", "Optim", "Trace", "calibrate", "format_prediction", "format_sweep",
           "format_validation", "generic_trace", "predict", "summaries", "summarize", "sweep", "trace",
           "validate", "zero_peak_bytes"]
