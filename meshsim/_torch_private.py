"""Every private torch API meshsim depends on, and the process-global patches built on them.

Checked against torch 2.11, 2.12, 2.13 and 2.14 source. Nothing outside this module
touches a ``torch._C`` name or a private ``torch.distributed`` attribute; when torch
moves one of these, this is the only file to change.

The patches are reference counted: the first world to start installs them, the last
world to end removes them, so worlds may overlap (worlds started from several threads)
and a process that never runs a world is never touched.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future, _resolve_process_group

__all__ = [
    "completed_work",
    "process_global_patches",
    "rank_thread",
    "resolve_group",
]

ReduceOpType = Any  # torch.distributed.ReduceOp.RedOpType, untyped in the stubs


def completed_work(result: object = None) -> dist.Work:
    """A Work that is already complete, whose future holds ``result``."""
    # torch._C.Future skips torch.futures.Future's Python constructor: this runs
    # once per rank per collective.
    fut = torch._C.Future([])
    fut.set_result(result)
    return _create_work_from_future(fut)


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` in this thread's registry."""
    return _resolve_process_group(group_name)


class _RankWorld:
    """One rank thread's c10d state: what ``c10d._World`` keeps in module globals."""

    def __init__(self) -> None:
        self.default_pg: dist.ProcessGroup | None = None
        self.pg_map: dict[Any, Any] = {}
        self.pg_names: dict[Any, Any] = {}
        self.pg_group_ranks: dict[Any, dict[int, int]] = {}
        self.pg_backend_config: dict[Any, str] = {}
        self.group_count = 0
        self.tags_to_pg: dict[str, list[Any]] = {}
        self.pg_to_tag: dict[Any, str] = {}
        self.pg_coalesce_state: dict[Any, list[Any]] = {}
        self.comms: list[Any] = []

    # The profiler reads this; c10d's implementation only uses the fields above.
    pg_config_info = c10d._World.pg_config_info


class _ThreadWorlds:
    """Stands in for ``c10d._world``: a rank thread sees its own world, others the original."""

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_local", threading.local())

    def _current(self) -> Any:
        world = getattr(self._local, "world", None)
        return self._original if world is None else world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._current(), name, value)


class _Patches:
    """The reference-counted process-global changes a running world needs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: dict[str, Any] = {}
        self.worlds: _ThreadWorlds | None = None
        self.local = threading.local()  # .token, .gpu_paths for rank threads

    def acquire(self, backend_name: str, creator: Callable[..., Any]) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._install()
                self._saved["backend"] = _register_backend(backend_name, creator)

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._uninstall()

    def _install(self) -> None:
        saved = self._saved
        saved["world"] = c10d._world
        self.worlds = _ThreadWorlds(c10d._world)
        c10d._world = self.worlds
        # Funcol and DTensor find groups by name in a C++ registry; per-thread
        # registries keep rank threads' identically named groups apart. There is no
        # public getter, so we assume it was off, as it is unless torch's own
        # threaded test harness is running.
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        # CUDA backward otherwise runs in autograd's device threads, which are not
        # rank threads; torch's own threaded PG makes the same change.
        saved["autograd_mt"] = torch._C._is_multithreading_enabled()
        torch._C._set_multithreading_enabled(False)
        saved["mesh_init"] = _patch_device_mesh()
        saved["a2a"] = _patch_dtensor_cpu_alltoall(self.local)

    def _uninstall(self) -> None:
        saved = self._saved
        if c10d._world is self.worlds:
            c10d._world = saved["world"]
        self.worlds = None
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch._C._set_multithreading_enabled(saved["autograd_mt"])
        _unpatch_device_mesh(saved["mesh_init"])
        _unpatch_dtensor_cpu_alltoall(saved["a2a"])
        _unregister_backend(saved["backend"])
        clear_dtensor_caches()
        saved.clear()


_PATCHES = _Patches()
_TOKENS = itertools.count(1)


@contextmanager
def process_global_patches(backend_name: str, creator: Callable[..., Any]) -> Iterator[None]:
    """Install the patches a world needs, and its c10d backend, for the block.

    Every world passes the same ``backend_name`` and ``creator``: the creator finds
    its world through the calling rank thread.
    """
    _PATCHES.acquire(backend_name, creator)
    try:
        yield
    finally:
        _PATCHES.release()


@contextmanager
def rank_thread(*, gpu_paths: bool) -> Iterator[None]:
    """Mark the calling thread as a rank thread with its own c10d world.

    Must run inside :func:`process_global_patches`.
    """
    worlds = _PATCHES.worlds
    if worlds is None:
        raise RuntimeError("meshsim internal error: rank_thread() outside a world")
    worlds._local.world = _RankWorld()
    # DeviceMesh hashes and compares by _thread_id; a unique token per rank thread
    # keeps torch's process-wide redistribute-plan cache from handing one rank's
    # plan (which embeds its mesh coordinate) to another. Thread idents are reused
    # after a thread ends, so they are not unique enough.
    _PATCHES.local.token = next(_TOKENS)
    _PATCHES.local.gpu_paths = gpu_paths
    try:
        yield
    finally:
        _PATCHES.local.token = None
        _PATCHES.local.gpu_paths = False
        worlds._local.world = None


def _patch_device_mesh() -> Callable[..., None]:
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    local = _PATCHES.local

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        token = getattr(local, "token", None)
        if token is not None:
            self._thread_id = token
            self._hash = None

    DeviceMesh.__init__ = __init__  # type: ignore[method-assign]
    return original


def _unpatch_device_mesh(original: Callable[..., None]) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    DeviceMesh.__init__ = original  # type: ignore[method-assign]


class _NotLocalTensorMode:
    """Returned to DTensor's CPU check so that it takes the all_to_all path."""


def _patch_dtensor_cpu_alltoall(local: threading.local) -> Callable[[], Any]:
    # torch/distributed/tensor/_collective_utils.py:shard_dim_alltoall falls back to
    # all_gather + chunk when `mesh.device_type == "cpu" and local_tensor_mode() is
    # None`. GPUs take one all_to_all; a simulated mesh should record what GPUs do.
    from torch.distributed.tensor import _collective_utils

    original: Callable[[], Any] = _collective_utils.local_tensor_mode
    marker = _NotLocalTensorMode()

    def local_tensor_mode() -> Any:
        mode = original()
        if mode is None and getattr(local, "gpu_paths", False):
            return marker
        return mode

    _collective_utils.local_tensor_mode = local_tensor_mode  # type: ignore[assignment]
    return original


def _unpatch_dtensor_cpu_alltoall(original: Callable[[], Any]) -> None:
    from torch.distributed.tensor import _collective_utils

    _collective_utils.local_tensor_mode = original  # type: ignore[assignment]


def clear_dtensor_caches() -> None:
    """Forget DTensor's process-wide plan caches, which hold meshes of ended worlds."""
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is None:
        return
    cached = getattr(redistribute, "_gen_transform_infos", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()
    clear_planner = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if clear_planner is not None:
        clear_planner()


_BACKEND_TABLES = (
    "backend_list",
    "backend_capability",
    "backend_type_map",
    "default_device_backend_map",
    "_plugins",
)


def _register_backend(name: str, creator: Callable[..., Any]) -> dict[str, Any]:
    """Register a c10d backend plugin; returns what :func:`_unregister_backend` needs."""
    backend = dist.Backend
    saved: dict[str, Any] = {t: _copy(getattr(backend, t)) for t in _BACKEND_TABLES}
    saved["had_attr"] = hasattr(backend, name.upper())
    saved["name"] = name
    backend.register_backend(name, creator, extended_api=True, devices=["cpu", "cuda"])
    return saved


def _unregister_backend(saved: dict[str, Any]) -> None:
    backend = dist.Backend
    for table in _BACKEND_TABLES:
        current = getattr(backend, table)
        current.clear()  # in place: other modules may hold these objects
        if isinstance(current, list):
            current.extend(saved[table])
        else:
            current.update(saved[table])
    if not saved["had_attr"]:
        delattr(backend, saved["name"].upper())


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else dict(value)


def reduce_op_value(reduce_op: Any) -> int:
    """The ``RedOpType`` value of a ReduceOp as c10d operators receive it (a ScriptObject)."""
    return int(reduce_op.op())


def as_process_group(group: Any) -> dist.ProcessGroup:
    """A ProcessGroup from what c10d and functional operators receive: a name or a ScriptObject."""
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        return resolve_group(group)
    return dist.ProcessGroup.unbox(group)


def premul_factor(reduce_op: Any) -> float | torch.Tensor:
    """The scale factor of a PREMUL_SUM ``ReduceOp`` (``torch.distributed._make_nccl_premul_sum``)."""
    return reduce_op.factor
