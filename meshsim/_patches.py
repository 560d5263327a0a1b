"""The process-global changes a running world needs, installed by the first world and removed by the last.

Reference counted, so worlds may overlap (worlds started from several threads),
and a process that never runs a world is never touched. Each change is undone
where it is made: here.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from meshsim import _integrations, _rng, _torch_private
from meshsim._backend import current_context
from meshsim._errors import WorldAborted

__all__ = ["enter_rank_thread", "install", "leave_rank_thread", "take_swallowed_interrupts", "uninstall"]


class _Patches:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved: dict[str, Any] = {}
        self.worlds: Any = None

    def acquire(self, backend_name: str, creator: Callable[..., Any]) -> None:
        with self._lock:
            self._users += 1
            if self._users == 1:
                self._install(backend_name, creator)

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._uninstall()

    def _install(self, backend_name: str, creator: Callable[..., Any]) -> None:
        tp, saved = _torch_private, self._saved
        self.worlds = tp.install_thread_worlds()
        saved["autograd threads"] = tp.disable_autograd_threads()
        saved["mesh init"] = tp.patch_device_mesh()
        saved["default timeout"] = tp.patch_default_timeout()
        saved["init"] = tp.patch_init_process_group(_adopt)
        saved["a2a"] = tp.patch_dtensor_cpu_alltoall()
        saved["backend"] = tp.register_backend(backend_name, creator)
        saved["rng"] = _rng.install()
        saved["imports"] = hook = _integrations.ImportHook()
        hook.install()
        _integrations.declare_loaded()
        saved["unraisable"] = sys.unraisablehook
        sys.unraisablehook = _unraisable_hook

    def _uninstall(self) -> None:
        tp, saved = _torch_private, self._saved
        if sys.unraisablehook is _unraisable_hook:
            sys.unraisablehook = saved["unraisable"]
        saved["imports"].uninstall()
        _rng.uninstall(saved["rng"])
        tp.unregister_backend(saved["backend"])
        tp.unpatch_dtensor_cpu_alltoall(saved["a2a"])
        tp.unpatch_init_process_group(saved["init"])
        tp.unpatch_default_timeout(saved["default timeout"])
        tp.unpatch_device_mesh(saved["mesh init"])
        tp.restore_autograd_threads(saved["autograd threads"])
        tp.uninstall_thread_worlds(self.worlds)
        tp.clear_dtensor_caches()
        self.worlds = None
        saved.clear()


_PATCHES = _Patches()

# Threads in which an interrupt (WorldAborted, raised asynchronously to stop a rank)
# landed where Python swallows exceptions: a __del__, a weakref or gc callback.
_SWALLOWED: set[int] = set()
_SWALLOWED_LOCK = threading.Lock()


def _unraisable_hook(unraisable: Any) -> None:
    """Note and hide a swallowed interrupt (the world interrupts that rank again); pass on the rest."""
    if isinstance(unraisable.exc_value, WorldAborted) or unraisable.exc_type is WorldAborted:
        with _SWALLOWED_LOCK:
            _SWALLOWED.add(threading.get_ident())
        return
    previous = _PATCHES._saved.get("unraisable", sys.__unraisablehook__)
    previous(unraisable)


def _adopt(arguments: dict[str, Any]) -> bool:
    """``init_process_group`` inside a rank thread: adopt the rank's own default group.

    A torchrun process initializes its process group once; a rank of a world already
    has one, made by meshsim. Code written for torchrun (a distributed manager's
    ``initialize()`` in a conftest or fixture) calls ``init_process_group`` anyway:
    the rank keeps its group (re-made if user code destroyed it) and the call
    returns, as it would have once connected. Outside rank threads torch's runs.

    Raises:
        ValueError: the call names a rank or world size the rank does not have.
    """
    context = current_context() if _torch_private.is_rank_thread() else None
    if context is None:
        return False
    for name, actual in (("rank", context.rank), ("world_size", context.world_size)):
        asked = arguments.get(name, -1)
        if asked is not None and asked != -1 and asked != actual:
            raise ValueError(
                f"init_process_group({name}={asked!r}) inside rank {context.rank} of a "
                f"{context.world_size}-rank meshsim world: the rank already has its process group, "
                f"with {name} {actual}. Pass the rank's own values (torchrun's RANK and WORLD_SIZE "
                "are set in every rank) or none."
            )
    if not dist.is_initialized():
        if context.init_default is None:
            return False
        context.init_default(context)
    return True


def take_swallowed_interrupts() -> set[int]:
    """Idents of the threads whose interrupt was swallowed since the last call."""
    with _SWALLOWED_LOCK:
        taken = set(_SWALLOWED)
        _SWALLOWED.clear()
    return taken


def install(backend_name: str, creator: Callable[..., Any]) -> None:
    """Install what a world needs, with its c10d backend, until the matching :func:`uninstall`.

    Every world passes the same ``backend_name`` and ``creator``: the creator finds
    its world through the calling rank thread.
    """
    _PATCHES.acquire(backend_name, creator)


def uninstall() -> None:
    """Undo one :func:`install`; the last one out removes every change."""
    _PATCHES.release()


def enter_rank_thread(*, gpu_paths: bool, group_timeout: datetime.timedelta | None = None) -> Any:
    """Make the calling thread a rank: its own c10d world, RNGs and mesh identity.

    ``group_timeout``: the timeout of the groups the rank makes without one. Returns
    what :func:`leave_rank_thread` takes to undo it, in the same thread (the world
    view entered: a later world may have installed another). Plain functions, not a context
    manager: every rank of every world runs them, and contextlib's generator
    machinery cost ~6% of a 4-rank no-op world's set-up and teardown.

    Must run between :func:`install` and :func:`uninstall`.
    """
    worlds = _PATCHES.worlds
    if worlds is None:
        raise RuntimeError("meshsim internal error: enter_rank_thread() outside a world")
    _torch_private.enter_rank_thread(worlds, gpu_paths=gpu_paths, group_timeout=group_timeout)
    _rng.enter_rank()
    return worlds


def leave_rank_thread(entered: Any) -> None:
    """Undo :func:`enter_rank_thread`, given what it returned, in the calling thread."""
    _rng.leave_rank()
    _torch_private.leave_rank_thread(entered)
