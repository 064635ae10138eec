"""``distlab generate``: text from a trained GPT, from a snapshot of any layout (here tp 2 x pp 2),
its run directory or an exported file -- the same text from each, the same text for the same seed."""

import subprocess

import pytest
import torch

from distlab.errors import ConfigError
from distlab.tools.generate import generate, load_gpt
from tests.conftest import patience, run_patiently


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    from tests.conftest import distlab_exe
    tmp = tmp_path_factory.mktemp("gen")
    args = ["train", "--model", "gpt", "--dataset", "synthetic-text:4000", "--n-layer", "2", "--n-embd", "16",
            "--n-head", "2", "--block-size", "16", "--max-steps", "4", "--global-batch-size", "8", "--tp", "2",
            "--pp", "2", "--nproc-per-node", "4", "--device", "cpu", "--snapshot-dir", str(tmp / "s"), "--out",
            str(tmp / "run"), "--no-progress"]
    proc = run_patiently([*distlab_exe(), *args], 300, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


def test_the_same_text_from_the_run_its_snapshot_and_its_export_and_for_the_same_seed(run_cli, gpt_run):
    snap = gpt_run / "s" / "step-00000004"
    from_run = run_cli("generate", str(gpt_run / "run"), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "5",
                       check=True).stdout
    from_snapshot = run_cli("generate", str(snap), "--prompt", "ab", "--max-new-tokens", "12", "--seed", "5",
                            check=True).stdout
    assert from_run == from_snapshot and from_run.startswith("ab")
    run_cli("export", str(snap), "-o", str(gpt_run / "m.pt"), check=True)
    plain, _, _ = load_gpt(gpt_run / "m.pt", n_head=2)
    sharded, _, _ = load_gpt(snap)  # tp x pp shards put back together
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), sharded.parameters()))
    assert generate(plain, "ab", 12, 0.8, None, 5) + "\n" == from_run
    greedy = [generate(plain, "ab", 12, 0.0, None, s) for s in (1, 2)]  # temperature 0: the seed does not matter
    assert greedy[0] == greedy[1] and greedy[0].startswith("ab")


def test_what_cannot_generate_is_one_line(refused_here, run_cli, gpt_run, tmp_path):
    with pytest.raises(ConfigError, match="give the model's --n-head"):
        load_gpt(_exported(run_cli, gpt_run))
    proc = refused_here("generate", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "no run directory, snapshot or model file there" in proc.stderr
    proc = refused_here("generate", str(gpt_run / "s" / "step-00000004"), "--temperature", "-1")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    # settings that would do nothing (each was ignored): greedy decoding samples nothing, a snapshot knows its heads
    for flags, said in [(["--temperature", "0", "--top-k", "5"], "--top-k with --temperature 0"),
                        (["--temperature", "0", "--top-p", "0.5"], "--top-p with --temperature 0"),
                        (["--n-head", "4"], "--n-head is for a plain model file")]:
        proc = refused_here("generate", str(gpt_run / "s" / "step-00000004"), *flags)
        assert said in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def _exported(run_cli, gpt_run):
    run_cli("export", str(gpt_run / "s" / "step-00000004"), "-o", str(gpt_run / "m.pt"), check=True)
    return gpt_run / "m.pt"


def test_samples_during_training_are_logged_and_change_nothing_else(refused_here, run_cli, tmp_path):
    """--sample-every N: a sample at every N-th step and the last, in that step's metrics record and
    printed; the run's numbers are bitwise those of the same run without samples (sampling draws from
    its own generator, and the model is rebuilt without initialising anything)."""
    import json
    common = ["train", "--model", "gpt", "--dataset", "synthetic-text:3000", "--n-layer", "1", "--n-embd", "16",
              "--n-head", "2", "--block-size", "16", "--max-steps", "5", "--global-batch-size", "8", "--log-every",
              "5", "--no-progress"]
    plain = run_cli(*common, "--out", "plain", check=True)
    sampled = run_cli(*common, "--sample-every", "2", "--out", "sampled", check=True)
    records = [json.loads(line) for line in (tmp_path / "sampled" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "sample" in r] == [2, 4, 5]
    assert all(isinstance(r["sample"], str) and r["sample"] for r in records if "sample" in r)
    assert sampled.stdout.count("sample   ") == 3 and "sample   " not in plain.stdout
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("plain", "sampled"))
    assert (a["test_loss"], a["test_accuracy"]) == (b["test_loss"], b["test_accuracy"])  # the same final model
    proc = refused_here("train", "--model", "mlp", "--dataset", "synthetic:1x4x4:2", "--sample-every", "2")
    assert proc.returncode == 2 and "does not generate text" in proc.stderr


def test_a_safetensors_export_alone_generates_and_a_pickle_is_refused_naming_the_model_file(refused_here, run_cli, gpt_run, tmp_path):
    snap = gpt_run / "s" / "step-00000004"
    run_cli("export", str(snap), "-o", str(tmp_path / "m.safetensors"), check=True)
    args = ["--prompt", "ab", "--max-new-tokens", "12", "--seed", "5"]
    alone = run_cli("generate", str(tmp_path / "m.safetensors"), *args, check=True).stdout  # no --n-head
    assert alone == run_cli("generate", str(snap), *args, check=True).stdout
    import os

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    torch.save({"w": Evil()}, tmp_path / "evil.pt")
    proc = refused_here("generate", str(tmp_path / "evil.pt"))
    assert proc.returncode == 2 and "the model file" in proc.stderr and "init" not in proc.stderr, proc.stderr


def test_a_long_generation_prints_as_it_goes(gpt_run):
    """--max-new-tokens 1e9 is days of text: its first characters show at once (streamed), not never."""
    import os
    import select
    import time

    from tests.conftest import distlab_exe
    proc = subprocess.Popen([*distlab_exe(), "generate", str(gpt_run / "run"), "--prompt", "ab", "--max-new-tokens",
                             "1000000000", "--seed", "5"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "DISTLAB_DEVICE": "cpu"})
    try:
        got, deadline = b"", time.monotonic() + patience(120)
        while len(got) < 8 and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                got += os.read(proc.stdout.fileno(), 64)
        assert got.startswith(b"ab") and len(got) >= 8, got
    finally:
        proc.kill()
        proc.wait()
