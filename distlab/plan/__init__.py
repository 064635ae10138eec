"""Predict before you run: memory per rank and time per step for a model, layout and link.

Each strategy prices itself beside its code (:mod:`distlab.parallel.cost`: the calls vocabulary,
data parallel's cost and a component's :class:`~distlab.parallel.cost.Price`;
:mod:`distlab.parallel.zero.cost`: ZeRO's exact peak; each model-sharding component's ``price``);
here: ``trace`` (the model's sizes, traced on the meta device), ``machine`` (alpha-beta collectives,
FLOP-rate compute, links), ``calibration`` (fits from bench results), ``predict`` (a layout's time
and memory, a fold over the same components that train; sweeps), ``validate`` (predictions vs
measured runs), ``text`` (tables). The planner sits one layer above the strategies it prices and
below training, whose summary states the predicted memory beside the measured.
"""

from distlab.parallel.cost import Optim
from distlab.plan.trace import Trace, generic_trace, trace
from distlab.parallel.zero.cost import zero_peak_bytes
from distlab.plan.calibration import Calibration, calibrate
from distlab.plan.machine import Link
from distlab.plan.predict import Layout, predict, sweep
from distlab.plan.text import format_prediction, format_sweep, format_validation
from distlab.plan.validate import summaries, summarize, validate

__all__ = ["Calibration", "Layout", "Link", "Optim", "Trace", "calibrate", "format_prediction", "format_sweep",
           "format_validation", "generic_trace", "predict", "summaries", "summarize", "sweep", "trace",
           "validate", "zero_peak_bytes"]
