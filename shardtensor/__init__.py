"""shardtensor: a distributed tensor with per-rank (uneven) sharding shapes.

It speaks ``torch.distributed`` only, so the same code runs on simulated ranks,
gloo and NCCL. See :class:`ShardTensor` for the API.
"""

from shardtensor._spec import ShardTensorSpec, chunk_sizes
from shardtensor._tensor import ShardTensor

__all__ = ["ShardTensor", "ShardTensorSpec", "chunk_sizes"]
