"""Parallel strategies applied to a built model: data parallel, synchronized batch norm, the 2-D
mesh, tensor parallel and ZeRO 1-3."""

from distlab.parallel.data_parallel import COLLECTIVES, SYNC_METHODS, DataParallel
from distlab.parallel.mesh import Mesh, build_mesh
from distlab.parallel.sync_bn import SyncBatchNorm, convert_sync_batchnorm
from distlab.parallel.tensor_parallel import (STYLES as TP_STYLES, ColumnParallelLinear, RowParallelLinear,
                                              apply_tensor_parallel)
from distlab.parallel.zero import STAGES as ZERO_STAGES, Zero

SYNC_BN = ("off", "distlab", "torch")

__all__ = ["COLLECTIVES", "ColumnParallelLinear", "DataParallel", "Mesh", "RowParallelLinear", "SYNC_BN",
           "SYNC_METHODS", "SyncBatchNorm", "TP_STYLES", "ZERO_STAGES", "Zero", "apply_tensor_parallel",
           "build_mesh", "convert_sync_batchnorm"]
