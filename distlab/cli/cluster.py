"""``distlab cluster`` (an emulated multi-node cluster) and ``distlab demo``."""

from __future__ import annotations

import functools
import sys

import click

from distlab.cli.options import COUNT, NONNEGATIVE, SECONDS, launch_options, run_distributed


@click.group()
def cluster():
    """An emulated multi-node cluster on this machine (network namespaces, a bridge, tc shaping; root)."""


@cluster.command("up")
@click.option("--nodes", type=COUNT, required=True, help="Number of nodes (network namespaces).")
@click.option("--bandwidth", default="1gbit", show_default=True, help="Link rate of every node (tc rate: 100mbit, 10gbit).")
@click.option("--delay", default=None, help="One-way link latency added with netem (e.g. 0.1ms).")
@click.option("--cores-per-node", type=COUNT, default=None, help="Pin each node's processes to this many cores.")
@click.option("--name", default="dl", show_default=True, help="Cluster name (1-6 letters/digits).")
def cluster_up(nodes, bandwidth, delay, cores_per_node, name):
    """Create K nodes on their own addresses behind one bridge, links shaped to --bandwidth."""
    from distlab.launch import cluster as c
    made = c.up(nodes, None if bandwidth == "none" else bandwidth, delay, cores_per_node, name)
    for node in made.nodes:
        cores = f", cores {','.join(map(str, node.cores))}" if node.cores else ""
        click.echo(f"node {node.rank}: {node.addr} in netns {node.netns}{cores}")
    click.echo(f"links: {made.bandwidth or 'unshaped'}{f', delay {made.delay}' if made.delay else ''}; "
               f"master {made.master_addr}. Next: distlab cluster run --name {name} -- distlab train "
               f"--nproc-per-node 1 ...")


@cluster.command("down")
@click.option("--name", default="dl", show_default=True)
def cluster_down(name):
    """Remove everything `up` created (also after a crash)."""
    from distlab.launch import cluster as c
    c.check_capable()
    if c.Cluster.load(name) is None:
        click.echo(f"no cluster {name!r} was up")
        return
    removed = c.down(name)
    for netns, pids in removed.ended.items():
        click.echo(f"ended {len(pids)} process(es) still running in {netns} ({', '.join(map(str, pids))})")
    for what, why in removed.left:
        click.echo(f"left {what}: {why}")
    click.echo(f"removed {', '.join(removed)}" if removed else "removed nothing")


@cluster.command("status")
@click.option("--name", default="dl", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON.")
def cluster_status(name, as_json):
    """What is up: nodes, addresses, link rate."""
    import json

    from distlab.launch import cluster as c

    state = c.status(name)
    if as_json:
        click.echo(json.dumps(state, indent=1))
    elif state is None:
        click.echo(f"no cluster {name!r} is up")
    else:
        click.echo(f"cluster {name}: {len(state['nodes'])} nodes, links {state['bandwidth'] or 'unshaped'}, "
                   f"master {state['master_addr']}")
        for node in state["nodes"]:
            click.echo(f"  node {node['rank']}: {node['addr']} netns {node['netns']}"
                       f"{'' if node['present'] else ' (MISSING)'}")


@cluster.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--name", default="dl", show_default=True)
@click.option("--timeout", type=SECONDS, default=None, help="Kill the command on every node after this many seconds.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def cluster_run(name, timeout, cmd):
    """Run CMD on every node at once (distlab commands get --node-rank/--master-addr/--nnodes)."""
    from distlab.launch import cluster_jobs as c_jobs
    sys.exit(c_jobs.run(list(cmd), name, timeout))


@cluster.command("kill-node")
@click.argument("index", type=NONNEGATIVE)
@click.option("--name", default="dl", show_default=True)
def cluster_kill_node(index, name):
    """SIGKILL every process on node INDEX (a machine that died)."""
    from distlab.launch import cluster_jobs as c_jobs
    pids = c_jobs.kill_node(index, name)
    click.echo(f"node {index}: killed {len(pids)} process(es)" + (f" ({', '.join(map(str, pids))})" if pids else ""))


@cluster.command("revive-node")
@click.argument("index", type=NONNEGATIVE)
@click.option("--name", default="dl", show_default=True)
@click.option("--timeout", type=SECONDS, default=None, help="Kill the command after this many seconds.")
def cluster_revive_node(index, name, timeout):
    """Start the last `cluster run` command again on node INDEX (an elastic job takes it in)."""
    from distlab.launch import cluster_jobs as c_jobs
    sys.exit(c_jobs.revive_node(index, name, timeout))


@cluster.command("cut-link")
@click.argument("index", type=NONNEGATIVE)
@click.option("--name", default="dl", show_default=True)
def cluster_cut_link(index, name):
    """Pull node INDEX's cable (its bridge port down: every frame dropped, the node up); mend-link restores it."""
    from distlab.launch import cluster_jobs as c_jobs
    c_jobs.cut_link(index, name)
    click.echo(f"node {index}: link cut (its bridge port is down: every frame to and from it is dropped)")


@cluster.command("mend-link")
@click.argument("index", type=NONNEGATIVE)
@click.option("--name", default="dl", show_default=True)
def cluster_mend_link(index, name):
    """Plug node INDEX's cable back in (its shaping unchanged)."""
    from distlab.launch import cluster_jobs as c_jobs
    c_jobs.cut_link(index, name, restore=True)
    click.echo(f"node {index}: link restored")


# --------------------------------------------------------------------------- demo


@click.group()
def demo():
    """Small runnable demonstrations of the building blocks."""


@demo.command("ordered-print")
@launch_options
def demo_ordered_print(**kw):
    """Every rank prints one line; the lines come out in rank order, always."""
    from distlab.tools.demos import ordered_print_demo
    run_distributed(kw, ordered_print_demo)


@demo.command("p2p")
@launch_options
def demo_p2p(**kw):
    """Blocking and non-blocking send/recv of a 3x4 tensor, then an all-reduce (needs 2+ ranks)."""
    from distlab.tools.demos import p2p_demo
    run_distributed(kw, p2p_demo)


@demo.command("sampler")
@click.option("--length", type=NONNEGATIVE, default=10, show_default=True, help="Dataset length (item i is 10*i).")
@click.option("--num-replicas", type=COUNT, default=None, help="Replicas to show (default: the world size).")
@click.option("--shuffle/--no-shuffle", default=False, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--epoch", type=NONNEGATIVE, default=0, show_default=True)
@click.option("--drop-last/--no-drop-last", default=False, show_default=True, help="DistributedSampler drop_last.")
@click.option("--batch-size", type=COUNT, default=2, show_default=True, help="BatchSampler batch size.")
@click.option("--batch-drop-last/--no-batch-drop-last", default=False, show_default=True,
              help="BatchSampler drop_last.")
@launch_options
def demo_sampler(**kw):
    """How DistributedSampler + BatchSampler split a dataset, and how local batches make the global one."""
    from distlab.tools.demos import sampler_demo
    opts = {k: kw.pop(k) for k in ("length", "num_replicas", "shuffle", "seed", "epoch", "drop_last",
                                    "batch_size", "batch_drop_last")}
    run_distributed(kw, functools.partial(sampler_demo, **opts))


# --------------------------------------------------------------------------- bench
