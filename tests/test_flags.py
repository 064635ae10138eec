"""Every flag of every command, fed edge values (property-based, hypothesis): the command either
succeeds or exits 2 with one ``distlab: error:`` line -- never a traceback, never a run that starts
and then fails for a reason it could have known before it started.

Each command runs in this process (``distlab.cli.main``) from a small base invocation that succeeds
quickly as is; hypothesis replaces one of its flags (or adds one) with an edge value: 0, negative,
nan, inf, huge, empty, of the wrong type. The examples are derandomized, so a failure reproduces.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distlab.cli import cli
from tests.conftest import invoke as _invoke

EDGES = ["0", "-1", "-5", "nan", "inf", "-inf", "1e30", "", "x", "1.5", ",", "0,0", "-1,2"]

# A cheap invocation of each command that succeeds as it is ({tmp}: the test's directory).
BASE = {
    "train": "--dataset synthetic:1x8x8:4:64 --mlp-widths 8 --max-steps 1 --no-progress --out o",
    "export": "{tmp}/snap/step-00000002 -o m.pt",
    "generate": "{tmp}/gsnap/step-00000001 --max-new-tokens 4",
    "verify": "--nproc 1 --steps 2 --strategy allreduce",
    "report": "{tmp}/grun -o r.html",  # (a language model's run: no classifier pages, ~2 s less each)
    "prepare-text": "{tmp}/corpus.txt tok",
    "plan": "--model mlp --dataset synthetic:1x8x8:4:64",
    "plan calibrate": "{tmp}/run -o cal.json",
    "plan validate": "{tmp}/run2 --calibration {tmp}/cal.json --target 1000",
    "plan published": "tt-a100-l2-13b-none --json p.json",
    "cluster up": "--nodes 1 --bandwidth none --name {name}",
    "cluster down": "--name {name}",
    "cluster status": "--name {name}",
    "cluster run": "--name {name} -- true",
    "cluster kill-node": "0 --name {name}",
    "cluster revive-node": "0 --name {name}",
    "cluster cut-link": "0 --name {name}",
    "cluster mend-link": "0 --name {name}",
    "demo ordered-print": "",
    "demo p2p": "--nproc-per-node 2",
    "demo sampler": "--length 10 --num-replicas 2",
    "doctor": "",
    "bench collectives": "--world 1 --sizes 8 --algorithms native --warmup 0 --repeats 1 --out b",
    "bench syncbn": "--workers 1 --features 4 --batches 4 --warmup 0 --repeats 1 --out b",
    "bench dp": "--workloads mlp --nproc 2 --steps 3 --batch 4 --methods allreduce --out b",
    "bench compression": "--strategies bucketed --nodes 2 --max-steps 2 --runs 1 --out b",
    "bench elastic": "--nodes 1 --max-steps 2 --out b --data-dir {tmp}",
    "bench snapshot-format": "--workloads main --nproc 1 --runs 1 --dataset synthetic:1x8x8:4:64 --out b",
    "bench scaling": "--world 1 --modes weak --dataset synthetic:1x8x8:4:256 --max-steps 2 --per-worker-batch 8 --out b",
    "bench parallel": "--workloads mlp --strategies dp --nproc 2 --steps 3 --batch 4 --dataset synthetic:1x8x8:4:64 "
                      "--out b",
    "bench pipeline": "--nproc 2 --microbatches 1 --schedules gpipe --implementations distlab --steps 2 --batch 4 "
                      "--out b",
    "bench overhead": "--workloads mlp --precisions fp32 --steps 20 --runs 1 --dataset synthetic:1x8x8:4:64 --out b",
    "bench checkpointing": "--workloads gpt --steps 3 --batch 2 --out b",
    "bench dry-run": "--presets llama3.2-1b --world 2 --window 32 --strategies zero=3 --out b",
    "bench snapshot": "--nproc 1 --state-mb 0.1 --steps 4 --every 2 --runs 1 --out b",
    "bench load": "--init-from hf:{tmp}/ckpt --nproc 1 --layouts allreduce --modes deferred --sources checkpoint "
                  "--out b",
    "bench markdown": "{tmp}/bench/collectives.json",
    "bench finetune": "--init-from hf:{tmp}/ckpt --nproc 1 --variants lora --steps 2 --runs 1 --block-size 8 --out b",
    "bench packing": "--nproc 1 --records 20 --block-size 64 --batch 2 --runs 1 --out b",
}


def _commands(group: click.Group = cli, path: tuple = ()):
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            if cmd.invoke_without_command or not cmd.commands:
                yield " ".join(path + (name,)), cmd
            yield from _commands(cmd, path + (name,))
        else:
            yield " ".join(path + (name,)), cmd


COMMANDS = dict(_commands())


# Where peers are met: a well-formed address of no live peer is a valid setting that waits for them
# (bounded by the rendezvous and --init-timeout), not a bad input. Their refusals have a test below.
ADDRESSES = {"--master-addr", "--rdzv-endpoint", "--local-addr", "--rdzv-conf", "--nnodes", "--node-rank",
             "--master-port", "--rank", "--world-size"}


def _options(cmd: click.Command) -> list[str]:
    return sorted(o.opts[-1] if o.opts[-1].startswith("--") else o.opts[0] for o in cmd.params
                  if isinstance(o, click.Option) and not o.is_flag and not o.hidden and o.name != "help"
                  and o.opts[-1] not in ADDRESSES)


def test_every_command_has_a_base_invocation():
    assert sorted(COMMANDS) == sorted(BASE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A run with snapshots (export, report, plan read it) made once."""
    tmp = tmp_path_factory.mktemp("flags")
    (tmp / "corpus.txt").write_text("".join(f"paragraph {i}\n\n" for i in range(20)))  # prepare-text's
    for argv in (["train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "2",
                  "--nproc-per-node", "2", "--out", str(tmp / "run2"), "--no-progress"],
                 ["train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--epochs", "2", "--max-steps",
                  "2", "--snapshot-dir", str(tmp / "snap"), "--snapshot-every", "1", "--out", str(tmp / "run"),
                  "--no-progress"],
                 ["train", "--model", "gpt", "--dataset", "synthetic-text:2000", "--n-layer", "1", "--n-embd", "16",
                  "--block-size", "8", "--max-steps", "1", "--snapshot-dir", str(tmp / "gsnap"), "--out",
                  str(tmp / "grun"), "--no-progress"],
                 ["bench", "collectives", "--world", "2", "--sizes", "8,4096", "--algorithms", "native", "--warmup", "0",
                  "--repeats", "1", "--out", str(tmp / "bench")],
                 ["plan", "calibrate", str(tmp / "bench"), str(tmp / "run"), "-o", str(tmp / "cal.json")]):
        code, _, err = _invoke(argv, tmp)
        assert code == 0, (argv, err)
    from distlab.models import build_model, hf, spec  # a Hugging Face checkpoint (bench load reads it)
    # every layer at least 16 wide: bench finetune's adapters are rank 16
    options = spec("llama").make_options(dict(n_layer=1, n_embd=32, n_head=2, kv_heads=2, ffn_hidden=32))
    hf.write(build_model("llama", (16,), 256, options).state_dict(), "llama", options, 256, 16, tmp / "ckpt")
    return tmp


def _argv(command: str, flag: str | None, value: str | None, tmp: Path) -> list[str]:
    name = f"f{os.getpid() % 10000}"
    base = BASE[command].format(tmp=tmp, name=name)
    head, _, tail = base.partition(" -- ")
    args = head.split()
    if flag is not None:
        if flag in args:  # replace the base's value
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return command.split() + args + (["--", *tail.split()] if tail else [])


def _skip_where_clusters_cannot_run(command: str) -> None:
    """An emulated cluster needs root and iproute2: elsewhere its commands refuse in one line (tested in
    tests/test_cluster.py), so their flags are skipped here, saying why."""
    if not command.startswith("cluster"):
        return
    from tests.test_cluster import WHY_NOT  # root, iproute2 and a namespace made for real
    if WHY_NOT is not None:
        pytest.skip(f"distlab cluster cannot run here: {WHY_NOT}")


NEEDS_A_CLUSTER = {"cluster run", "cluster kill-node", "cluster revive-node", "cluster cut-link", "cluster mend-link"}


@pytest.mark.parametrize("command", sorted(set(BASE) - {"bench elastic"}))  # elastic: minutes on a cluster
def test_every_base_invocation_succeeds(command, workdir):
    # Otherwise every edge value would meet a refusal of the base, and the property would prove nothing.
    _skip_where_clusters_cannot_run(command)
    os.environ["DISTLAB_CLUSTER_STATE_DIR"] = str(workdir / "clusters")
    try:
        cwd = workdir / "base"
        cwd.mkdir(exist_ok=True)
        code, out, err = _invoke(_argv(command, None, None, workdir), cwd)
    finally:
        if command == "cluster up":
            from distlab.launch import cluster
            cluster.down(f"f{os.getpid() % 10000}")
        os.environ.pop("DISTLAB_CLUSTER_STATE_DIR")
    expected = 2 if command in NEEDS_A_CLUSTER else 0
    assert code == expected, (command, code, out[-2000:], err[-2000:])
    if expected == 2:
        assert "is up" in err


def _check(command: str, argv: list[str], tmp: Path) -> None:
    cwd = tmp / "cwd"
    cwd.mkdir(exist_ok=True)
    code, out, err = _invoke(argv, cwd)
    shown = f"distlab {' '.join(argv)} -> exit {code}\nstdout: {out[-1500:]}\nstderr: {err[-3000:]}"
    assert "Traceback" not in err + out, shown
    if code == 2:  # one line saying what was wrong (warnings may precede it), nothing started before it
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("distlab: warning:")]
        assert len(lines) == 1 and lines[0].startswith("distlab: error:"), shown
    else:
        assert code == 0, shown  # anything else would be a failure after the start


@pytest.mark.parametrize("command", sorted(BASE))
@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_flag_takes_edge_values_without_a_traceback(command, data, workdir):
    flags = _options(COMMANDS[command])
    _skip_where_clusters_cannot_run(command)
    flag = data.draw(st.sampled_from(flags)) if flags else None
    value = data.draw(st.sampled_from(EDGES)) if flag else None
    os.environ["DISTLAB_CLUSTER_STATE_DIR"] = str(workdir / "clusters")  # never the user's clusters
    try:
        _check(command, _argv(command, flag, value, workdir), workdir)
    finally:
        if command.startswith("cluster"):
            from distlab.launch import cluster
            cluster.down(f"f{os.getpid() % 10000}")
        os.environ.pop("DISTLAB_CLUSTER_STATE_DIR")


@pytest.mark.parametrize("command,flag,value", [
    ("train", "--momentum", "-1"), ("train", "--eval-batch-size", "0"), ("train", "--comm-timeout", "nan"),
    ("train", "--master-port", "99999"), ("train", "--out", "{tmp}/run/summary.json"), ("train", "--lr", "inf"),
    ("train", "--lr", "1e300"), ("train", "--weight-decay", "1e300"),
    ("plan", "--params", "nan"), ("bench collectives", "--sizes", "-5"), ("bench syncbn", "--batches", "0"),
    ("verify", "--json", "{tmp}"), ("plan calibrate", "-o", ""), ("cluster up", "--delay", "-1"),
    ("demo p2p", "--rdzv-endpoint", ","), ("demo p2p", "--rdzv-endpoint", "localhost:99999"),
    ("demo p2p", "--master-addr", "no-such-host.invalid"), ("demo p2p", "--nnodes", "0"),
    ("demo p2p", "--nnodes", "x"), ("demo p2p", "--node-rank", "3"), ("demo p2p", "--rdzv-conf", "x"),
    ("demo p2p", "--master-port", "0"), ("demo ordered-print", "--world-size", "0"),
    ("bench compression", "--strategies", ""), ("bench compression", "--strategies", ",,"),
    ("bench parallel", "--strategies", ""), ("bench parallel", "--workloads", ""), ("bench dp", "--workloads", ""),
    ("bench pipeline", "--schedules", ""),
])
def test_the_edge_values_that_once_gave_tracebacks_are_one_line(command, flag, value, workdir):
    _skip_where_clusters_cannot_run(command)
    argv = _argv(command, flag, value.format(tmp=workdir), workdir)
    code, out, err = _invoke(argv, workdir / "cwd" if (workdir / "cwd").is_dir() else workdir)
    assert code == 2 and err.startswith("distlab: error:") and err.count("\n") == 1, (argv, code, out, err)
