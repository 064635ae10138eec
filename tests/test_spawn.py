"""The shared spawn helper must surface failures and hangs, or every distributed test is blind."""

import pytest
import torch
import torch.distributed as dist

from distlab.spawn import RankFailure, run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("boom on one")
    return rank


def _hang_on_rank0(rank, world):
    if rank == 0:
        dist.barrier()  # rank 1 never joins: the group timeout turns the hang into an error
    return rank


def test_results_come_back_per_rank():
    assert run_ranks(_sum_ranks, 3, timeout=60) == [6.0, 6.0, 6.0]


def test_rank_exception_is_reraised_with_rank_named():
    with pytest.raises(RankFailure, match=r"rank 1 failed(.|\n)*ValueError: boom on one"):
        run_ranks(_fail_on_rank1, 2, timeout=60)


def test_hang_becomes_an_error():
    with pytest.raises(RankFailure, match="rank 0"):
        run_ranks(_hang_on_rank0, 2, timeout=8)
