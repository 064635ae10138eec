"""An emulated cluster on one Linux machine: one network namespace per node, a bridge between them.

``distlab cluster up --nodes K --bandwidth 1gbit`` creates, for node ``i``:

* the network namespace ``dl-NAME-nI`` with its loopback up;
* a veth pair: ``eth0`` inside the namespace, its peer ``dlNAME-I`` on the host, enslaved to the
  bridge ``dlbr-NAME`` -- every node reaches every other node through the bridge, as hosts on one
  switch;
* the address ``A.B.(I+1).1/16`` in a /16 that nothing on this host uses yet (the first free one of
  ``10.77.0.0/16``, ``10.78.0.0/16``, ...: checked against the host's addresses and routes, which
  include every other cluster's): each node in its own /24 block, so ``10.77.1.1`` is node 0,
  ``10.77.2.1`` node 1, and so on (the host's bridge has ``A.B.0.254``);
* bandwidth shaping with ``tc ... tbf rate RATE`` on both ends of the veth pair, so each node's
  link is full duplex at ``RATE`` (optionally ``netem delay`` in front for a link latency);
* where asked (``--cores-per-node C``), a set of CPU cores its processes are pinned to (``taskset``).

Running a command on every node and the faults (kill-node, revive-node, cut-link) are
:mod:`distlab.launch.cluster_jobs`.

**Touches only what it made.** ``up`` refuses a name that exists already (a bridge, an interface or
a namespace of the same name), and records each object in the state file as soon as it exists,
with its identity: a link's alias ``distlab:NAME:TOKEN`` (TOKEN random per ``up``), a namespace's
inode. ``down`` -- also after a crash half-way through ``up`` -- first ends the processes still
running in its namespaces (``kill -9`` of a ``cluster run`` leaves its nodes' commands running),
then deletes exactly those objects whose identity still matches, and says what it ended, removed
and left alone. Needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distlab.errors import ConfigError, DistlabError
from distlab.plan.machine import TBF_BURST

SUBNET = ipaddress.ip_network("10.77.0.0/16")  # the first candidate; up() takes the first free /16 from here
SUBNETS = 50  # candidates: 10.77.0.0/16 .. 10.126.0.0/16
MASTER_PORT = 29500
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")


class ClusterError(DistlabError):
    exit_code = 2



def state_path(name: str) -> Path:
    base = Path(os.environ.get("DISTLAB_CLUSTER_STATE_DIR") or "/run/distlab")
    return base / f"cluster-{name}.json"


@dataclass
class Node:
    rank: int
    netns: str
    host_if: str
    addr: str
    cores: list[int] = field(default_factory=list)


@dataclass
class Cluster:
    name: str
    bandwidth: str | None
    delay: str | None
    bridge: str
    nodes: list[Node] = field(default_factory=list)
    command: list[str] = field(default_factory=list)  # the last `run`'s command (what `revive-node` starts again)
    killed: list[int] = field(default_factory=list)  # nodes `kill-node` stopped since that run began
    cut: list[int] = field(default_factory=list)  # nodes whose link `cut-link` dropped
    subnet: str = str(SUBNET)
    token: str = ""  # this `up`'s mark on what it made (links' alias distlab:NAME:TOKEN)
    created: list[dict] = field(default_factory=list)  # {"kind": "link"|"netns", "name", "id"}, in order made

    @property
    def marker(self) -> str:
        return f"distlab:{self.name}:{self.token}"

    @property
    def master_addr(self) -> str:
        return self.nodes[0].addr

    def save(self) -> None:
        path = state_path(self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, name: str) -> "Cluster | None":
        path = state_path(name)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(data["name"], data["bandwidth"], data.get("delay"), data["bridge"],
                       [Node(**n) for n in data["nodes"]], list(data.get("command", [])),
                       list(data.get("killed", [])), list(data.get("cut", [])), data.get("subnet", str(SUBNET)),
                       str(data.get("token", "")), [dict(c) for c in data.get("created", [])])
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ClusterError(f"the cluster state file {path} is unreadable ({exc}); remove the namespaces "
                               f"dl-{name}-n* and the bridge dlbr-{name} by hand, then delete the file") from None


# --------------------------------------------------------------------------- system


def shell(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def check_capable() -> None:
    """Root and iproute2, or a clear error naming what is missing."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"distlab cluster needs iproute2 ({' and '.join(missing)} not found): "
                           f"apt-get install iproute2")
    if os.geteuid() != 0:
        raise ClusterError("distlab cluster creates network namespaces, veth pairs and a bridge, which needs "
                           "root (CAP_NET_ADMIN): run it with sudo, or as root in a container started with "
                           "--cap-add NET_ADMIN")


def _validate_name(name: str) -> None:
    if not re.fullmatch(r"[a-z0-9]{1,6}", name):
        raise ConfigError(f"cluster name {name!r}: use 1-6 lowercase letters or digits (it goes into "
                          f"interface names, which Linux limits to 15 characters)")


_DELAY = re.compile(r"^\d+(\.\d+)?(s|sec|secs|ms|msec|msecs|us|usec|usecs)$")


def _validate_delay(flag: str, value: str | None) -> None:
    if value is not None and not _DELAY.match(value.lower()):
        raise ConfigError(f"{flag} {value!r}: write a tc time such as 100us, 0.1ms or 5ms")


def validate_rate(flag: str, value: str | None) -> None:
    if value is not None and not _RATE.match(value.lower()):
        raise ConfigError(f"{flag} {value!r}: write a tc rate such as 100mbit, 1gbit or 10gbit")


def _shape(prefix: list[str], dev: str, rate: str | None, delay: str | None) -> None:
    """tbf at ``rate`` on ``dev``'s egress (behind netem ``delay`` if given)."""
    if not rate and not delay:
        return
    parent = ["root"]
    if delay:
        shell(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
        parent = ["parent", "1:1"]
    if rate:
        # burst: at least one jumbo of data per timer tick at this rate; latency bounds the queue.
        shell(*prefix, "tc", "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", rate,
            "burst", TBF_BURST, "latency", "100ms")


def up(nodes: int, bandwidth: str | None = "1gbit", delay: str | None = None, cores_per_node: int | None = None,
       name: str = "dl") -> Cluster:
    """Create the emulated cluster (see the module docstring); refuse if ``name`` already exists."""
    _validate_name(name)
    validate_rate("--bandwidth", bandwidth)
    _validate_delay("--delay", delay)
    if nodes < 1 or nodes > 250:
        raise ConfigError(f"--nodes must be between 1 and 250, not {nodes}")
    ncores = os.cpu_count() or 1
    if cores_per_node is not None and not 1 <= cores_per_node <= ncores:
        raise ConfigError(f"--cores-per-node {cores_per_node}: this machine has {ncores} cores")
    check_capable()
    if Cluster.load(name) is not None:
        raise ClusterError(f"cluster {name!r} is already up ({state_path(name)}); `distlab cluster down` first")
    bridge = f"dlbr-{name}"
    links = [bridge] + [n for i in range(nodes) for n in (f"dl{name}-{i}", f"dlp{name}-{i}")]
    taken = [n for n in links if _link_id(n) is not None] + \
        [f"network namespace {ns}" for ns in (f"dl-{name}-n{i}" for i in range(nodes)) if _netns_id(ns) is not None]
    if taken:
        raise ClusterError(f"{', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''} exist(s) already and "
                           f"distlab did not make {'them' if len(taken) > 1 else 'it'} for this cluster: choose "
                           f"another --name (nothing was changed)")
    subnet = free_subnet()
    cluster = Cluster(name, bandwidth, delay, bridge, subnet=str(subnet), token=os.urandom(4).hex())
    cluster.save()  # recorded before created: `down` can always clean up
    try:
        shell("ip", "link", "add", cluster.bridge, "type", "bridge")
        _made(cluster, "link", cluster.bridge)
        shell("ip", "addr", "add", f"{subnet[254]}/{subnet.prefixlen}", "dev", cluster.bridge)
        shell("ip", "link", "set", cluster.bridge, "up")
        for i in range(nodes):
            cores = ([(i * cores_per_node + c) % ncores for c in range(cores_per_node)]
                     if cores_per_node else [])
            node = Node(i, f"dl-{name}-n{i}", f"dl{name}-{i}", str(subnet[256 * (i + 1) + 1]), cores)
            cluster.nodes.append(node)
            cluster.save()
            ns = ["ip", "netns", "exec", node.netns]
            shell("ip", "netns", "add", node.netns)
            _made(cluster, "netns", node.netns)
            shell("ip", "link", "add", node.host_if, "type", "veth", "peer", "name", f"dlp{name}-{i}")
            _made(cluster, "link", node.host_if)  # its peer goes with it (and with the namespace)
            shell("ip", "link", "set", f"dlp{name}-{i}", "netns", node.netns)
            shell(*ns, "ip", "link", "set", f"dlp{name}-{i}", "name", "eth0")
            shell(*ns, "ip", "addr", "add", f"{node.addr}/{subnet.prefixlen}", "dev", "eth0")
            shell(*ns, "ip", "link", "set", "eth0", "up")
            shell(*ns, "ip", "link", "set", "lo", "up")
            shell("ip", "link", "set", node.host_if, "master", cluster.bridge)
            shell("ip", "link", "set", node.host_if, "up")
            _shape(ns, "eth0", bandwidth, delay)       # node -> switch
            _shape([], node.host_if, bandwidth, delay)  # switch -> node
    except BaseException:
        down(name)
        raise
    return cluster


def _link_id(name: str) -> dict | None:
    """A host link's ifindex and alias (None: no such link)."""
    proc = shell("ip", "-j", "link", "show", "dev", name, check=False)
    if proc.returncode != 0:
        return None
    try:
        info = json.loads(proc.stdout)[0]
    except (ValueError, IndexError, KeyError):
        return None
    return {"ifindex": info.get("ifindex"), "alias": info.get("ifalias")}


def _netns_id(name: str) -> int | None:
    """The inode of a named network namespace (None: no such namespace)."""
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _made(cluster: Cluster, kind: str, name: str) -> None:
    """Mark and record an object ``up`` has just created (links: the alias; namespaces: the inode)."""
    if kind == "link":
        shell("ip", "link", "set", "dev", name, "alias", cluster.marker)
        ident = _link_id(name)["ifindex"]
    else:
        ident = _netns_id(name)
    cluster.created.append({"kind": kind, "name": name, "id": ident})
    cluster.save()


def _ours(cluster: Cluster, record: dict) -> bool | None:
    """Whether a recorded object is still the one ``up`` made (None: it is gone)."""
    if record["kind"] == "netns":
        ino = _netns_id(record["name"])
        return None if ino is None else ino == record["id"]
    link = _link_id(record["name"])
    return None if link is None else (link["ifindex"] == record["id"] and link["alias"] == cluster.marker)


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this host has an address in or a route to (other clusters' included)."""
    found = []
    for args in (("ip", "-j", "-4", "addr", "show"), ("ip", "-j", "-4", "route", "show", "table", "all")):
        try:
            entries = json.loads(shell(*args, check=False).stdout or "[]")
        except ValueError:
            continue
        for entry in entries:
            for info in entry.get("addr_info", []):
                with contextlib.suppress(ValueError, KeyError):
                    found.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", strict=False))
            dst = entry.get("dst")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    found.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return found


def free_subnet() -> ipaddress.IPv4Network:
    """The first /16 of 10.77.0.0/16, 10.78.0.0/16, ... that no address or route of this host overlaps."""
    used = _networks_in_use()
    first = int(SUBNET.network_address)
    for k in range(SUBNETS):
        candidate = ipaddress.ip_network((first + (k << 16), 16))
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return candidate
    raise ClusterError(f"every candidate network 10.77.0.0/16 .. 10.{76 + SUBNETS}.0.0/16 overlaps an address or "
                       f"route of this host: take some clusters down (distlab cluster down --name N)")


@contextlib.contextmanager
def private(nodes: int, bandwidth: str | None, cores_per_node: int | None, name: str):
    """A cluster of its own for a drill or benchmark: its state in a temporary directory (so it never
    meets the user's clusters), brought up, yielded, and taken down whatever happens."""
    state, old = tempfile.mkdtemp(prefix="distlab-cluster-"), os.environ.get("DISTLAB_CLUSTER_STATE_DIR")
    os.environ["DISTLAB_CLUSTER_STATE_DIR"] = state
    try:
        up(nodes, bandwidth, None, cores_per_node, name)
        try:
            yield
        finally:
            down(name)
    finally:
        if old is None:
            os.environ.pop("DISTLAB_CLUSTER_STATE_DIR", None)
        else:
            os.environ["DISTLAB_CLUSTER_STATE_DIR"] = old
        shutil.rmtree(state, ignore_errors=True)


class Removed(list):
    """What ``down`` removed (the list), the processes it ended (``ended``: netns -> pids) and what it
    left because distlab did not make it (``left``: (name, why))."""

    def __init__(self):
        super().__init__()
        self.ended: dict[str, list[int]] = {}
        self.left: list[tuple[str, str]] = []


def _end_processes(netns: str) -> list[int]:
    """SIGTERM every process in ``netns``, SIGKILL what is left after 3 s; returns their pids."""
    import time
    pids = [int(p) for p in shell("ip", "netns", "pids", netns, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if _alive(p)]
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.time() + 3
        while sig == signal.SIGTERM and time.time() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.05)
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def down(name: str = "dl") -> Removed:
    """End the processes in the cluster's namespaces, then remove every object ``up`` recorded that
    is still the one it made (and the state file); see :class:`Removed`."""
    cluster = Cluster.load(name)
    removed = Removed()
    if cluster is None:
        return removed
    if not cluster.created and (cluster.nodes or cluster.bridge):  # a state file of an older distlab
        removed.left += [(n, "recorded without proof that distlab made it: remove it by hand if it is this "
                             "cluster's") for n in [cluster.bridge] + [node.netns for node in cluster.nodes]]
    for record in cluster.created:
        if record["kind"] == "netns" and _ours(cluster, record):
            pids = _end_processes(record["name"])
            if pids:
                removed.ended[record["name"]] = pids
    for record in reversed(cluster.created):  # the namespaces take their veth ends with them
        ours = _ours(cluster, record)
        if ours is None:
            continue  # gone already (a veth pair goes with its namespace)
        if not ours:
            removed.left.append((record["name"], "not the one this cluster made (another object of that name now)"))
            continue
        cmd = ("ip", "netns", "del", record["name"]) if record["kind"] == "netns" else \
            ("ip", "link", "del", "dev", record["name"])
        done = shell(*cmd, check=False).returncode == 0
        if done and (record["kind"] == "netns" or record["name"] == cluster.bridge):
            removed.append(record["name"])
    state_path(name).unlink(missing_ok=True)
    return removed


def status(name: str = "dl") -> dict | None:
    """The cluster as recorded, and whether each namespace is really there."""
    cluster = Cluster.load(name)
    if cluster is None:
        return None
    present = set(shell("ip", "netns", "list", check=False).stdout.split())
    out = asdict(cluster)
    out["master_addr"] = cluster.master_addr if cluster.nodes else None
    for node in out["nodes"]:
        node["present"] = node["netns"] in present
    return out
