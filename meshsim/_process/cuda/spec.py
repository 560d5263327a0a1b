"""What is emulated: a :class:`Spec`, the value ``--mesh-cuda``, ``cuda=`` and ``meshsim run --cuda`` carry.

The setting is resolved once, where options are resolved (:func:`resolve`: the plugin's
``--mesh-cuda``, ``meshsim.run``'s ``cuda=``; ``MESHSIM_CUDA`` is their default and
``MESHSIM_CUDA_DEVICES`` the GPU count's), and then travels as a value into the world
that uses it. A world sizes it to its own ranks per node (:meth:`Spec.sized`); each
thread that emulates answers with its own sized spec (:func:`spec_here`, from the rank
context).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from meshsim._base.context import current

__all__ = ["IN_USE", "Spec", "devices_from_environment", "parse", "resolve", "spec_here"]

CPU = torch.device("cpu")
REAL_CUDA: dict[str, Any] = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count")}
NODE_GPUS = 8  # the GPUs of one node, when the world has no more ranks per node


@dataclass(frozen=True)
class Spec:
    """An emulation: where storage lives, how many GPUs ``torch.cuda`` reports and what they are called.

    Attributes:
        storage: ``cpu``, or the one real GPU every rank's ``cuda:k`` lives on.
        devices: the GPUs each rank sees; None until a world sizes it (:meth:`sized`): a
            node's 8, or the world's ranks per node where that is larger, as torchrun gives.
        name: what ``get_device_name`` says; ``capability`` and ``memory`` (bytes) as
            ``get_device_properties`` reports them.
    """

    storage: torch.device
    devices: int | None = None
    name: str = "NVIDIA H100 80GB HBM3 (meshsim, emulated)"
    capability: tuple[int, int] = (9, 0)
    memory: int = 80 * 1024**3
    processors: int = 132

    def sized(self, ranks_per_node: int) -> Spec:
        """This emulation for a world of ``ranks_per_node`` ranks per node (a count set by the user stays)."""
        if self.devices is not None:
            return self
        return dataclasses.replace(self, devices=max(NODE_GPUS, ranks_per_node))

    @property
    def count(self) -> int:
        """The GPUs ``torch.cuda.device_count()`` reports."""
        return self.devices if self.devices is not None else NODE_GPUS

    @property
    def text(self) -> str:
        """The storage as ``--mesh-cuda`` spells it: ``cpu`` or ``cuda:N``."""
        return "cpu" if self.storage.type == "cpu" else f"cuda:{self.storage.index or 0}"


def resolve(value: str | Spec | None) -> Spec | None:
    """The emulation a face asks for: ``value`` (a string parsed), else ``MESHSIM_CUDA``'s (None: off).

    ``MESHSIM_CUDA_DEVICES``, where set, is the GPU count; otherwise each world sizes it.

    Raises:
        TypeError, ValueError: as :func:`parse`.
    """
    if isinstance(value, Spec):
        return value
    if value is None:
        value = os.environ.get("MESHSIM_CUDA")
        if value is None:
            return None
    return parse(value, devices=devices_from_environment())


def devices_from_environment() -> int | None:
    """``MESHSIM_CUDA_DEVICES``: how many GPUs ranks see (None where unset: each world decides)."""
    raw = os.environ.get("MESHSIM_CUDA_DEVICES")
    if raw is None:
        return None
    try:
        devices = int(raw)
    except ValueError:
        devices = 0
    if devices < 1:
        raise ValueError(f"MESHSIM_CUDA_DEVICES must be a positive int, got {raw!r}")
    return devices


def parse(value: str | None, *, devices: int | None = None) -> Spec | None:
    """``--mesh-cuda``'s, ``cuda=``'s and ``MESHSIM_CUDA``'s value as a :class:`Spec` (None: off).

    Raises:
        ValueError: not ``off``, ``cpu`` or ``cuda:N``; or ``cuda:N`` where this
            process has no such GPU.
    """
    if value is None or value in ("", "off", "0", "none"):
        return None
    if not isinstance(value, str):
        raise TypeError(f"cuda must be 'cpu', 'cuda:N' or None, got {value!r}")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
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


class _InUse:
    """The emulations the process's users (worlds, the pytest process, a child) installed, oldest first.

    A thread that emulates answers with its own spec (the rank context's). This list
    answers only threads that no world or session entered (a thread user code started
    in a rank, such as a DataLoader's pin-memory thread): they see the newest.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.specs: list[Spec] = []
        self.real_generators: tuple[Any, ...] = ()  # the real GPU's, with cuda:N storage

    def add(self, spec: Spec) -> None:
        with self._lock:
            self.specs.append(spec)

    def remove(self, spec: Spec) -> None:
        with self._lock:
            for i in range(len(self.specs) - 1, -1, -1):
                if self.specs[i] is spec:
                    del self.specs[i]
                    return

    def newest(self) -> Spec | None:
        specs = self.specs
        return specs[-1] if specs else None


IN_USE = _InUse()

_HERE = current()  # one object; its fields are per thread


def spec_here() -> Spec | None:
    """The emulation the calling thread answers with: its own (rank context), else the newest in use."""
    mode = _HERE.cuda
    if mode is not None:
        return mode.spec  # type: ignore[no-any-return]
    return IN_USE.newest()
