"""``distlab plan --machine``: the GPU cluster a plan is for, from the flags."""

from __future__ import annotations

import math

from distlab.errors import ConfigError


def data_parallel(strategy, gpus: int | None, nodes: int | None, machine: str) -> int:
    """``--dp`` where it was not given: what the other dimensions leave of the cluster's GPUs (1 without a size)."""
    from distlab.plan.gpu import load_machine
    total = gpus or (nodes * load_machine(machine).gpus_per_node if nodes else None)
    if total is None:
        return 1
    ways = strategy.model_ways
    if total % ways:
        raise ConfigError(f"{total} GPUs do not divide into model-parallel groups of {ways} (tp x pp x cp = {ways}): "
                          f"give a layout whose product divides them")
    return total // ways


def cluster_of(machine: str, nodes: int | None, gpus: int | None, lay, calibration: str | None):
    """The :class:`~distlab.plan.gpu.Cluster` of ``--machine``, ``--nodes``/``--gpus`` and a GPU calibration."""
    from distlab.plan.gpu import Cluster, load_machine
    from distlab.plan.gpu_calibration import GpuCalibration
    m = load_machine(machine)
    if gpus is not None:
        if gpus % m.gpus_per_node and gpus > m.gpus_per_node:
            raise ConfigError(f"--gpus {gpus}: {m.name} has {m.gpus_per_node} GPUs per node; give a multiple of it")
        if nodes is not None and nodes != math.ceil(gpus / m.gpus_per_node):
            raise ConfigError(f"--gpus {gpus} and --nodes {nodes} disagree ({m.gpus_per_node} GPUs per node): give one")
    n = nodes or math.ceil((gpus or lay.world) / m.gpus_per_node)
    cluster = Cluster(m, n)
    if gpus is not None and lay.world != gpus:
        raise ConfigError(f"the layout uses {lay.world} GPUs (dp {lay.dp} x tp {lay.tp} x pp {lay.pp} x cp {lay.cp}) "
                          f"but --gpus is {gpus}: make them equal (or leave --dp out to fill the GPUs)")
    if calibration:
        GpuCalibration.load(calibration).apply(cluster)
    return cluster
