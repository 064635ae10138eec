"""A collective and a gradient sync of the user's own on the command line (``--collective FILE.py:NAME``,
``--dp-sync FILE.py:NAME``; distlab.comm.user, distlab.parallel.data_parallel.sync_method): a
correct ring of a learner's passes ``verify`` under data parallel and ZeRO with its bytes counted (the same
bytes as distlab's plain ring), a wrong one fails naming its difference, and one that sends outside distlab's
point-to-point accounting, or takes the wrong arguments, is refused in one line."""

from __future__ import annotations

import json

import torch

from distlab.launch.spawn import run_ranks
from tests.conftest import patience

MINE = '''
import torch
from distlab.comm.ops import combine
from distlab.comm.p2p import exchange


def _reduce_scatter(chunks, op, group, rank, n):
    right, left = (rank + 1) % n, (rank - 1) % n
    tmp = torch.empty_like(chunks[0])
    for s in range(n - 1):
        send, recv = (rank - s - 1) % n, (rank - s - 2) % n
        got = tmp[:chunks[recv].numel()]
        exchange(chunks[send], right, got, left, group)
        combine(op, chunks[recv], got)


def allreduce(buf, op, group, rank, n):
    chunks = list(torch.tensor_split(buf, n))
    _reduce_scatter(chunks, op, group, rank, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        exchange(chunks[(rank - s) % n], right, chunks[(rank - s - 1) % n], left, group)


def no_all_gather(buf, op, group, rank, n):  # each rank keeps one reduced chunk, the rest its own
    _reduce_scatter(list(torch.tensor_split(buf, n)), op, group, rank, n)


def torchs(buf, op, group, rank, n):
    import torch.distributed as dist
    dist.all_reduce(buf, group=group)


def returns(buf, op, group, rank, n):
    out = buf.clone()
    allreduce(out, op, group, rank, n)
    return out


def two(buf, op):
    pass
'''


def _mine(tmp_path) -> str:
    path = tmp_path / "mine.py"
    path.write_text(MINE)
    return str(path)


def _every_collective(rank, world, spec):
    from distlab import comm
    out = {}
    for name in ("allreduce", "returns"):
        t = torch.arange(6, dtype=torch.float64) * (rank + 1)
        with comm.counting() as c:
            comm.all_reduce(t, op="avg", algorithm=f"{spec}:{name}")
        out[name] = (t.tolist(), c.bytes_sent)
    algo = f"{spec}:allreduce"
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.arange(2.0 * world) + rank, algorithm=algo)
    ag = torch.empty(2 * world)
    comm.all_gather(ag, torch.tensor([rank, -rank], dtype=torch.float32), algorithm=algo)
    b = torch.full((5,), float(rank))
    comm.broadcast(b, src=world - 1, algorithm=algo)
    return out, rs.tolist(), ag.tolist(), b.tolist()


def test_a_users_all_reduce_makes_every_collective_and_its_bytes_are_counted(tmp_path):
    spec, world = _mine(tmp_path), 3
    for rank, (out, rs, ag, b) in enumerate(run_ranks(_every_collective, world, spec, timeout=patience(60))):
        mean = (torch.arange(6, dtype=torch.float64) * 2).tolist()  # (1 + 2 + 3) / 3 = 2 times each value
        assert out["allreduce"][0] == out["returns"][0] == mean
        assert out["allreduce"][1] == out["returns"][1] == 2 * (world - 1) * 2 * 8  # 2 (n-1) chunks of 2 float64s
        expected = [sum(range(world)) + world * (2 * rank + k) for k in range(2)]
        assert rs == expected
        assert ag == [float(v) for r in range(world) for v in (r, -r)]
        assert b == [float(world - 1)] * 5


def test_verify_grades_a_users_collective_right_and_wrong(run_cli, tmp_path):
    spec = _mine(tmp_path)
    right = run_cli("verify", "--nproc", "3", "--steps", "3", "--collective", f"{spec}:allreduce", check=True)
    assert right.stdout.count("PASS") == 4 and "zero=3" in right.stdout, right.stdout
    wrong = run_cli("verify", "--nproc", "3", "--steps", "3", "--strategy", "bucketed", "--collective",
                    f"{spec}:no_all_gather")
    assert wrong.returncode == 1 and "FAIL" in wrong.stdout
    assert "differ from single-process training beyond their rounding bound" in wrong.stderr, wrong.stderr


def _bytes_per_step(run_cli, tmp_path, ranks: int, runs: dict) -> dict:
    """``comm_bytes_per_step`` of a 2-step MLP run on ``ranks`` ranks for each name's extra flags."""
    sent = {}
    for name, flags in runs.items():
        run_cli("train", "--model", "mlp", "--dataset", "synthetic:3x8x8:4:96", "--nproc-per-node", str(ranks),
                "--max-steps", "2", "--global-batch-size", str(4 * ranks), "--no-progress", "--eval-batches", "1",
                *flags, "--out", str(tmp_path / name), check=True)
        sent[name] = json.loads((tmp_path / name / "summary.json").read_text())["comm_bytes_per_step"]
    return sent


def test_a_users_collective_trains_and_counts_the_bytes_the_plain_ring_sends(run_cli, tmp_path):
    """The learner's ring is distlab's plain ring's schedule: a run over it sends what one over ring_plain does."""
    spec = _mine(tmp_path)
    sent = _bytes_per_step(run_cli, tmp_path, 3, {"mine": ("--collective", f"{spec}:allreduce"),
                                                  "plain": ("--collective", "ring_plain")})
    assert sent["mine"] == sent["plain"] > 0


def test_a_users_collective_that_sends_outside_distlab_or_takes_other_arguments_is_one_line(run_cli, refused_here,
                                                                                           tmp_path):
    spec = _mine(tmp_path)
    proc = run_cli("verify", "--nproc", "2", "--steps", "2", "--strategy", "allreduce", "--collective",
                   f"{spec}:torchs")
    assert proc.returncode == 2 and "sent no message through distlab.comm.p2p" in proc.stderr
    assert proc.stderr.strip().count("\n") <= 1 and "Traceback" not in proc.stderr, proc.stderr
    for args, message in [(["train", "--collective", f"{spec}:two"], "two must take (buf, op, group, rank, n)"),
                          (["train", "--collective", f"{spec}:missing"], "has no callable 'missing'"),
                          (["train", "--collective", "mine"], "or your own all-reduce as path/to/file.py:NAME")]:
        err = refused_here(*args).stderr
        assert message in err and err.count("\n") == 1, (args, err)


SYNC = '''
import torch
from distlab import comm
from distlab.parallel import SyncMethod


class MeanSync(SyncMethod):
    """Every gradient in one flat all-reduce, divided by the ranks."""

    def sync(self, module):
        params = [p for p in module.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        comm.all_reduce(flat, op="sum", algorithm=self.collective, group=self.group)
        flat /= self.world_size
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()


class SumSync(SyncMethod):
    """Forgets the division: the sum, not the mean."""

    def sync(self, module):
        for p in module.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, op="sum", algorithm=self.collective, group=self.group)


class NotASync:
    def sync(self, module):
        pass


class NoSyncWritten(SyncMethod):
    pass
'''


def test_verify_grades_a_users_gradient_sync_right_and_wrong_and_counts_its_bytes(run_cli, refused_here, tmp_path):
    """``--dp-sync FILE.py:NAME``: a SyncMethod subclass of the learner's passes verify (alone, with gradient
    accumulation, and over the learner's own collective), a sum instead of a mean fails naming the difference, a
    run over it sends what plain all-reduce of the same gradients does, and a class that is no SyncMethod (or
    writes no sync) is refused in one line."""
    path = tmp_path / "sync.py"
    path.write_text(SYNC)
    right = run_cli("verify", "--nproc", "3", "--steps", "3", "--dp-sync", f"{path}:MeanSync", check=True)
    assert right.stdout.count("PASS") == 2 and "accum=2" in right.stdout, right.stdout
    mine = run_cli("verify", "--nproc", "3", "--steps", "3", "--strategy", "allreduce", "--dp-sync",
                   f"{path}:MeanSync", "--collective", f"{_mine(tmp_path)}:allreduce", check=True)
    assert "PASS" in mine.stdout and "mine.py:allreduce" in mine.stdout, mine.stdout
    wrong = run_cli("verify", "--nproc", "3", "--steps", "3", "--strategy", "allreduce", "--dp-sync",
                    f"{path}:SumSync")
    assert wrong.returncode == 1 and "FAIL" in wrong.stdout, wrong.stdout
    sent = _bytes_per_step(run_cli, tmp_path, 2, {"mine": ("--dp-sync", f"{path}:MeanSync"),
                                                  "allreduce": ("--dp-sync", "allreduce")})
    assert sent["mine"] == sent["allreduce"] > 0  # (2 ranks: each all-reduce sends its gradients' bytes once)
    for args, message in [(["--dp-sync", f"{path}:NotASync"], "NotASync is no subclass of distlab.parallel.SyncMethod"),
                          (["--dp-sync", f"{path}:NoSyncWritten"], "NoSyncWritten defines no sync(module)"),
                          (["--dp-sync", "mine"], "or your own SyncMethod subclass as path/to/file.py:NAME")]:
        err = refused_here("train", *args).stderr
        assert message in err and err.count("\n") == 1, (args, err)


def test_the_exercises_say_they_are_not_written_and_their_solutions_pass(run_cli):
    """docs/exercises.md's checks, run as the page shows them: each exercise refused in one line until written,
    each solution passing verify."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "examples" / "exercises"
    for flag, name, strategies in (("--collective", "ring_allreduce.py:allreduce", ["--strategy", "bucketed"]),
                                   ("--dp-sync", "gradient_sync.py:MySync", [])):
        stub = run_cli("verify", "--nproc", "3", "--steps", "2", *strategies, flag, str(root / name))
        assert stub.returncode == 2 and "is not written yet" in stub.stderr, stub.stderr
        assert "Traceback" not in stub.stderr, stub.stderr
        solved = run_cli("verify", "--nproc", "3", "--steps", "2", *strategies, flag, str(root / "solutions" / name),
                         check=True)
        assert "PASS" in solved.stdout and "FAIL" not in solved.stdout, solved.stdout


def test_the_zero2_exercise_is_refused_until_written_passes_when_right_and_fails_when_wrong(run_cli, refused_here):
    """``--strategy zero=2+zero_impl=FILE.py:NAME``: the learner's PlainZero subclass, run as docs/exercises.md
    shows it -- the stub refused in one line, the solution passing alone and under accumulation, a sum for a mean
    failing with its difference, and a class that is no PlainZero refused before launch."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "examples" / "exercises"
    spec = lambda path, name: ["--strategy", f"zero=2+zero_impl={path}:{name}"]  # noqa: E731
    stub = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(root / "zero2_step.py", "MyZero2"))
    assert stub.returncode == 2 and "sync_gradients is not written yet" in stub.stderr, stub.stderr
    assert "Traceback" not in stub.stderr, stub.stderr
    solution = root / "solutions" / "zero2_step.py"
    solved = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(solution, "MyZero2"),
                     "--strategy", f"zero=2+zero_impl={solution}:MyZero2+accum=2", check=True)
    assert solved.stdout.count("PASS") == 2 and "FAIL" not in solved.stdout, solved.stdout
    wrong = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(solution, "SumNotMean"))
    assert wrong.returncode != 0 and "FAIL" in wrong.stdout, wrong.stdout
    err = refused_here("verify", "--nproc", "3", *spec(root / "gradient_sync.py", "MySync")).stderr
    assert "is no subclass of distlab.parallel.zero.plain.PlainZero" in err, err


def test_the_syncbn_exercise_is_refused_until_written_passes_when_right_and_fails_when_wrong(run_cli, refused_here):
    """``--strategy allreduce+syncbn=FILE.py:NAME``: the learner's input gradient inside distlab's SyncBatchNorm, run
    as docs/exercises.md shows it -- the stub refused in one line, the solution passing, plain BatchNorm's
    backward (the means over the rank's own values) failing with its difference, a wrong signature refused."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent / "examples" / "exercises"
    spec = lambda path, name: ["--strategy", f"allreduce+syncbn={path}:{name}"]  # noqa: E731
    stub = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(root / "syncbn_backward.py", "input_gradient"))
    assert stub.returncode == 2 and "is not written yet" in stub.stderr and "Traceback" not in stub.stderr, stub.stderr
    solution = root / "solutions" / "syncbn_backward.py"
    solved = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(solution, "input_gradient"), check=True)
    assert solved.stdout.count("PASS") == 1 and "FAIL" not in solved.stdout, solved.stdout
    wrong = run_cli("verify", "--nproc", "3", "--steps", "2", *spec(solution, "local_means"))
    assert wrong.returncode != 0 and "FAIL" in wrong.stdout, wrong.stdout
    err = refused_here("verify", "--nproc", "3", *spec(root / "gradient_sync.py", "MySync")).stderr
    assert "must take (g, xhat, scale, n, all_reduce)" in err, err
