"""Parallel strategies applied to a built model: data parallel and synchronized batch norm
(model-state parallelism follows)."""

from distlab.parallel.data_parallel import COLLECTIVES, SYNC_METHODS, DataParallel
from distlab.parallel.sync_bn import SyncBatchNorm, convert_sync_batchnorm

SYNC_BN = ("off", "distlab", "torch")

__all__ = ["COLLECTIVES", "DataParallel", "SYNC_BN", "SYNC_METHODS", "SyncBatchNorm", "convert_sync_batchnorm"]
