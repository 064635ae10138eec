"""A GPU cluster for the planner: machines from their datasheets, NCCL's collectives on their topology,
each parallelism's groups placed as a launch places them, and a GPU's compute rate.

**Machines** (``--machine h100-sxm | h200 | a100-80g | b200 | h100-grand-teton | FILE.toml``): peak dense
FLOP/s, HBM capacity and bandwidth, GPUs per node, NVLink and per-GPU network bandwidth, and NCCL's own
latency model -- each number cited in its file (``distlab/plan/machines/``). None is fitted to a training run.

**Collectives** as NCCL runs them and nccl-tests measures them: ``bus bandwidth = algorithm bandwidth x
factor``, the factor ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for reduce-scatter, all-gather and all-to-all,
1 for send/recv, where ``algorithm bandwidth = size / time`` and ``size`` is the whole buffer (all-reduce,
reduce-scatter's input, all-gather's output). So a collective of ``S`` bytes over ``n`` ranks takes
``latency + S x factor / bus bandwidth``. A group's bus bandwidth is NVLink's inside one node; a group that
spans nodes is paced by the slower of NVLink and its members' NICs on one node (``ranks per node x NIC``:
NCCL's rings leave a node once per channel, one channel per NIC). Latency is NCCL's tuning model:
``base + steps inside a node x NVLink step + steps across nodes x network step`` (a ring), and for an
all-reduce across nodes the tree's ``base + 2 ((ranks per node - 1) NVLink step + log2 nodes x network
step)`` at 0.92 of the bandwidth where that is faster, as NCCL chooses.

**Placement** (:func:`placement`): ranks are numbered as distlab's mesh numbers them
(:mod:`distlab.parallel.mesh`) -- tensor parallel fastest, then context, expert (within data parallel), data
parallel, and the pipeline outermost, the order torchtitan's mesh ``(pp, dp, cp, tp)`` and Megatron's default
``tp-cp-ep-dp-pp`` use too -- and torchrun puts consecutive ranks on a node's consecutive GPUs: TP inside a
node first.

**Compute**: the model's traced FLOPs at ``peak x efficiency``; the efficiency is a distlab measurement
(:data:`DEFAULT_EFFICIENCY`, or ``distlab plan calibrate --device cuda``), the optimizer step the bytes
Adam or SGD moves through HBM at its datasheet bandwidth.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from distlab.errors import ConfigError
from distlab.plan.machine import Compute

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MACHINES_DIR = Path(__file__).with_name("machines")
# distlab's own Llama-3.2-1B-shaped step (16 x 2048, GQA 32/8, SwiGLU 8192; 2048 tokens x 4; AdamW; bf16
# autocast; compiled) on one lent H200: 51.8% of the datasheet's dense bf16 peak, PaLM's FLOP count
# (results/gpu-h200/overhead-llama-1b.json, `distlab bench overhead --workload llama-1b --device cuda`).
DEFAULT_EFFICIENCY = 0.518
EFFICIENCY_SOURCE = "distlab's Llama-1B step on one H200, bf16, compiled (results/gpu-h200/overhead-llama-1b.json)"
TREE_BANDWIDTH = 0.92  # NCCL's tree all-reduce runs at 0.92 of the ring's bus bandwidth (src/graph/tuning.cc)
TREE_NVLINK_STEP_US = 4.0  # NCCL's tree step inside a node (Simple protocol)
# Bytes an optimizer step reads and writes per trained float32 element: the parameter, its gradient and its
# state read, the parameter and state written (Adam: p, g, m, v in; p, m, v out).
OPTIMIZER_BYTES = {"sgd": 12, "sgd-momentum": 20, "adam": 28, "adamw": 28, "muon": 28}  # (muon: as AdamW, NS5 unpriced)
DIMS = ("tp", "cp", "ep", "dp", "pp")  # fastest-varying first: the order ranks fill a node


@dataclass(frozen=True)
class GpuMachine:
    name: str
    description: str
    bf16_tflops: float
    fp8_tflops: float
    fp32_tflops: float
    memory_gib: float
    memory_tbps: float
    gpus_per_node: int
    nvlink_gbps: float  # GB/s each way per GPU
    nic_gbit: float     # Gb/s each way per GPU
    base_us: float
    nvlink_step_us: float
    net_step_us: float
    source: str = ""
    host_gbps: float = 32.0  # GB/s each way between a GPU and its host (PCIe; what --offload crosses)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def nvlink_Bps(self) -> float:
        return self.nvlink_gbps * 1e9

    @property
    def host_Bps(self) -> float:
        return self.host_gbps * 1e9

    @property
    def nic_Bps(self) -> float:
        return self.nic_gbit * 1e9 / 8

    def peak(self, precision: str) -> float:
        """Dense FLOP/s at ``precision`` (bf16 and fp16 share tensor cores; fp32 as torch runs it)."""
        return {"bf16": self.bf16_tflops, "fp16": self.bf16_tflops, "fp8": self.fp8_tflops,
                "fp32": self.fp32_tflops}[precision] * 1e12

    def to_dict(self) -> dict:
        import dataclasses
        return dataclasses.asdict(self)


def machine_names() -> list[str]:
    return sorted(p.stem for p in MACHINES_DIR.glob("*.toml"))


# Each field of a machine file: (table, key, least, most, whether 0 is allowed) -- a datasheet's numbers are
# finite and positive; the ranges hold every GPU made or announced with room to spare.
MACHINE_FIELDS = {"bf16_tflops": ("gpu", 1e5), "fp8_tflops": ("gpu", 1e5), "fp32_tflops": ("gpu", 1e5),
                  "memory_gib": ("gpu", 1e5), "memory_tbps": ("gpu", 1e3), "gpus": ("node", 1024),
                  "nvlink_gbps": ("node", 1e5), "nic_gbit": ("network", 1e6), "base_us": ("latency", 1e6),
                  "nvlink_step_us": ("latency", 1e6), "net_step_us": ("latency", 1e6), "pcie_gbps": ("host", 1e5)}
ZERO_ALLOWED = ("fp8_tflops", "base_us", "nvlink_step_us", "net_step_us")  # no FP8 cores; latencies may be 0
MACHINE_FILE_LIMIT = 1 << 20  # bytes


def _machine_value(d: dict, key: str, path: Path, default=None):
    """Field ``key`` of a parsed machine file: a finite number in its range (a whole one for ``gpus``)."""
    table, most = MACHINE_FIELDS[key]
    section = d.get(table)
    value = section.get(key, default) if isinstance(section, dict) else default if section is None else None
    if value is None:
        raise ConfigError(f"--machine {path}: [{table}] {key} is missing (see distlab/plan/machines/h100-sxm.toml)")
    whole = key == "gpus"
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not math.isfinite(value) \
            or not (0 <= value <= most) or (value == 0 and key not in ZERO_ALLOWED):
        kind = "a whole number" if whole else "a finite number"
        raise ConfigError(f"--machine {path}: [{table}] {key} is {value!r}; it must be {kind} "
                          f"{'from 0' if key in ZERO_ALLOWED else 'above 0'} to {most:g}")
    return value


def load_machine(name: str) -> GpuMachine:
    """A machine by preset name or from a TOML file of the same fields, each checked (:data:`MACHINE_FIELDS`)."""
    path = Path(name) if name.endswith(".toml") else MACHINES_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"--machine {name}: no such machine; choose one of {', '.join(machine_names())} or "
                          f"give a FILE.toml with the same fields (see distlab/plan/machines/h100-sxm.toml)")
    try:
        if path.stat().st_size > MACHINE_FILE_LIMIT:
            raise ValueError(f"{path.stat().st_size:,} bytes, more than a machine's numbers take")
        d = tomllib.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"--machine {path}: not a machine file (nested too deeply)") from None
    except (tomllib.TOMLDecodeError, ValueError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"--machine {path}: not a machine file ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    v = functools.partial(_machine_value, d, path=path)
    bf16 = v("bf16_tflops")
    return GpuMachine(str(d.get("name", path.stem))[:100], str(d.get("description", ""))[:300], float(bf16),
                      float(v("fp8_tflops", default=0.0)), float(v("fp32_tflops", default=bf16 / 14.8)),
                      float(v("memory_gib")), float(v("memory_tbps")), v("gpus"), float(v("nvlink_gbps")),
                      float(v("nic_gbit")), float(v("base_us")), float(v("nvlink_step_us")), float(v("net_step_us")),
                      str(path), float(v("pcie_gbps", default=32.0)))


# ---------------------------------------------------------------------------------- collectives

def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' bus bandwidth / algorithm bandwidth (its PERFORMANCE.md): what each rank's link carries
    per byte of the collective's size."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if kind in ("send", "broadcast", "reduce"):
        return 1.0
    raise ConfigError(f"unknown collective {kind!r}")


def ring_steps(kind: str, n: int) -> int:
    return 2 * (n - 1) if kind == "all_reduce" else 1 if kind == "send" else n - 1


@dataclass(frozen=True)
class Group:
    """``n`` ranks of which ``per_node`` share a node (the rest on ``n / per_node`` nodes)."""
    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.n / max(1, self.per_node))


def bus_bandwidth(m: GpuMachine, g: Group) -> float:
    """Bytes/s a ring over ``g`` moves per link: NVLink inside a node; across nodes the slower of NVLink
    and the group's NICs on one node."""
    return m.nvlink_Bps if g.nodes <= 1 else min(m.nvlink_Bps, g.per_node * m.nic_Bps)


def collective_seconds(m: GpuMachine, kind: str, nbytes: float, g: Group) -> float:
    """One NCCL collective of ``nbytes`` (the whole buffer) over group ``g`` on machine ``m``."""
    if g.n <= 1:
        return 0.0
    bw = bus_bandwidth(m, g)
    steps = ring_steps(kind, g.n)
    inter = 0 if g.nodes <= 1 else (2 * (g.nodes - 1) if kind == "all_reduce" else g.nodes - 1)
    inter = min(inter, steps)
    ring = 1e-6 * (m.base_us + (steps - inter) * m.nvlink_step_us + inter * m.net_step_us) \
        + nbytes * bus_factor(kind, g.n) / bw
    if kind != "all_reduce" or g.nodes <= 1:
        return ring
    tree = 1e-6 * (m.base_us + 2 * ((g.per_node - 1) * TREE_NVLINK_STEP_US + math.log2(g.nodes) * m.net_step_us)) \
        + nbytes * 2 / (TREE_BANDWIDTH * bw)
    return min(ring, tree)


# ---------------------------------------------------------------------------------- placement

def dim_sizes(lay) -> dict[str, int]:
    """Each mesh dimension's size: expert parallel carved out of the data-parallel ranks (as distlab's
    mesh carves it from the replicas)."""
    ep = lay.ep if lay.ep > 1 else 1
    return {"tp": lay.tp, "cp": lay.cp, "ep": ep, "pp": lay.pp, "dp": max(1, lay.dp // ep)}


def placement(lay, gpus_per_node: int, dims: tuple[str, ...]) -> Group:
    """The group spanning mesh dimensions ``dims`` of layout ``lay``: its size and how many of its ranks share
    a node, ranks numbered tensor-parallel fastest (:data:`DIMS`)."""
    sizes, stride, n, per_node = dim_sizes(lay), 1, 1, 1
    for d in DIMS:
        if d in dims:
            n *= sizes[d]
            per_node *= max(1, min(sizes[d], gpus_per_node // stride))
        stride *= sizes[d]
    return Group(n, min(per_node, gpus_per_node))


@dataclass
class Cluster:
    """``nodes`` nodes of ``machine``: a :class:`~distlab.plan.timing.Machine` (NCCL over NVLink inside a node and
    the network between them, each group where the launch places it)."""
    machine: GpuMachine
    nodes: int
    efficiency: float = DEFAULT_EFFICIENCY
    efficiency_source: str = EFFICIENCY_SOURCE
    calibrated_on: str | None = None  # the GPU a `plan calibrate --device cuda` measured, when given

    @property
    def gpus(self) -> int:
        return self.nodes * self.machine.gpus_per_node

    def check(self, lay) -> None:
        if lay.world > self.gpus:
            raise ConfigError(f"the layout needs {lay.world} GPUs; {self.nodes} node(s) of {self.machine.name} have "
                              f"{self.gpus}: give --nodes {math.ceil(lay.world / self.machine.gpus_per_node)} or a "
                              f"smaller layout")

    def warnings(self, lay) -> list[str]:
        g = self.machine.gpus_per_node
        out = []
        if lay.tp > g:
            out.append(f"tp {lay.tp} spans {math.ceil(lay.tp / g)} nodes: its collectives, on every layer, run over "
                       f"the network at {self.machine.nic_gbit:g} Gb/s per GPU instead of NVLink")
        return out

    overlaps_gathers = True  # the next layer's gather runs while this one computes (its own stream)

    def compute(self, lay, trained_elements: int) -> Compute:
        """Forward and backward at ``peak x efficiency``; the optimizer step through HBM (``overhead``)."""
        optimizer = lay.optimizer
        key = "sgd-momentum" if optimizer == "sgd" and lay.momentum else optimizer
        step = OPTIMIZER_BYTES.get(key, 28) * trained_elements / (self.machine.memory_tbps * 1e12)
        return Compute(self.machine.peak(lay.strategy.precision) * self.efficiency, step, threads=0)

    def timer(self, lay, dims: tuple[str, ...], scale: float = 1.0) -> "NcclTimer":
        """A timer for the group spanning ``dims``; ``scale``: its messages' bytes as a run sends them relative
        to the trace's float32 (activations under bf16 autocast travel in 2 bytes)."""
        return NcclTimer(self.machine, placement(lay, self.machine.gpus_per_node, dims), scale)

    def sync_timer(self, lay) -> "NcclTimer":
        timer = self.timer(lay, ("cp", "ep", "dp"))
        s = lay.zero_shard if lay.zero else timer.n  # hybrid sharding: a shard group is s consecutive replicas
        if s < timer.n:  # (a node's share of them, at most), a replicate group one of each
            per = timer.group.per_node
            timer.spans = {"shard": Group(s, min(s, per)), "replicate": Group(timer.n // s, max(1, per // s))}
        return timer

    def group_timer(self, lay, group, narrow: float) -> "NcclTimer":
        return self.timer(lay, (group.dim,), narrow)  # activations, in 2 bytes under bf16

    def flop_factor(self, t) -> float:
        """The efficiency was measured against the model's own FLOP count (MFU's): time that count."""
        return t.model_flops_per_sample / t.flops_per_sample if t.model_flops_per_sample else 1.0

    def basis(self, lay, comp: Compute) -> str:
        return (f"{self.machine.name}: {self.machine.peak(lay.strategy.precision) / 1e12:g} TFLOP/s "
                f"{lay.strategy.precision} x {self.efficiency:.1%} ({self.efficiency_source}"
                + ("; this layout runs eager, the measurement compiled: expect it slower" if
                   self.calibrated_on is None and not lay.strategy.compile else "")
                + f"); optimizer step through HBM at {self.machine.memory_tbps:g} TB/s")

    def rates(self, t, lay, step: float) -> dict:
        """Tokens per second per GPU and MFU (the model's own FLOP count over the datasheet's peak)."""
        out = {}
        if t.tokens_per_sample:
            out["tokens_per_s_per_gpu"] = lay.global_batch * t.tokens_per_sample / step / lay.world
        if t.model_flops_per_sample:
            out["mfu"] = lay.global_batch * t.model_flops_per_sample / step / lay.world / \
                self.machine.peak(lay.strategy.precision)
        return out

    def facts(self, lay) -> dict:
        """What a prediction says of the cluster beside its memory: its description, the device's memory, the
        layout's warnings on it."""
        return {"cluster": self.describe(), "device_memory_bytes": self.machine.memory_bytes,
                "warnings": self.warnings(lay)}

    def describe(self) -> dict:
        return {"machine": self.machine.name, "description": self.machine.description, "nodes": self.nodes,
                "gpus": self.gpus, "gpus_per_node": self.machine.gpus_per_node, "source": self.machine.source,
                "memory_gib": self.machine.memory_gib,
                "efficiency": self.efficiency, "efficiency_source": self.efficiency_source,
                "calibrated_on": self.calibrated_on}


class NcclTimer:
    """The time of a planned call (:class:`~distlab.parallel.cost.Call`) over one placed group."""

    def __init__(self, machine: GpuMachine, group: Group, scale: float = 1.0):
        self.machine, self.group, self.scale = machine, group, scale
        self.n = group.n
        self.link_free = 0.0
        self.spans: dict[str, Group] = {}  # a call's span -> its group (hybrid sharding's shard and replicate)
        self.separate_spans = True  # those groups' calls on links of their own (NVLink, the network)

    def duration(self, call, start: float = 0.0) -> float:
        group = self.spans.get(call.span, self.group)
        return collective_seconds(self.machine, call.kind, call.nbytes * self.scale, group)
