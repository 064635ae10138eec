"""Time per training step from an alpha-beta model of communication and a FLOP rate.

**Collectives.** A collective over ``n`` ranks moving ``S`` bytes costs, per algorithm,

    t = alpha * L(n) + beta * V(n, S)                      (host: this machine's software stack)
      + alpha_link * L(n) + (V_link(n, S) - tokens) / (efficiency * bandwidth)   (the link)

``L`` is the number of sequential message rounds and ``V`` the bytes the busiest rank sends:
ring/native ``2(n-1)`` rounds of ``S/n`` (all-reduce; half of that for reduce-scatter or
all-gather), butterfly ``2 log2 n`` rounds, direct 2, gather/scatter 2 rounds in which rank 0 moves
``(n-1) S`` each way one after the other. ``alpha`` and ``beta`` are fitted per algorithm to
``distlab bench collectives`` on this machine (loopback: the cost of the software and the kernel's
copies); the link terms describe the network to predict for (its bandwidth, latency and -- for the
emulated cluster, whose links are token-bucket shaped -- the burst a direction that was idle may
send at full speed). ``efficiency`` is TCP's payload share of an Ethernet frame (1448 / 1514), not
a fitted number.

**Compute.** ``t = overhead + flops_per_sample * batch / rate``, with the FLOPs of forward and
backward counted by torch's FLOP counter on the meta device, and ``rate`` (and ``overhead`` when
several batch sizes were measured) fitted per threads-per-rank to one-worker training runs.

**Overlap.** Data parallel with buckets (``bucketed``, ``ddp``) launches a bucket's all-reduce when
its last gradient is ready -- gradients appear during backward in reverse registration order, at
a rate proportional to their bytes -- and runs them one after another; only what is left after
backward is *exposed*. ``allreduce``/``gather-scatter`` and ZeRO-1 communicate after backward
(all exposed); ZeRO-2 reduce-scatters during backward like buckets; ZeRO-3 also all-gathers every
layer before its forward and backward (exposed).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from distlab.errors import ConfigError

TCP_EFFICIENCY = 1448 / 1514  # TCP payload (MSS with timestamps) per Ethernet frame on the wire
ALGORITHMS = ("native", "ring", "butterfly", "direct", "gather_scatter")
TBF_BURST = "512kb"  # tc kilobytes (1024): what a shaped link that was idle may send at full speed (the emulated cluster's)

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """``100mbit``, ``1gbit``, ``10gbit``, ``100gbit``, ``25gbps`` (bits) -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps|b)?\s*", str(text).lower())
    if not m:
        raise ConfigError(f"link bandwidth {text!r}: write it like 100mbit, 10gbit or 100gbit")
    return float(m.group(1)) * _UNITS[m.group(2)] / 8


def parse_seconds(text: str) -> float:
    """``5us``, ``0.1ms``, ``2ms``, ``0.001s`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s)?\s*", str(text).lower())
    if not m:
        raise ConfigError(f"latency {text!r}: write it like 5us, 0.1ms or 2ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]


def parse_bytes(text: str) -> int:
    """``512kb`` (tc's kilobytes: 1024), ``80GiB``, ``1e6`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.e+]+)\s*([kmgt]?)(i?b)?\s*", str(text).lower())
    if not m:
        raise ConfigError(f"size {text!r}: write it like 512kb, 80GiB or 1000000")
    return int(float(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2)])


@dataclass(frozen=True)
class Link:
    """One node's network link (full duplex). ``bandwidth`` in bytes/s; ``None`` = loopback (no link
    beyond the host stack the calibration measured)."""
    bandwidth: float | None = None
    latency: float = 0.0
    burst: int = 0
    efficiency: float = TCP_EFFICIENCY
    name: str = "loopback"

    @classmethod
    def parse(cls, bandwidth: str | None, latency: str | None = None, burst: str | None = None) -> "Link":
        if bandwidth in (None, "", "loopback"):
            return cls()
        return cls(parse_rate(bandwidth), parse_seconds(latency) if latency else 0.0,
                   parse_bytes(burst) if burst else 0, TCP_EFFICIENCY, str(bandwidth))


# ---------------------------------------------------------------------------------- collectives

def rounds(algorithm: str, n: int, kind: str = "all_reduce") -> int:
    """Sequential message rounds of one collective on ``n`` ranks (``send``: one message to a neighbour;
    ``all_to_all``: one to each other rank)."""
    if n <= 1:
        return 0
    if kind in ("send", "all_to_all"):
        return 1 if kind == "send" else n - 1
    half = kind != "all_reduce"
    if algorithm in ("native", "ring", "ring_plain") or ":" in algorithm:  # (a user's own: counted as a ring)
        return (n - 1) * (1 if half else 2)
    if algorithm in ("butterfly", "butterfly_plain"):
        k = int(math.log2(n))
        extra = 0 if 2 ** k == n else 2  # fold the ranks beyond a power of two in, unfold at the end
        return k * (1 if half else 2) + extra
    if algorithm in ("direct", "gather_scatter"):
        return 1 if half else 2
    raise ConfigError(f"unknown collective algorithm {algorithm!r}; choose one of: {', '.join(ALGORITHMS)}")


def volume(algorithm: str, n: int, nbytes: float, kind: str = "all_reduce") -> float:
    """Bytes the busiest rank moves one way (all-reduce; reduce-scatter and all-gather are half; a
    ``send`` or an ``all_to_all``: ``nbytes`` is what the rank sends)."""
    if n <= 1:
        return 0.0
    if kind in ("send", "all_to_all"):
        return nbytes
    if algorithm == "gather_scatter":  # rank 0 receives (n-1) S, then sends (n-1) S
        return (n - 1) * nbytes * (1 if kind != "all_reduce" else 2)
    share = 2 * (n - 1) / n * nbytes
    return share / 2 if kind != "all_reduce" else share


def sent(algorithm: str, n: int, nbytes: float, kind: str = "all_reduce", itemsize: int = 4) -> float:
    """Bytes the first rank of the group sends in one collective (what a run counts on it): the
    volume, but for gather-scatter, where rank 0 sends only the scatter, ``(n-1) S``, and for the
    butterfly's all-reduce, whose halves of an odd number of elements are not equal."""
    if algorithm == "gather_scatter" and n > 1:
        return (n - 1) * nbytes
    if algorithm in ("butterfly", "butterfly_plain") and kind == "all_reduce" and n > 1:
        return itemsize * _butterfly_first_sends(int(nbytes // itemsize), n)
    return volume(algorithm, n, nbytes, kind)


def _butterfly_first_sends(numel: int, n: int) -> int:
    """Elements rank 0 sends in :mod:`distlab.comm.butterfly`'s all-reduce: beyond a power of two it is
    folded into its partner (its whole buffer); else the upper half of its segment at each halving step
    and the kept range back at each doubling step."""
    p = 1 << (n.bit_length() - 1)
    if n > p:
        return numel
    lo, hi, d, total = 0, numel, p // 2, 0
    while d >= 1:
        mid = (lo + hi) // 2
        total += (hi - mid) + (mid - lo)  # the given half now, the kept half in the doubling step
        lo, hi, d = lo, mid, d // 2
    return total


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message round
    beta: float   # seconds per byte of volume
    points: int = 0
    median_rel_err: float | None = None
    max_rel_err: float | None = None

    def to_dict(self) -> dict:
        return {"alpha_s": self.alpha, "beta_s_per_byte": self.beta, "points": self.points,
                "median_rel_err": self.median_rel_err, "max_rel_err": self.max_rel_err}


def fit_alpha_beta(samples: list[tuple[float, float, float]]) -> AlphaBeta:
    """Least squares of ``t = alpha * L + beta * V`` over (L, V, t), each weighted by 1/t (so small
    and large messages count alike: it minimises relative error); both kept non-negative."""
    if not samples:
        raise ConfigError("no measurements to fit")
    rows = [(l / t, v / t) for l, v, t in samples]  # target 1 in every row
    a11 = sum(x * x for x, _ in rows)
    a12 = sum(x * y for x, y in rows)
    a22 = sum(y * y for _, y in rows)
    b1, b2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = a11 * a22 - a12 * a12
    alpha, beta = ((b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det) if det > 1e-30 else (-1, -1)
    if alpha < 0 or beta < 0:  # a one-parameter fit on the side that stays positive
        fits = []
        if a11 > 0:
            fits.append((b1 / a11, 0.0))
        if a22 > 0:
            fits.append((0.0, b2 / a22))
        alpha, beta = min(fits, key=lambda ab: sum((ab[0] * x + ab[1] * y - 1) ** 2 for x, y in rows))
    errs = [abs(alpha * l + beta * v - t) / t for l, v, t in samples]
    return AlphaBeta(alpha, beta, len(samples), statistics.median(errs), max(errs))


# ---------------------------------------------------------------------------------- compute

@dataclass(frozen=True)
class Compute:
    """Forward + backward + optimizer step of one rank: ``overhead + flops / rate``."""
    rate: float          # FLOP/s
    overhead: float      # seconds per step that do not scale with the batch
    threads: int
    points: int = 0
    median_rel_err: float | None = None
    max_rel_err: float | None = None
    scaled_from: int | None = None  # not calibrated at `threads`: the rate scaled from this many

    def time(self, flops: float) -> float:
        return self.overhead + flops / self.rate

    def to_dict(self) -> dict:
        return {"flops_per_s": self.rate, "overhead_s": self.overhead, "threads_per_rank": self.threads,
                "points": self.points, "median_rel_err": self.median_rel_err, "max_rel_err": self.max_rel_err}


def fit_compute(samples: list[tuple[float, float]], threads: int) -> Compute:
    """Fit ``t = overhead + flops / rate`` to (flops per step, seconds per step) of one-worker runs.
    One distinct FLOP count fits the rate alone (overhead 0) to the median time."""
    if not samples:
        raise ConfigError("no one-worker training runs to fit the compute rate to")
    xs = {round(f) for f, _ in samples}
    if len(xs) >= 2:
        mx = statistics.fmean(f for f, _ in samples)
        my = statistics.fmean(t for _, t in samples)
        slope = sum((f - mx) * (t - my) for f, t in samples) / sum((f - mx) ** 2 for f, _ in samples)
        overhead = my - slope * mx
        if slope > 0 and overhead >= 0:
            rate = 1 / slope
        else:
            overhead, rate = 0.0, sum(f for f, _ in samples) / sum(t for _, t in samples)
    else:  # repeats of one workload: its median time (robust to a slow outlier)
        overhead, rate = 0.0, samples[0][0] / statistics.median(t for _, t in samples)
    errs = [abs(overhead + f / rate - t) / t for f, t in samples]
    return Compute(rate, overhead, threads, len(samples), statistics.median(errs), max(errs))
