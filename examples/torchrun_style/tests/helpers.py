"""A test helper as torchrun-launched suites write them: the rank is read once, at import."""

from __future__ import annotations

import os

import parallel_state
import torch


class Utils:
    """What each process computes when it imports this module (Megatron's ``Utils`` does the same)."""

    rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])

    @staticmethod
    def initialize_model_parallel(tensor_parallel_size: int = 1) -> None:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_parallel_size)

    @staticmethod
    def destroy_model_parallel() -> None:
        parallel_state.destroy_model_parallel()
        torch.distributed.barrier()
