"""What is emulated (a :class:`Spec`: ``--mesh-cuda``, ``cuda=``, ``MESHSIM_CUDA``), what is installed."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ACTIVE", "Spec", "devices_wanted", "from_environment", "parse"]

CPU = torch.device("cpu")
REAL_CUDA: dict[str, Any] = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}


# -- what is emulated ---------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """An emulation: where storage lives, how many GPUs ``torch.cuda`` reports and what they are called.

    Attributes:
        storage: ``cpu``, or the one real GPU every rank's ``cuda:k`` lives on.
        devices: the GPUs each rank sees (at least the ranks per node, as torchrun gives).
        name: what ``get_device_name`` says; ``capability`` and ``memory`` (bytes) as
            ``get_device_properties`` reports them.
    """

    storage: torch.device
    devices: int = 8
    name: str = "NVIDIA H100 80GB HBM3 (meshsim, emulated)"
    capability: tuple[int, int] = (9, 0)
    memory: int = 80 * 1024**3
    processors: int = 132


def from_environment(world_size: int = 1) -> Spec | None:
    """The emulation ``MESHSIM_CUDA`` asks for (``MESHSIM_CUDA_DEVICES`` GPUs, default max(8, world_size))."""
    value = os.environ.get("MESHSIM_CUDA")
    if value is None:  # not emulating (every world asks): the GPU count means nothing then
        return None
    return parse(value, devices=devices_wanted(world_size))


def devices_wanted(world_size: int) -> int:
    """How many GPUs ranks see: ``MESHSIM_CUDA_DEVICES``, else a node's 8, or one per rank beyond that."""
    raw = os.environ.get("MESHSIM_CUDA_DEVICES")
    if raw is None:
        return max(8, world_size)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"MESHSIM_CUDA_DEVICES must be a positive int, got {raw!r}") from None


def parse(value: str | None, *, devices: int = 8) -> Spec | None:
    """``--mesh-cuda``'s, ``cuda=``'s and ``MESHSIM_CUDA``'s value as a :class:`Spec` (None: off).

    Raises:
        ValueError: not ``off``, ``cpu`` or ``cuda:N``; or ``cuda:N`` where this
            process has no such GPU.
    """
    if value is None or value in ("", "off", "0", "none"):
        return None
    if not isinstance(value, str):
        raise TypeError(f"cuda must be 'cpu', 'cuda:N' or None, got {value!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"the number of emulated GPUs must be a positive int, got {devices!r}")
    if value == "cpu":
        return Spec(CPU, devices)
    if value.startswith("cuda"):
        try:
            device = torch.device(value)
        except RuntimeError:
            device = None
        if device is not None and device.type == "cuda":
            index = 0 if device.index is None else device.index
            available = REAL_CUDA["device_count"]() if REAL_CUDA["is_available"]() else 0
            if index >= available:
                raise ValueError(
                    f"cuda={value!r} puts every rank on that GPU, but this process sees {available} "
                    "CUDA device(s). On a machine without a GPU use cuda='cpu' (--mesh-cuda=cpu)."
                )
            return Spec(torch.device("cuda", index), devices)
    raise ValueError(
        f"cuda must be 'cpu' (CUDA emulated on the CPU), 'cuda:N' (every rank on that one GPU) or "
        f"'off', got {value!r}"
    )


class _Active:
    """The emulation now installed (``spec``), how many worlds and sessions use it, and its undo steps."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spec: Spec | None = None
        self.users = 0
        self.undo: list[Callable[[], None]] = []
        self.real_generators: tuple[Any, ...] = ()  # the real GPU's, with cuda:N storage


ACTIVE = _Active()
