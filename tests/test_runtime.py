import io
import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import runtime
from distlab.errors import ConfigError, DistributedError
from distlab.runtime import detect_launch, slurm_first_host
from distlab.launch.spawn import run_ranks

# --------------------------------------------------------------------------- detection (pure)


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "1234"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.master_addr, info.master_port) == ("torchrun", 3, 8, 1, 2, "10.1.2.3", 1234)


def test_open_mpi_environment():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr,
            info.master_port) == ("mpirun", 2, 4, 0, "node0", runtime.DEFAULT_MASTER_PORT)


def test_mpich_pmi_environment_on_one_host_defaults_to_loopback():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.master_addr) == \
        ("mpirun", 1, 2, 1, "127.0.0.1")


def test_mpirun_across_hosts_without_master_is_a_clear_error():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ConfigError, match="--master-addr"):
        detect_launch(env)


def test_slurm_environment():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "12345"}
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.master_addr, info.master_port) == ("slurm", 5, 8, 1, 4, "gpu07", 10000 + 12345 % 20000)


def test_slurm_allocation_shell_is_not_a_job_step():
    # salloc/sbatch shells carry SLURM_PROCID but are one process, not the whole job.
    assert detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


@pytest.mark.parametrize("nodelist,first", [
    ("node01", "node01"), ("node[01-04,07],gpu5", "node01"), ("a,b,c", "a"),
    ("rack[3-4]-n[05,07]", "rack3-n05"), ("gpu[7,2-3]", "gpu7"), ("x[009-011]", "x009"),
])
def test_slurm_first_host(nodelist, first):
    assert slurm_first_host(nodelist) == first


def test_manual_flags_win_over_environment():
    info = detect_launch({"RANK": "0", "WORLD_SIZE": "2"}, rank=3, world_size=4, master_addr="10.0.0.1",
                         master_port=6585)
    assert (info.launcher, info.rank, info.world_size, info.master_addr, info.master_port) == \
        ("manual", 3, 4, "10.0.0.1", 6585)


@pytest.mark.parametrize("kwargs,match", [
    ({"rank": 4, "world_size": 4, "master_addr": "h"}, "outside 0..3"),
    ({"rank": 1, "world_size": 2}, "--master-addr"),
    ({"rank": 0}, "--world-size"),
])
def test_manual_flag_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        detect_launch({}, **kwargs)


def test_no_launcher_is_a_single_process():
    info = detect_launch({})
    assert (info.launcher, info.rank, info.world_size) == ("single", 0, 1)


def test_mpi_backend_missing_explains_mpirun_with_gloo():
    if dist.is_mpi_available():
        pytest.skip("this PyTorch has MPI")
    with pytest.raises(ConfigError, match=r"no MPI backend(.|\n)*mpirun(.|\n)*--backend gloo"):
        runtime.resolve_backend("mpi", torch.device("cpu"))


def test_auto_backend_and_nccl_without_cuda():
    assert runtime.resolve_backend("auto", torch.device("cpu")) == "gloo"
    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        runtime.resolve_backend("nccl", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            runtime.resolve_device("cuda", 0)


# --------------------------------------------------------------------------- real init, every style


def _styles(rank: int, world: int, ports: list[int]) -> dict:
    """Environment of each launcher style for this rank (two processes on one host)."""
    return {
        "torchrun": {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0])},
        "mpirun": {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
                   "MASTER_PORT": str(ports[1])},
        "pmi": {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": str(world),
                "MASTER_PORT": str(ports[2])},
        "slurm": {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
                  "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": str(world),
                  "SLURM_JOB_NODELIST": "127.0.0.1", "MASTER_PORT": str(ports[3])},
    }


def _init_every_style(rank, world, ports):
    seen = {}
    for style, env in _styles(rank, world, ports).items():
        if style == "torchrun":  # env:// rendezvous reads the real environment, as under torchrun
            os.environ.update(env)
        rt = runtime.init(env=env, device="cpu", timeout_s=30)
        for key in env if style == "torchrun" else ():
            del os.environ[key]
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        seen[style] = (rt.rank, rt.world_size, rt.local_rank, rt.launcher, t.item())
        runtime.shutdown()
    rt = runtime.init(env={}, device="cpu", rank=rank, world_size=world, master_addr="127.0.0.1", master_port=ports[4],
                      timeout_s=30)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    seen["manual"] = (rt.rank, rt.world_size, rt.local_rank, rt.launcher, t.item())
    runtime.shutdown()
    return seen


def test_init_from_every_launcher_style_and_flags():
    ports = [runtime.free_port() for _ in range(5)]
    results = run_ranks(_init_every_style, 2, ports, init_group=False, timeout=120)
    for rank, seen in enumerate(results):
        assert seen == {
            "torchrun": (rank, 2, rank, "torchrun", 3.0),
            "mpirun": (rank, 2, rank, "mpirun", 3.0),
            "pmi": (rank, 2, rank, "mpirun", 3.0),
            "slurm": (rank, 2, rank, "slurm", 3.0),
            "manual": (rank, 2, 0, "manual", 3.0),
        }


def _init_expecting_error(rank, world, kwargs):
    t0 = time.monotonic()
    try:
        runtime.init(env={}, device="cpu", **kwargs)
    except DistributedError as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_missing_peer_fails_clearly_within_the_timeout():
    port = runtime.free_port()
    (msg, took), = run_ranks(_init_expecting_error, 1, dict(rank=0, world_size=2, master_addr="127.0.0.1",
                                                             master_port=port, timeout_s=3),
                             init_group=False, timeout=60)
    assert msg is not None and "only 1 of 2 ranks joined" in msg and "--master-port" in msg
    assert took < 30  # bounded: the 3 s timeout, not forever


def test_unreachable_master_fails_clearly():
    port = runtime.free_port()
    (msg, _), = run_ranks(_init_expecting_error, 1, dict(rank=1, world_size=2, master_addr="127.0.0.1",
                                                          master_port=port, timeout_s=2),
                          init_group=False, timeout=60)
    assert msg is not None and "could not reach rank 0" in msg


def _init_and_report(rank, world, port, delay, ready=None):
    """Start after ``delay`` seconds (``ready``: a directory -- after every other rank has said there that it is
    about to meet, however slowly its process started), with progress lines every 0.5 s collected in ``said``."""
    if ready is not None and delay:
        deadline = time.monotonic() + 60
        while len(list(Path(ready).iterdir())) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    elif ready is not None:
        (Path(ready) / str(rank)).touch()
    time.sleep(delay)
    lines = []
    info = runtime.detect_launch({}, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)
    store = runtime._meet(info, timeout_s=20, every_s=0.5, say=lines.append)
    dist.init_process_group("gloo", store=dist.PrefixStore("distlab/group", store), rank=rank, world_size=world)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item(), lines


@pytest.mark.parametrize("late", [0, 1])
def test_waiting_ranks_say_who_they_wait_for_and_meet_when_the_late_one_comes(late, tmp_path):
    # 3 ranks by hand; rank ``late`` arrives 3 s after the others are about to meet (on a busy machine their
    # processes start seconds apart). Rank 0 reports the missing ranks, a rank waiting for rank 0 reports that;
    # no line carries c10d's internal store keys.
    port = runtime.free_port()
    results = run_ranks(_meet_with_one_late, 3, port, late, str(tmp_path), init_group=False, timeout=120)
    assert [r[0] for r in results] == [3.0, 3.0, 3.0]
    lines = [line for _, said in results for line in said]
    if late == 1:
        assert any(f"waiting for 1 of 3 ranks at 127.0.0.1:{port}" in line for line in results[0][1])
    else:
        assert any(f"waiting for rank 0 at 127.0.0.1:{port}" in line for line in results[1][1] + results[2][1])
    assert not any("/default_pg" in line or "keys" in line for line in lines)


def _meet_with_one_late(rank, world, port, late, ready):
    return _init_and_report(rank, world, port, 3.0 if rank == late else 0.0, ready)


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert runtime.port_in_use("127.0.0.1", port)
        (msg, _), = run_ranks(_init_expecting_error, 1, dict(rank=0, world_size=2, master_addr="127.0.0.1",
                                                              master_port=port, timeout_s=5),
                              init_group=False, timeout=60)
    assert msg is not None and f"port {port}" in msg and "already in use" in msg


# --------------------------------------------------------------------------- ordered print, broadcast


def _ordered(rank, world):
    time.sleep(0.15 * (world - rank))  # higher ranks get there first
    buf = io.StringIO()
    runtime.ordered_print(f"rank {rank} says {rank * 11}", file=buf)
    return buf.getvalue()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ordered_print_is_in_rank_order_whatever_the_timing(world):
    outputs = run_ranks(_ordered, world, timeout=60)
    assert outputs[0] == "".join(f"rank {r} says {r * 11}\n" for r in range(world))
    assert all(o == "" for o in outputs[1:])  # only one writer: no interleaving possible


def _broadcast(rank, world):
    torch.manual_seed(100 + rank)  # deliberately different models per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean += rank
    runtime.broadcast_module(model)
    return [t.clone() for t in model.state_dict().values()]


def test_broadcast_module_makes_every_rank_equal_rank0():
    states = run_ranks(_broadcast, 3, timeout=60)
    for other in states[1:]:
        for a, b in zip(states[0], other):
            assert torch.equal(a, b)


def test_a_busy_machine_is_said_where_timings_are_made(run_cli, tmp_path, monkeypatch):
    from distlab.runtime import busy_machine, cores
    assert busy_machine(3.0, 2, 2).startswith("the machine was busy before this run (load 3.00 on 2 cores")
    assert busy_machine(0.2, 2, 2) is None and busy_machine(1.0, 1, 4) is None and busy_machine(None, 8, 2) is None
    # which --threads would fit beside the load, or that none would
    assert busy_machine(2.0, 8, 8).endswith("pass --threads 6 (1 rank x 6 beside the load fit the 8 cores)")
    assert busy_machine(4.0, 16, 16, ranks=4).endswith("pass --threads 3 (4 ranks x 3 beside the load fit the 16 cores)")
    assert busy_machine(9.0, 2, 2).endswith("even 1 thread per rank shares the cores: time on a quieter machine, "
                                            "or with fewer ranks")
    proc = run_cli("train", "--dataset", "synthetic:1x8x8:4:64", "--mlp-widths", "8", "--max-steps", "1",
                   "--no-progress", "--out", "run", env={"DISTLAB_LOAD_AT_LAUNCH": "7"}, check=True)
    assert f"warning  the machine was busy before this run (load 7.00 on {cores()} cores" in proc.stdout
    assert "timings compare only between runs at equal threads" in proc.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["load_before_run"] == 7.0
    from distlab.tools import doctor
    monkeypatch.setattr(doctor.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    line = next(line for line in doctor.report().splitlines() if line.startswith("load:"))
    assert line.startswith(f"load: 9.00 (1-minute average) on {cores()} cores -- busy: steps are slower")
    assert "even 1 thread per rank shares the cores" in line or "pass --threads" in line
    monkeypatch.setattr(doctor, "cores", lambda: 16)
    monkeypatch.setattr(doctor.os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    line = next(line for line in doctor.report().splitlines() if line.startswith("load:"))
    assert "a run of one process: pass --threads 10 (1 rank x 10 beside the load fit the 16 cores)" in line
