"""Hybrid sharding (``--zero S --dp-shard N``): ZeRO inside shard groups of N consecutive replicas, the reduced
shard all-reduced across the groups (distlab.parallel.zero.hsdp).

Equal to one process within verify's float32 bound (the same averages, reduced in two hops instead of one:
summation order only); the bytes a run counts and the model state it holds are the planner's to the byte, and a
run whose shards are not averaged across the groups is off by O(1e-2) -- the control below.
"""

import json

import pytest

from distlab import runtime
from distlab.launch.spawn import run_ranks
from distlab.parallel.mesh import layout
from distlab.parallel.zero import reduce as zero_reduce
from distlab.tools.verify import reference_run, tolerance
from distlab.train import Trainer, TrainConfig
from tests.conftest import patience

MLP = ["--model", "mlp", "--mlp-widths", "32,16", "--dataset", "synthetic:1x8x8:4:96", "--global-batch-size", "12",
       "--optimizer", "sgd", "--momentum", "0.9"]


def test_shard_groups_are_blocks_of_consecutive_replicas_and_replicate_groups_their_strides():
    """8 ranks, tp 2: the replicas of a tensor-parallel rank are [0,2,4,6] and [1,3,5,7]; shard groups of 2 take
    consecutive ones (a node's, where a node holds 4 ranks), the replicate groups one from each."""
    groups = layout(8, 2, dp_shard=2)
    assert groups.replica_groups == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups.shard_groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups.replicate_groups == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert layout(8, 1, cp=2, dp_shard=4).shard_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]  # context parallel's too
    assert layout(4, 1).shard_groups == []  # none without hybrid sharding


def test_hybrid_zero_trains_as_one_process_and_holds_and_sends_what_plan_says(run_cli, tmp_path):
    """`distlab verify` holds ZeRO-2 and -3 over shard groups of 2 (4 ranks; beside context parallel on the Llama
    family) to one process; `distlab train --zero 3 --dp-shard 2` holds the model state and sends the bytes that
    `distlab plan` with the same flags prints -- more state than ZeRO-3 over all 4 ranks, and fewer bytes."""
    out = tmp_path / "verify.json"
    run_cli("verify", "--nproc", "4", "--strategy", "zero=2+dp_shard=2", "--strategy", "zero=3+dp_shard=2+cp=2+llama",
            "--steps", "5", "--json", str(out), timeout=patience(600), check=True)
    records = json.loads(out.read_text())
    assert [r["passed"] for r in records] == [True, True]
    assert all(r["max_abs_param_diff"] <= r["tolerance"] for r in records)
    facts = {}
    for name, extra in (("hybrid", ["--dp-shard", "2"]), ("zero3", [])):
        run_cli("train", *MLP, "--zero", "3", *extra, "--max-steps", "3", "--nproc-per-node", "4", "--no-progress",
                "--eval-batches", "1", "--out", str(tmp_path / name), timeout=patience(300), check=True)
        run_cli("plan", *MLP, "--zero", "3", *extra, "--dp", "4", "--json", str(tmp_path / f"{name}.json"), check=True)
        ran = json.loads((tmp_path / name / "summary.json").read_text())
        planned = json.loads((tmp_path / f"{name}.json").read_text())
        assert ran["model_state_bytes_per_rank"] == planned["model_state_bytes_per_rank"], name
        assert ran["comm_bytes_per_step"] == planned["comm_bytes_per_step_per_rank"], name
        facts[name] = ran
    assert facts["hybrid"]["strategy"]["dp_shard"] == 2 and "dp_shard" not in facts["zero3"]["strategy"]
    assert facts["hybrid"]["model_state_bytes_per_rank"] > facts["zero3"]["model_state_bytes_per_rank"]
    assert facts["hybrid"]["comm_bytes_per_step"] < facts["zero3"]["comm_bytes_per_step"]


def _train(rank, world, cfg, skip_across):
    real = zero_reduce.BucketedReduce._cross
    if skip_across:  # the shards left as each group reduced them: never averaged across the groups
        zero_reduce.BucketedReduce._cross = lambda self, shard, wait: None
    try:
        trainer = Trainer(cfg.validate(world), runtime.from_process_group())
        trainer.fit()
        return trainer.full_parameters()
    finally:
        zero_reduce.BucketedReduce._cross = real


@pytest.mark.parametrize("stage", [2, 3])
def test_shards_not_averaged_across_the_groups_diverge_from_one_process(stage):
    """Negative control: the same run without the all-reduce across the shard groups (each group's ranks then
    follow their own half of the batch) is far outside the bound the real one meets."""
    cfg = TrainConfig.from_flags(model="mlp", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:96", max_steps=6,
                                 global_batch_size=12, lr=0.1, lr_schedule="constant", optimizer="sgd", momentum=0.9,
                                 seed=3, progress=False, verbose=False, eval_every_epoch=False, zero=stage,
                                 dp_shard=2)
    ref, _ = reference_run(cfg)
    bound = tolerance(cfg)
    for skip, inside in ((False, True), (True, False)):
        per_rank = run_ranks(_train, 4, cfg, skip, timeout=patience(300))
        diff = max(max((a - b).abs().max().item() for a, b in zip(params, ref)) for params in per_rank)
        assert (diff <= bound) == inside, (skip, diff, bound)
        if skip:
            assert diff > 100 * bound


def test_hybrid_sharding_refuses_what_it_cannot_be(refused_here):
    proc = refused_here("train", *MLP, "--dp-shard", "2", "--nproc-per-node", "2")
    assert "--dp-shard 2 is the size of a ZeRO shard group (hybrid sharding): give a stage too" in proc.stderr
    proc = refused_here("train", *MLP, "--zero", "2", "--dp-shard", "3", "--nproc-per-node", "4")
    assert "--dp-shard 3 does not divide the 4 replicas" in proc.stderr and "use a --dp-shard of 1, 2, 4" in proc.stderr
    proc = refused_here("train", *MLP, "--zero", "2", "--dp-shard", "2", "--zero-impl", "plain",
                        "--nproc-per-node", "4")
    assert "the plain ZeRO is the partition alone" in proc.stderr
    proc = refused_here("plan", *MLP, "--zero", "3", "--dp-shard", "3", "--dp", "4")
    assert "--dp-shard 3 does not divide the 4 replicas" in proc.stderr
