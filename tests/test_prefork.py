"""A launch's workers started warm (:mod:`distlab.launch.prefork`): forked from one server that imported torch and
distlab, each with what its launch gave it -- environment, directory, ``sys.path`` -- not what the server had when
an earlier launch started it, in a session of its own, its launcher still its parent for distlab's own uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from distlab.launch import prefork
from tests.conftest import invoke, patience

PROBE = textwrap.dedent("""
    import gc, json, os, sys
    from pathlib import Path

    from torch import nn

    from distlab.runtime.launch import parent_pid


    def build():
        if "RANK" in os.environ:  # a worker (the launcher builds it too, on the meta device, to check it)
            facts = dict(pid=os.getpid(), ppid=os.getppid(), parent=parent_pid(), cwd=os.getcwd(),
                         probe=os.environ.get("PROBE"), path=sys.path[:2], session=os.getsid(0), argv=sys.argv[1:3],
                         frozen=gc.get_freeze_count())
            Path(os.environ["PROBE_OUT"], f"{os.environ['PROBE']}-{os.environ['RANK']}.json").write_text(json.dumps(facts))
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
""")


def test_two_launches_fork_their_workers_from_one_warm_server_each_with_its_own_launch(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    facts = {}
    for launch in ("first", "second"):
        cwd = tmp_path / launch
        cwd.mkdir()
        code, out, err = invoke(["train", "--model", f"{tmp_path / 'probe.py'}:build", "--dataset",
                                 "synthetic:1x8x8:4:64", "--max-steps", "1", "--no-progress", "--nproc-per-node", "2",
                                 "--out", "run"], cwd, env={**os.environ, "PROBE": launch, "PROBE_OUT": str(tmp_path)},
                                fds=True)  # in this process, as a notebook or a sweep runs it
        assert code == 0, err
        for rank in (0, 1):
            facts[launch, rank] = json.loads((tmp_path / f"{launch}-{rank}.json").read_text())
    servers = {f["ppid"] for f in facts.values()}
    assert len(servers) == 1 and os.getpid() not in servers, facts  # one server forked all four
    for (launch, rank), f in facts.items():
        assert f["probe"] == launch and f["cwd"] == str(tmp_path / launch), f  # the launch's, not the server's
        assert f["path"][0] == str(tmp_path / launch), f  # sys.path as `python -m distlab` there builds it
        assert f["parent"] == os.getpid(), f  # torchrun's agent: the launching process (run in this one)
        assert f["session"] == f["pid"], f  # a session of its own, as torchrun gives its workers
        assert f["argv"] == ["train", "--model"], f
        # what the server imported is out of the collector's reach: a worker's collections (one at its end) scan --
        # and touch, so copy on write -- only what the worker made, not torch's whole heap again
        assert f["frozen"] > 100_000, f


def test_exec_starts_fresh_interpreters_and_a_bad_setting_is_one_line(run_cli, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    base = ("train", "--model", f"{tmp_path / 'probe.py'}:build", "--dataset", "synthetic:1x8x8:4:64", "--max-steps",
            "1", "--no-progress", "--nproc-per-node", "2", "--out", "run")
    run_cli(*base, env={"PROBE": "exec", "PROBE_OUT": str(tmp_path), "DISTLAB_WORKER_START": "exec"}, check=True)
    for rank in (0, 1):
        f = json.loads((tmp_path / f"exec-{rank}.json").read_text())
        assert f["ppid"] == f["parent"] == os.getpid(), f  # torchrun started it itself
    proc = run_cli(*base[:-1], "run2", env={"DISTLAB_WORKER_START": "warm"})
    assert proc.returncode == 2 and proc.stderr.startswith("distlab: error: DISTLAB_WORKER_START='warm'"), proc.stderr


def test_a_client_that_cannot_reach_its_server_says_so_in_one_line(tmp_path):
    env = {**os.environ, prefork.SOCKET_ENV: str(tmp_path / "no-server")}
    proc = subprocess.run(prefork.worker_command(["train"]), env=env, capture_output=True, text=True, timeout=patience(60))
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot reach the worker start-up server" in proc.stderr and "DISTLAB_WORKER_START=exec" in proc.stderr
    assert sys.executable in prefork.worker_command([])


HEAVY = ("torch._dynamo", "torch._inductor", "sympy")  # about 1.8 s of CPU each time a process imports them


def test_what_a_training_run_imports_on_its_first_model_the_servers_have_imported_already(tmp_path):
    """A worker forked from the prefork server (or the suite's fork server, :mod:`distlab.launch.spawn`) builds its
    model under a device context, whose first use imports torch's compiler (torch._dynamo, sympy): a preload that
    leaves it out has every worker import it anew."""
    from distlab.launch import spawn
    script = textwrap.dedent("""
        import importlib, json, sys
        for name in json.loads(sys.argv[1]):
            importlib.import_module(name)
        before = set(sys.modules)
        from distlab.cli import main
        argv = ["train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1", "--no-progress",
                "--out", sys.argv[2]]
        sys.argv = ["distlab", *argv]
        try:
            main(argv)
        except SystemExit as exc:
            assert not exc.code, exc.code
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    for i, preload in enumerate((prefork.PRELOAD, spawn.PRELOAD)):
        proc = subprocess.run([sys.executable, "-c", script, json.dumps(list(preload)), str(tmp_path / f"run{i}")],
                              capture_output=True, text=True, timeout=patience(120))
        assert proc.returncode == 0, proc.stderr[-3000:]
        new = json.loads(proc.stdout.splitlines()[-1])
        late = [m for m in new if any(m == h or m.startswith(h + ".") for h in HEAVY)]
        assert not late, f"{preload} leaves {len(late)} module(s) of {HEAVY} to each worker: {late[:5]}"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_launches_a_command_runs_fork_from_its_server_and_still_die_with_their_own_launcher(tmp_path):
    """A command that runs launches as subprocesses (``verify --faults``, ``bench scaling``) shares its prefork server
    with them: their workers fork from it, no launch starts a server (and imports torch) of its own -- unless the
    launch's process differs in what a forked worker inherits from its server (its key: here its CPU affinity). A launch
    killed still takes its workers with it, though the server lives on."""
    (tmp_path / "probe.py").write_text(PROBE)
    before = {k: os.environ.get(k) for k in (prefork.SOCKET_ENV, prefork.KEY_ENV)}
    with prefork.shared():
        server = prefork.server_pid()
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    assert env[prefork.SOCKET_ENV] and {k: os.environ.get(k) for k in before} == before  # as it was, after
    run = [sys.executable, "-m", "distlab", "train", "--model", f"{tmp_path / 'probe.py'}:build", "--no-progress",
           "--nproc-per-node", "2", "--device", "cpu"]
    long_run = subprocess.Popen([*run, "--dataset", "synthetic:1x8x8:4:200000", "--epochs", "50", "--out", "a"],
                                cwd=tmp_path, env={**env, "PROBE": "shared", "PROBE_OUT": str(tmp_path),
                                                   "TMPDIR": str(tmp_path)},  # what a SIGKILLed launcher leaves
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        probes = [tmp_path / f"shared-{rank}.json" for rank in (0, 1)]
        deadline = time.time() + patience(120)
        while time.time() < deadline and not all(p.exists() for p in probes):
            assert long_run.poll() is None, long_run.stderr.read()
            time.sleep(0.1)
        facts = [json.loads(p.read_text()) for p in probes]
        assert [f["ppid"] for f in facts] == [server, server], facts  # forked by this process's server
        assert [f["parent"] for f in facts] == [long_run.pid] * 2, facts  # torchrun's agent: the launch's
        assert len(_children(long_run.pid)) == 2  # its workers' two clients, and no server of its own
        workers = [f["pid"] for f in facts]
        assert all(_alive(w) for w in workers)
        long_run.kill()  # the launcher only
        long_run.wait(timeout=patience(30))
        deadline = time.time() + patience(30)
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)  # no orphan trains on in the shared server
        assert _alive(server)
    finally:
        if long_run.poll() is None:
            long_run.kill()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:  # a launch pinned to one core has another key: a worker forked from this server would not be
        shared_key = env[prefork.KEY_ENV]
        os.sched_setaffinity(0, cpus[:1])
        try:
            assert prefork._key() != shared_key
        finally:
            os.sched_setaffinity(0, cpus)
        assert prefork._key() == shared_key
