"""Parallel strategies applied to a built model: data parallel (more strategies follow)."""

from distlab.parallel.data_parallel import SYNC_METHODS, DataParallel

__all__ = ["DataParallel", "SYNC_METHODS"]
