"""A Borg-style distributed manager, as projects write them: every instance shares one dict."""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist


class Manager:
    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.__dict__ = self._shared_state

    @classmethod
    def is_initialized(cls) -> bool:
        return bool(cls._shared_state.get("initialized"))

    @classmethod
    def initialize(cls) -> None:
        """Join the job as torchrun describes it (RANK, WORLD_SIZE, MASTER_ADDR, ...)."""
        if cls.is_initialized():
            return
        manager = cls()
        manager.rank = int(os.environ["RANK"])
        manager.world_size = int(os.environ["WORLD_SIZE"])
        manager.device = torch.device("cpu")
        manager.meshes_built = 0
        manager.configured = 0
        dist.init_process_group("gloo", rank=manager.rank, world_size=manager.world_size)
        manager.initialized = True

    def initialize_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        shape = tuple(self.world_size // -prod(shape) if d == -1 else d for d in shape)
        self.meshes_built += 1
        return dist.init_device_mesh("cpu", shape, mesh_dim_names=names)

    @classmethod
    def cleanup(cls) -> None:
        if cls.is_initialized() and dist.is_initialized():
            dist.destroy_process_group()
        cls._shared_state = {}


def prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
