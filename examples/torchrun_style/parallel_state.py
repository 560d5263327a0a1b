"""A parallel-state module shaped like Megatron's: the process's groups are module globals.

Every process builds every tensor-parallel group (``new_group`` is collective) and keeps
the one it belongs to; a gloo side group of the same ranks serves CPU tensors, and an NCCL
one is made where CUDA is (the default group's backend, on simulated ranks under
``--mesh-cuda=cpu``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TENSOR_MODEL_PARALLEL_GROUP = None
_TENSOR_MODEL_PARALLEL_GROUP_GLOO = None
_TENSOR_MODEL_PARALLEL_GROUP_NCCL = None
_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(tensor_parallel_size: int = 1) -> None:
    """Split the world into tensor-parallel groups of consecutive ranks, data-parallel ones across them."""
    global _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP_GLOO
    global _TENSOR_MODEL_PARALLEL_GROUP_NCCL, _DATA_PARALLEL_GROUP
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not divide the world of {world}")
    nccl = torch.cuda.is_available() and dist.get_backend() == "nccl"
    for start in range(0, world, tensor_parallel_size):
        ranks = list(range(start, start + tensor_parallel_size))
        group = dist.new_group(ranks)
        gloo = dist.new_group(ranks, backend="gloo")
        side = dist.new_group(ranks, backend="nccl") if nccl else None
        if rank in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP_GLOO = group, gloo
            _TENSOR_MODEL_PARALLEL_GROUP_NCCL = side
    for offset in range(tensor_parallel_size):
        ranks = list(range(offset, world, tensor_parallel_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _DATA_PARALLEL_GROUP = group


def destroy_model_parallel() -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP_GLOO
    global _TENSOR_MODEL_PARALLEL_GROUP_NCCL, _DATA_PARALLEL_GROUP
    _TENSOR_MODEL_PARALLEL_GROUP = _TENSOR_MODEL_PARALLEL_GROUP_GLOO = None
    _TENSOR_MODEL_PARALLEL_GROUP_NCCL = _DATA_PARALLEL_GROUP = None


def get_tensor_model_parallel_group(*, gloo: bool = False):
    group = _TENSOR_MODEL_PARALLEL_GROUP_GLOO if gloo else _TENSOR_MODEL_PARALLEL_GROUP
    if group is None:
        raise RuntimeError("tensor model parallel group is not initialized")
    return group


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_data_parallel_group():
    if _DATA_PARALLEL_GROUP is None:
        raise RuntimeError("data parallel group is not initialized")
    return _DATA_PARALLEL_GROUP
