"""Parallel strategies applied to a built model.

``Strategy`` describes a layout; ``parallelize(model, strategy, mesh)`` applies it and returns the
``Engine`` a training loop drives. The pieces are usable on their own: ``DataParallel`` (gradient
sync methods by name; ``SyncMethod`` is their base, a user's own subclassing it: ``--dp-sync FILE.py:NAME``),
``SyncBatchNorm``, the tensor-parallel layers and their mappings (and the
transformer's: heads, vocabulary, sequence), ``PipelineStage`` (GPipe, 1F1B), ``Zero`` (stages 1-3)
and the ``Mesh`` of data x tensor parallel groups.
"""

from distlab.parallel.compression import CastCodec, Codec, PowerSGD, build_codec
from distlab.parallel.data_parallel import COLLECTIVES, SYNC_METHODS, DataParallel
from distlab.parallel.engine import Engine
from distlab.parallel.mesh import Mesh, build_mesh
from distlab.parallel.parallelize import parallelize
from distlab.parallel.precision import LossScaler, Precision
from distlab.parallel.pipeline import SCHEDULES as PP_SCHEDULES, PipelineStage, partition
from distlab.parallel.strategy import Strategy
from distlab.parallel.sync_bn import MODES as SYNC_BN, SyncBatchNorm, apply_sync_bn, convert_sync_batchnorm
from distlab.parallel.sync_methods import SyncMethod
from distlab.parallel.tensor_parallel import (STYLES as TP_STYLES, ColumnParallelLinear, RowParallelLinear,
                                              copy_to_group, gather_from_group, reduce_from_group, split_to_group)
from distlab.parallel.tensor_parallel.plan import apply_tensor_parallel
from distlab.parallel.zero import STAGES as ZERO_STAGES, Shard, Zero

__all__ = ["COLLECTIVES", "ColumnParallelLinear", "DataParallel", "Engine", "Mesh", "PP_SCHEDULES", "PipelineStage",
           "RowParallelLinear", "SYNC_BN",
           "SYNC_METHODS", "Shard", "Strategy", "SyncBatchNorm", "SyncMethod", "TP_STYLES", "ZERO_STAGES", "Zero",
           "apply_sync_bn", "CastCodec", "Codec", "PowerSGD", "build_codec", "LossScaler", "Precision", "apply_tensor_parallel", "build_mesh", "convert_sync_batchnorm", "copy_to_group",
           "gather_from_group", "parallelize", "partition", "reduce_from_group", "split_to_group"]
