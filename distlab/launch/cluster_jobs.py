"""Work on an emulated cluster (:mod:`distlab.launch.cluster` makes one): a command on every node, and
the faults that drills and elastic runs need.

``run -- CMD`` starts ``CMD`` once per node inside its namespace (in parallel), with
``GLOO_SOCKET_IFNAME=eth0`` so collectives use the emulated link, and -- when ``CMD`` is a distlab
command -- ``--node-rank I --master-addr NODE0 --master-port P`` appended, so rendezvous and every
collective really cross the emulated network. ``{node_rank}``, ``{node_addr}``, ``{master_addr}``
and ``{nnodes}`` in ``CMD`` are replaced for other programs. Output lines are prefixed with the node.

Faults, for elastic training and fault drills: ``kill-node I`` SIGKILLs every process of node
``I`` (a machine that died; the running ``run`` does not count it as a failure), ``revive-node I``
starts the last ``run`` command on it again (an elastic job takes it in at its next
re-rendezvous), ``cut-link I`` drops every packet to and from it (netem loss 100%: a pulled cable,
the processes still alive) and ``mend-link I`` restores the link.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from distlab.errors import ConfigError
from distlab.launch.cluster import MASTER_PORT, TBF_BURST, Cluster, ClusterError, Node, check_capable, shell


def _is_distlab(cmd: list[str]) -> bool:
    exe = os.path.basename(cmd[0]) if cmd else ""
    return exe == "distlab" or (exe.startswith("python") and cmd[1:3] == ["-m", "distlab"])


def node_command(cluster: Cluster, node: Node, cmd: list[str], master_port: int = MASTER_PORT) -> list[str]:
    """``cmd`` for ``node``: placeholders filled, distlab launch flags added, inside its namespace."""
    values = {"node_rank": node.rank, "node_addr": node.addr, "master_addr": cluster.master_addr,
              "nnodes": len(cluster.nodes)}
    args = [a.format(**values) if "{" in a else a for a in cmd]
    if _is_distlab(args):
        given = set(args)
        if "--node-rank" not in given:
            args += ["--node-rank", str(node.rank)]
        if "--master-addr" not in given and "--master-ip" not in given:
            args += ["--master-addr", cluster.master_addr]
        if "--master-port" not in given:
            args += ["--master-port", str(master_port)]
        if "--nnodes" not in given:
            args += ["--nnodes", str(len(cluster.nodes))]
        if "--rdzv-endpoint" in given:  # the node at the endpoint hosts the c10d store (torchrun cannot tell:
            # every namespace has the same hostname)
            host = args[args.index("--rdzv-endpoint") + 1].rsplit(":", 1)[0]
            setting = f"is_host={'true' if host == node.addr else 'false'}"
            if "--rdzv-conf" in given:
                at = args.index("--rdzv-conf") + 1
                if "is_host" not in args[at]:
                    args[at] = f"{args[at]},{setting}"
            else:
                args += ["--rdzv-conf", setting]
            if "--local-addr" not in given:  # the workers find rank 0's store there (not at "localhost")
                args += ["--local-addr", node.addr]
    env = ["env", "GLOO_SOCKET_IFNAME=eth0", f"DISTLAB_NODE_RANK={node.rank}", f"DISTLAB_NODE_ADDR={node.addr}",
           f"MASTER_ADDR={cluster.master_addr}", f"DISTLAB_CLUSTER_NODES={len(cluster.nodes)}",
           f"DISTLAB_CLUSTER_LINK={cluster.bandwidth or 'unshaped'}", f"DISTLAB_CLUSTER_DELAY={cluster.delay or ''}",
           f"DISTLAB_CLUSTER_BURST={TBF_BURST}"]
    if node.cores:
        env += [f"OMP_NUM_THREADS={len(node.cores)}"]
    pin = ["taskset", "-c", ",".join(map(str, node.cores))] if node.cores else []
    return ["ip", "netns", "exec", node.netns, *env, *pin, *args]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def run(cmd: list[str], name: str = "dl", timeout: float | None = None, out=None) -> int:
    """Run ``cmd`` on every node at once, its output to ``out`` (stdout) prefixed with the node;
    return the first non-zero exit code (0 if all succeed)."""
    if not cmd:
        raise ConfigError("distlab cluster run needs a command after --, e.g. "
                          "distlab cluster run -- distlab train --nproc-per-node 1")
    check_capable()
    cluster = _loaded(name)
    cluster.command, cluster.killed = list(cmd), []
    cluster.save()
    procs, pumps = [], []
    for node in cluster.nodes:
        p = subprocess.Popen(node_command(cluster, node, cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1)
        t = threading.Thread(target=_pump, args=(p.stdout, f"[node {node.rank}] ", out or sys.stdout), daemon=True)
        t.start()
        procs.append(p)
        pumps.append(t)
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise ClusterError(f"the command was still running on the cluster after {timeout:g}s and was killed")
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    for t in pumps:
        t.join(timeout=5)
    killed = set(_loaded(name).killed)  # a node killed on purpose is not a failure of the command
    return next((c for node, c in zip(cluster.nodes, codes) if c and node.rank not in killed), 0)


# --------------------------------------------------------------------------- faults


def _loaded(name: str) -> Cluster:
    cluster = Cluster.load(name)
    if cluster is None:
        raise ClusterError(f"no cluster {name!r} is up: `distlab cluster up --nodes K` first")
    return cluster


def _node(cluster: Cluster, index: int) -> Node:
    if not 0 <= index < len(cluster.nodes):
        raise ConfigError(f"node {index}: cluster {cluster.name!r} has nodes 0 to {len(cluster.nodes) - 1}")
    return cluster.nodes[index]


def kill_node(index: int, name: str = "dl") -> list[int]:
    """SIGKILL every process in node ``index``'s namespace (a machine that died); returns their pids.
    The running ``cluster run`` then treats that node's exit as intended."""
    check_capable()
    cluster = _loaded(name)
    node = _node(cluster, index)
    if index not in cluster.killed:
        cluster.killed.append(index)
        cluster.save()  # before the kill: `run` reads it when the node's command ends
    pids = [int(p) for p in shell("ip", "netns", "pids", node.netns).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def revive_node(index: int, name: str = "dl", timeout: float | None = None, out=None) -> int:
    """Start the last ``cluster run`` command again on node ``index`` (a machine back from the dead:
    an elastic job takes it in at its next re-rendezvous); runs until it ends, returns its exit code."""
    check_capable()
    cluster = _loaded(name)
    node = _node(cluster, index)
    if not cluster.command:
        raise ClusterError(f"cluster {name!r} has run nothing yet: revive-node starts the last `cluster run` command")
    if shell("ip", "netns", "pids", node.netns).stdout.split():
        raise ClusterError(f"node {index} still has processes running: kill-node {index} first")
    # it stays in `killed`: the running `cluster run` still holds the killed process's exit code
    p = subprocess.Popen(node_command(cluster, node, cluster.command), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, bufsize=1)
    pump = threading.Thread(target=_pump, args=(p.stdout, f"[node {index}] ", out or sys.stdout), daemon=True)
    pump.start()
    try:
        code = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise ClusterError(f"node {index}'s command was still running after {timeout:g}s and was killed") from None
    pump.join(timeout=5)
    return code


def cut_link(index: int, name: str = "dl", restore: bool = False) -> None:
    """Pull node ``index``'s cable: its port on the bridge goes down, so every frame to and from it is
    dropped while the node itself stays up (its interface, addresses and routes unchanged: its
    sockets see silence, not an error -- like a dead switch port). ``restore`` plugs it back in."""
    check_capable()
    cluster = _loaded(name)
    node = _node(cluster, index)
    shell("ip", "link", "set", "dev", node.host_if, "up" if restore else "down")
    cluster.cut = sorted(set(cluster.cut) - {index}) if restore else sorted(set(cluster.cut) | {index})
    cluster.save()
