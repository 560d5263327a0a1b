"""shardtensor: a distributed tensor with per-rank (uneven) sharding shapes.

It speaks ``torch.distributed`` only, so the same code runs on simulated ranks,
gloo and NCCL. See :class:`ShardTensor` for the API.

PYTEST_DONT_REWRITE: a program may import this package before it runs pytest in-process,
and pytest would warn that it cannot rewrite it; it has no asserts to rewrite.
"""

from shardtensor._promotion import TensorPromotionMode
from shardtensor._scatter import scatter_tensor
from shardtensor._spec import ShardTensorSpec, TensorMeta, chunk_sharding_shapes, chunk_sizes
from shardtensor._sync import sync_module_over_mesh
from shardtensor._tensor import ShardTensor

__all__ = [
    "ShardTensor",
    "ShardTensorSpec",
    "TensorMeta",
    "TensorPromotionMode",
    "chunk_sharding_shapes",
    "chunk_sizes",
    "scatter_tensor",
    "sync_module_over_mesh",
]
