"""The emulated cluster: real network namespaces, veth pairs, a bridge and tc shaping.

Tests that need root and iproute2 skip (saying why) where network namespaces cannot be created.
"""

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from distlab.launch import cluster as c

from distlab.launch import cluster_jobs as c_jobs
from distlab.plan import machine
from distlab.errors import ConfigError
from tests.conftest import communicate_patiently, patience


def _why_not() -> str | None:
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


WHY_NOT = _why_not()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=f"distlab cluster cannot run here: {WHY_NOT}")


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_CLUSTER_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def _name() -> str:
    return f"t{os.getpid() % 100000}"


def test_node_command_adds_launch_flags_and_fills_placeholders():
    cluster = c.Cluster("x", "1gbit", None, "dlbr-x", [c.Node(0, "dl-x-n0", "dlx-0", "10.77.1.1", [0]),
                                                         c.Node(1, "dl-x-n1", "dlx-1", "10.77.2.1", [1])])
    cmd = c_jobs.node_command(cluster, cluster.nodes[1], ["distlab", "train", "--nproc-per-node", "1"])
    assert cmd[:4] == ["ip", "netns", "exec", "dl-x-n1"]
    assert "GLOO_SOCKET_IFNAME=eth0" in cmd and cmd[cmd.index("taskset") + 2] == "1"
    tail = cmd[cmd.index("train"):]
    assert tail[tail.index("--node-rank") + 1] == "1" and tail[tail.index("--master-addr") + 1] == "10.77.1.1"
    assert tail[tail.index("--nnodes") + 1] == "2"
    other = c_jobs.node_command(cluster, cluster.nodes[0], ["echo", "{node_rank}@{node_addr}->{master_addr}"])
    assert other[-2:] == ["echo", "0@10.77.1.1->10.77.1.1"]


def test_bad_cluster_flags_are_refused():
    with pytest.raises(ConfigError, match="tc rate"):
        c.up(2, bandwidth="fast")
    with pytest.raises(ConfigError, match="1-6 lowercase"):
        c.up(2, name="Way-Too-Long")
    with pytest.raises(ConfigError, match="--nodes"):
        c.up(0)


@needs_netns
def test_up_status_down_and_cleanup_after_a_crash(state_dir, monkeypatch):
    name = _name()
    made = c.up(2, bandwidth="100mbit", name=name)
    try:
        st = c.status(name)
        assert [n["present"] for n in st["nodes"]] == [True, True] and st["master_addr"] == made.master_addr
        assert made.master_addr.endswith(".1.1") and made.nodes[1].addr.endswith(".2.1")
        qdisc = subprocess.run(["ip", "netns", "exec", made.nodes[1].netns, "tc", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        with pytest.raises(c.ClusterError, match="already up"):
            c.up(2, name=name)
    finally:
        removed = c.down(name)
    assert made.nodes[0].netns in removed and made.bridge in removed
    assert made.nodes[0].netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert c.status(name) is None

    # A failure half-way through `up` (here: shaping node 1) leaves nothing behind.
    real = c.shell

    def fail_on_second_tc(*args, check=True):
        if "tc" in args and "dl-" + name + "-n1" in args:
            raise c.ClusterError("simulated crash")
        return real(*args, check=check)
    monkeypatch.setattr(c, "shell", fail_on_second_tc)
    with pytest.raises(c.ClusterError, match="simulated"):
        c.up(2, name=name)
    monkeypatch.setattr(c, "shell", real)
    links = subprocess.run(["ip", "link", "show"], capture_output=True, text=True).stdout
    assert f"dlbr-{name}" not in links and f"dl{name}-0" not in links
    assert not c.state_path(name).exists()


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@needs_netns
def test_the_cluster_touches_only_what_it_made(state_dir):
    name = _name()
    _ip("link", "add", f"dlbr-{name}", "type", "bridge")  # the user's own bridge, by chance of that name
    _ip("netns", "add", f"dl-{name}-n1")
    try:
        with pytest.raises(c.ClusterError, match=f"dlbr-{name}, network namespace dl-{name}-n1 exist"):
            c.up(2, name=name)
        assert _ip("link", "show", f"dlbr-{name}", check=False).returncode == 0  # the rollback did not delete it
        assert f"dl-{name}-n1" in _ip("netns", "list").stdout and not c.state_path(name).exists()
        # A crafted state file naming someone else's bridge and namespace: down leaves them alone.
        state_dir.mkdir(parents=True, exist_ok=True)
        c.Cluster(name, None, None, f"dlbr-{name}", [c.Node(0, f"dl-{name}-n1", f"dl{name}-0", "10.77.1.1")],
                  token="feed", created=[{"kind": "link", "name": f"dlbr-{name}", "id": 1},
                                         {"kind": "netns", "name": f"dl-{name}-n1", "id": 1}]).save()
        removed = c.down(name)
        assert list(removed) == [] and {n for n, _ in removed.left} == {f"dlbr-{name}", f"dl-{name}-n1"}
        assert _ip("link", "show", f"dlbr-{name}", check=False).returncode == 0
        assert f"dl-{name}-n1" in _ip("netns", "list").stdout
    finally:
        _ip("link", "del", f"dlbr-{name}", check=False)
        _ip("netns", "del", f"dl-{name}-n1", check=False)


@needs_netns
def test_down_ends_the_processes_a_killed_run_left_and_clusters_get_their_own_networks(state_dir, run_cli):
    import time
    first, second = _name(), f"u{os.getpid() % 100000}"
    a = c.up(1, bandwidth=None, name=first)
    try:
        b = c.up(1, bandwidth=None, name=second)
        try:
            nets = [ipaddress.ip_network(x.subnet) for x in (a, b)]
            assert not nets[0].overlaps(nets[1]) and ipaddress.ip_address(b.master_addr) in nets[1]
        finally:
            c.down(second)
        # What `kill -9` of `cluster run` leaves: a node's command running on under init, in the namespace.
        orphan = subprocess.Popen(["ip", "netns", "exec", a.nodes[0].netns, "sleep", "300"],
                                  start_new_session=True)
        time.sleep(0.5)
        proc = run_cli("cluster", "down", "--name", first, env={"DISTLAB_CLUSTER_STATE_DIR": str(state_dir)})
        assert proc.returncode == 0 and f"ended 1 process(es) still running in {a.nodes[0].netns}" in proc.stdout
        assert orphan.wait(timeout=patience(10)) is not None
    finally:
        c.down(first)


def test_a_free_network_is_chosen_around_the_hosts_routes(monkeypatch):
    used = [ipaddress.ip_network("10.77.0.0/16"), ipaddress.ip_network("10.78.3.0/24"),
            ipaddress.ip_network("0.0.0.0/0")]  # a default route overlaps everything and is ignored
    monkeypatch.setattr(c, "_networks_in_use", lambda: used)
    assert c.free_subnet() == ipaddress.ip_network("10.79.0.0/16")
    monkeypatch.setattr(c, "_networks_in_use", lambda: [ipaddress.ip_network("10.0.0.0/8")])
    with pytest.raises(c.ClusterError, match="every candidate network"):
        c.free_subnet()


@needs_netns
def test_bandwidth_is_shaped(state_dir, tmp_path):
    name = _name()
    made = c.up(2, bandwidth="100mbit", name=name)
    server = tmp_path / "server.py"
    server.write_text(textwrap.dedent("""
        import socket, sys
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[1], 0)); s.listen(1); print("ready", s.getsockname()[1], flush=True)  # a free port
        conn, _ = s.accept(); n = 0
        while True:
            b = conn.recv(1 << 20)
            if not b: break
            n += len(b)
        print(n, flush=True)
    """))
    client = tmp_path / "client.py"
    client.write_text(textwrap.dedent("""
        import socket, sys, time
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
        data = b"x" * (1 << 20); t = time.perf_counter()
        for _ in range(6): s.sendall(data)
        s.shutdown(socket.SHUT_WR); s.recv(1); print(6 * 8 * (1 << 20) / (time.perf_counter() - t) / 1e6)
    """))
    try:
        srv = subprocess.Popen(["ip", "netns", "exec", made.nodes[0].netns, sys.executable, str(server), made.master_addr],
                               stdout=subprocess.PIPE, text=True)
        ready, port = srv.stdout.readline().split()
        assert ready == "ready"
        out = subprocess.run(["ip", "netns", "exec", made.nodes[1].netns, sys.executable, str(client), made.master_addr,
                              port],
                             capture_output=True, text=True, timeout=60)
        mbit = float(out.stdout.strip())
        assert int(communicate_patiently(srv, 30)[0].strip()) == 6 << 20
    finally:
        c.down(name)
    # 100 Mbit/s links: the token bucket lets a 512 KB burst through at once, the rest at the rate.
    assert 60 < mbit < 115, f"{mbit:.1f} Mbit/s over a 100mbit link"


@needs_netns
def test_two_node_training_run_crosses_the_emulated_network(state_dir, tmp_path, run_cli):
    name = _name()
    up = run_cli("cluster", "up", "--nodes", "2", "--bandwidth", "1gbit", "--name", name,
                 env={"DISTLAB_CLUSTER_STATE_DIR": str(state_dir)})
    assert up.returncode == 0, up.stderr
    try:
        proc = run_cli("cluster", "run", "--name", name, "--timeout", "240", "--",
                       sys.executable, "-m", "distlab", "train", "--nproc-per-node", "1", "--device", "cpu",
                       "--dataset", "synthetic:1x16x16:10:2048", "--max-steps", "12", "--log-every", "4",
                       "--no-progress", "--out", str(tmp_path / "run"), "--comm-timeout", "60",
                       env={"DISTLAB_CLUSTER_STATE_DIR": str(state_dir)}, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        down = run_cli("cluster", "down", "--name", name, env={"DISTLAB_CLUSTER_STATE_DIR": str(state_dir)})
    assert "removed" in down.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12 and summary["comm_bytes_per_step"] > 0
    assert "[node 0] test accuracy" in proc.stdout  # rank 0's summary, on node 0
    # The run says where it ran, so `plan validate` compares it with the 1gbit link, not loopback.
    assert summary["cluster"] == {"nodes": 2, "link": "1gbit", "delay": None, "burst": c.TBF_BURST}
    from distlab.plan.validate import _measured_runs
    (_, link, _), = _measured_runs([str(tmp_path / "run")])
    assert link.name == machine.Link.parse("1gbit", None, c.TBF_BURST).name != machine.Link().name


@needs_netns
def test_a_lost_node_leaves_the_others_to_reshard_from_the_newest_snapshot_and_finish(tmp_path):
    # two emulated nodes, torchrun --nnodes 1:2 with c10d rendezvous on node 0; node 1 is SIGKILLed (every
    # process in its namespace) once rank 0 has logged step 60: node 0 re-forms the group alone, reshards
    # the newest snapshot (world 2 -> 1, global batch kept) and finishes the epoch
    from distlab.bench import elastic
    job = ["--model", "mlp", "--mlp-widths", "256,128", "--dataset", "synthetic:1x16x16:10:9600",
           "--global-batch-size", "32", "--lr", "0.01", "--optimizer", "adam"]
    record, = elastic.run(nodes=2, kill_at_step=60, snapshot_every=25, log_every=5, bandwidth="100mbit", job=job,
                          out=tmp_path / "el", timeout=240, uninterrupted=False, progress=lambda s: None)
    assert record["stopped"] == "completed" and record["steps"] == 300
    assert [(e["world_size"], e["attempt"]) for e in record["layouts"]] == [(2, 1), (1, 2)]
    resumed = record["layouts"][1]["step"]
    assert resumed % 25 == 0 and 0 < resumed <= record["killed_at_step"]  # the newest snapshot before the loss
    assert 0 <= record["lost_steps"][0] <= 25  # at most one snapshot interval done again
    summary = json.loads((tmp_path / "el" / "node-lost" / "summary.json").read_text())
    assert summary["resharded_from"] and summary["world_size"] == 1


@needs_netns
def test_a_cut_link_fails_every_rank_in_time_naming_who_and_a_restart_recovers(run_cli, tmp_path):
    # distlab verify --faults link-cut: node 1's bridge port goes down after step 6 (the machine stays up, its
    # sockets hear nothing); every rank must fail within --comm-timeout 10 (+ the roll call, teardown), rank 0
    # naming rank 1 and rank 1 saying it is cut off; the link mended, --resume auto ends bitwise equal to an
    # uninterrupted run
    proc = run_cli("verify", "--faults", "link-cut", "--nproc", "2", "--workdir", "w", "--json", "r.json",
                   timeout=400)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    r, = json.loads((tmp_path / "r.json").read_text())
    assert r["passed"] and r["bitwise"] and r["exit_code"] != 0 and r["resume_exit_code"] == 0, r
    assert r["comm_timeout_s"] <= r["failed_after_s"] <= r["comm_timeout_s"] + 15
    said = {e.split(":")[0]: e for e in r["errors"]}
    assert "rank 1 did not answer a roll call through the job's store" in said["rank 0"]
    assert "this rank cannot reach the job's store" in said["rank 1"] and "cut off" in said["rank 1"]
    # the newest snapshot committed before the cut: step 6's, or step 4's when the cut (taken as soon as step 6 is
    # logged) came while step 6's snapshot was still being written -- which one is the machine's timing
    resumed = int(r["resumed_from"].rsplit("step-", 1)[1])
    assert resumed % 2 == 0 and 4 <= resumed <= r["cut_at_step"], (resumed, r["cut_at_step"])
