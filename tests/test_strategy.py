"""Strategy: one text form that round-trips, checks that name fields, and the SyncBN group under tensor parallel."""

import pytest

from distlab import runtime
from distlab.errors import ConfigError
from distlab.parallel import Strategy
from distlab.launch.spawn import run_ranks
from distlab.train import Trainer, TrainConfig
from distlab.tools.verify import default_strategies, parse_strategy, tolerance


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_verified_strategy_round_trips_through_text_and_json(world):
    for case in default_strategies(world):
        s = case.strategy
        assert Strategy.parse(str(s)) == s, str(s)
        assert Strategy.from_dict(s.to_dict()) == s
        assert parse_strategy(case.name) == case
    assert parse_strategy("allreduce+adam").optimizer == "adam"


def test_text_form_spellings_and_aliases():
    s = Strategy.parse("bucketed:ring+accum=4+tp=2+naive+syncbn+bucket=5")
    assert (s.dp_sync, s.collective, s.grad_accum, s.tp, s.tp_style, s.sync_bn, s.bucket_mb) == \
        ("bucketed", "ring", 4, 2, "naive", "distlab", 5.0)
    assert Strategy.parse("dp_sync=ddp+collective=ring") == Strategy("ddp", "ring")  # plan's KEY=VALUE form
    assert Strategy.parse("zero=3") == Strategy(dp_sync="allreduce", zero=3)  # ZeRO's own sync, no method
    assert str(Strategy()) == "bucketed"  # the default method
    assert Strategy(tp=1, tp_style="naive") == Strategy()  # the style means nothing without tensor parallel
    # summary.json from before the Strategy class (no find_unused key) still reads
    old = {"dp_sync": "allreduce", "collective": "native", "bucket_mb": 25.0, "zero": 1, "tp": 1, "tp_style": None,
           "sync_bn": "off", "grad_accum": 1}
    # it ran ZeRO on the backend's own collectives, which is no longer ZeRO's default: kept
    assert str(Strategy.from_dict(old)) == "allreduce:native+zero=1"
    assert Strategy.parse("allreduce:native+zero=1") == Strategy.from_dict(old)
    assert Strategy.parse("zero=1").collective == "auto" and Strategy().collective == "native"
    assert Strategy().replace(zero=1) == Strategy(zero=1)  # defaults follow the layout


@pytest.mark.parametrize("text,message", [
    ("bucketed+zero=1", "`zero` 1 does its own gradient sync.*`dp_sync` bucketed"),
    ("gather-scatter:ring", "`dp_sync` gather-scatter is its own communication pattern"),
    ("allreduce+accum=0", "`grad_accum` must be at least 1, not 0"),
    ("allreduce+zero=4", "unknown `zero` 4"),
    ("allreduce+frobnicate", "'frobnicate' is not a modifier"),
    ("allreduce+tp=x", "tp='x' is not a int"),
    ("", "cannot read strategy"),
])
def test_bad_strategies_name_the_field(text, message):
    with pytest.raises(ConfigError, match=message):
        Strategy.parse(text)


def test_the_mesh_and_batch_are_checked_with_numbers():
    with pytest.raises(ConfigError, match="`tp` 3 does not divide the world size 4"):
        Strategy(tp=3).check(4)
    with pytest.raises(ConfigError, match=r"must split into `grad_accum` 4 .* use a multiple of 8"):
        Strategy(grad_accum=4).check_batch(12, 2)


# ----------------------------------------------------------------------------- SyncBN under tensor parallel

def _tp_bn_cfg(tp: int) -> TrainConfig:
    # mlp-bn: the (column, row) block, then BatchNorm1d over its replicated output, then the head.
    return TrainConfig.from_flags(model="mlp-bn", mlp_widths=(32, 16), dataset="synthetic:1x8x8:4:192", epochs=1,
                                  max_steps=6, global_batch_size=16, lr=0.1, lr_schedule="constant", momentum=0.9,
                                  seed=2, log_every=1, progress=False, verbose=False, eval_every_epoch=False,
                                  dp_sync="allreduce", sync_bn="distlab", tp=tp)


def _train_tp_bn(rank, world, tp):
    trainer = Trainer(_tp_bn_cfg(tp), runtime.from_process_group())
    trainer.fit()
    return trainer.engine.full_state_dict()


def test_syncbn_under_tensor_parallel_reduces_over_the_data_parallel_group_only():
    """4 ranks as dp 2 x tp 2 end where 2 ranks of plain data parallel end: the statistics of a global
    batch of 16 samples, not 32. Each sample counted tp times would move the unbiased running variance
    by (16/15) / (32/31) - 1 = 3.3% relative; the parameters of the two runs agree within verify's float32
    bound (2.3e-5), and the statistics, computed from them, within a tenth of that 3.3%."""
    signature = (16 / 15) / (32 / 31) - 1
    bound = tolerance(_tp_bn_cfg(2), 4)
    two = run_ranks(_train_tp_bn, 2, 1, timeout=120)[0]
    for four in run_ranks(_train_tp_bn, 4, 2, timeout=120):
        assert list(four) == list(two)
        for key, value in four.items():
            if key.endswith(("running_mean", "running_var")):
                assert ((value - two[key]).abs() / two[key].abs().clamp(min=1.0)).max() <= signature / 10, key
            elif value.is_floating_point():
                assert (value - two[key]).abs().max() <= bound, key


def test_a_runs_label_leaves_out_the_default_sync_where_nothing_is_synchronised():
    from distlab.parallel import Strategy
    assert Strategy.parse("pp=2").label(2) == "pp=2+mb=2+1f1b"
    assert Strategy.parse("pp=2").label(4) == "bucketed+pp=2+mb=2+1f1b"  # two data-parallel ranks
    assert Strategy.parse("allreduce+tp=2").label(2) == "allreduce+tp=2"  # asked for by name: kept
    assert Strategy().label(1) == "single process" and Strategy.parse("accum=4").label(1) == "accum=4"
    assert Strategy.parse("bucketed:ring+tp=2").label(2) == "bucketed:ring+tp=2"


def test_verify_names_every_modifier_and_answers_a_near_miss(run_cli):
    helped = run_cli("verify", "--help", check=True).stdout
    for modifier in ("+cp=N", "+ulysses", "+ep=N", "+zb", "+vpp=V", "+gpt-moe", "+gpipe", "+ckpt", "+adam"):
        assert modifier in helped.replace("\n", " ").replace("  ", " "), modifier
    from distlab.errors import ConfigError
    from distlab.tools.verify import parse_strategy
    with pytest.raises(ConfigError, match=r"'moe' is not a modifier \(did you mean gpt-moe\?\)"):
        parse_strategy("bucketed+ep=2+moe")
    with pytest.raises(ConfigError, match=r"'ulyses' is not a modifier \(did you mean ulysses\?\)"):
        parse_strategy("bucketed+cp=2+ulyses")
    assert parse_strategy("bucketed+pp=2+mb=4+zb+gpt").model == "gpt"
