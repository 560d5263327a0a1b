"""Per-thread c10d worlds: each rank thread sees process groups of its own.

c10d keeps its process groups in module globals (``c10d._world``) and in a C++
registry of group names; a process has one of each. Rank threads are many ranks
in one process, so while a world runs ``c10d._world`` is a per-thread view
(:class:`ThreadWorlds`) and the C++ registry is per thread (torch's thread
isolation mode, which its own threaded test harness uses). A rank thread enters
a fresh, empty world of its own (:func:`enter_rank_thread`); any other thread
sees the process's.

Private torch names used here, checked in torch 2.11, 2.12, 2.13, 2.14 and 2.15:
``c10d._world`` and the fields of ``c10d._World``, ``_World.pg_config_info``,
``c10d.BackendConfig``, and from ``torch._C._distributed_c10d``
``_set_thread_isolation_mode``, ``_register_process_group``,
``_unregister_all_process_groups``, ``_resolve_process_group``, ``PrefixStore``.
"""

from __future__ import annotations

import datetime
import itertools
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    PrefixStore,
    Store,
    _resolve_process_group,
)

from meshsim._base.context import current

__all__ = [
    "ThreadWorlds",
    "as_process_group",
    "default_group_store",
    "enter_rank_thread",
    "forget_groups",
    "install",
    "install_default_group",
    "leave_rank_thread",
    "resolve_group",
    "thread_groups",
]


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
        self.pg_flight_recorder_hooks: dict[Any, Any] = {}  # torch 2.15
        self.comms: list[Any] = []


# threading.local's own attribute setter: it picks the calling thread's dict
_set = threading.local.__setattr__


class ThreadWorlds(threading.local):
    """Stands in for ``c10d._world``: a rank thread sees its own world, others the original.

    A ``threading.local``: in a rank thread, c10d's fields are plain attributes of
    that thread's view, the cheapest lookup there is (c10d reads several on every
    collective); in any other thread every name falls through to the original.
    """

    # computed from the fields (_RankWorld's), so right in either kind of thread
    pg_config_info = c10d._World.pg_config_info

    def __init__(self, original: Any) -> None:
        # threading.local runs this again in each thread that touches the view
        _set(self, "_original", original)
        _set(self, "_in_rank", False)

    def __getattr__(self, name: str) -> Any:
        # reached only for names this thread's view does not hold
        if self._in_rank:
            raise AttributeError(f"a rank thread's c10d world has no field {name!r}")
        return getattr(self._original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._in_rank:
            _set(self, name, value)
        else:
            setattr(self._original, name, value)

    def enter(self) -> None:
        """Give the calling thread a fresh, empty world of its own."""
        fields = vars(self)  # this thread's
        fields.update(vars(_RankWorld()))
        fields["_in_rank"] = True

    def leave(self) -> None:
        """Make the calling thread see the original world again."""
        fields = vars(self)
        original = fields["_original"]
        fields.clear()
        fields.update(_original=original, _in_rank=False)


def install() -> tuple[ThreadWorlds, Callable[[], None]]:
    """Replace ``c10d._world`` with a per-thread view: the view, and the step that undoes it."""
    worlds = ThreadWorlds(c10d._world)
    c10d._world = worlds  # type: ignore[assignment]
    # Funcol and DTensor find groups by name in a C++ registry; per-thread
    # registries keep rank threads' identically named groups apart. There is no
    # public getter, so we assume it was off, as it is unless torch's own
    # threaded test harness is running.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]

    def undo() -> None:
        if c10d._world is worlds:  # type: ignore[comparison-overlap]
            c10d._world = worlds._original
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]

    return worlds, undo


# -- which threads are ranks -----------------------------------------------------------

_TOKENS = itertools.count(1)


def enter_rank_thread(
    worlds: ThreadWorlds, *, gpu_paths: bool, group_timeout: datetime.timedelta | None = None
) -> None:
    """Give the calling thread its own c10d world and mark it as a rank (in its rank context).

    ``gpu_paths``: DTensor takes the paths it takes on GPUs (see :mod:`meshsim._process.patches`);
    ``group_timeout``: the timeout of groups made without one (``new_group``, meshes).
    """
    worlds.enter()
    here = current()
    here.c10d = worlds
    # DeviceMesh hashes and compares by _thread_id; a unique token per rank thread
    # keeps torch's process-wide redistribute-plan cache from handing one rank's
    # plan (which embeds its mesh coordinate) to another. Thread idents are reused
    # after a thread ends, so they are not unique enough.
    here.mesh_token = next(_TOKENS)
    here.gpu_paths = gpu_paths
    here.group_timeout = group_timeout


def leave_rank_thread() -> None:
    """Undo :func:`enter_rank_thread` in the calling thread: it sees the process's c10d world again."""
    here = current()
    worlds, here.c10d = here.c10d, None
    here.mesh_token = None
    here.gpu_paths = False
    here.group_timeout = None
    if worlds is not None:
        worlds.leave()


# -- a rank's process groups -----------------------------------------------------------

_BACKEND_CONFIGS: dict[str, str] = {}


def install_default_group(pg: dist.ProcessGroup, backend: str, store: Store, world_size: int) -> None:
    """Make ``pg``, of ``world_size`` ranks, this thread's default group as ``init_process_group`` would.

    ``store`` should be what c10d keeps for a default group: the world's store
    under the prefixes ``default_pg`` and ``0/`` (see :func:`default_group_store`).

    ``init_process_group`` costs ~250 us per rank, most of it generic checks and a
    throwaway C++ ProcessGroup; a 4-rank world must set up in well under 1 ms.
    This writes the same c10d state directly (pinned by tests/meshsim/
    test_thread_worlds.py against the real call, so a torch change is caught).
    """
    world = c10d._world
    name: Any = str(world.group_count)  # a GroupName in torch's stubs; a str at run time
    world.group_count += 1
    pg._set_group_name(name)
    pg._set_group_desc("default_pg")
    if backend not in _BACKEND_CONFIGS:
        _BACKEND_CONFIGS[backend] = str(c10d.BackendConfig(dist.Backend(backend)))
    world.pg_map[pg] = (backend, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = _BACKEND_CONFIGS[backend]
    torch._C._distributed_c10d._register_process_group(name, pg)  # type: ignore[attr-defined]
    tag = f"ptd:{name}"
    world.tags_to_pg.setdefault("", []).append(pg)
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.pg_to_tag[pg] = tag
    world.default_pg = pg
    world.pg_group_ranks[pg] = {i: i for i in range(world_size)}


def default_group_store(store: Store) -> Store:
    """The store c10d records for a default group made by ``init_process_group(store=store)``."""
    return PrefixStore("0/", PrefixStore("default_pg", store))


def thread_groups() -> list[dist.ProcessGroup]:
    """The process groups c10d knows in the calling thread's world."""
    return list(c10d._world.pg_map)


def forget_groups() -> None:
    """Drop this rank thread's process groups from torch's registry (the world's end).

    Its c10d world goes with :func:`leave_rank_thread`, which follows.
    """
    torch._C._distributed_c10d._unregister_all_process_groups()  # type: ignore[attr-defined]


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` in this thread's registry."""
    group: dist.ProcessGroup = _resolve_process_group(cast(Any, group_name))
    return group


def as_process_group(group: Any) -> dist.ProcessGroup:
    """A ProcessGroup from what c10d and functional operators receive: a name or a ScriptObject."""
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        return resolve_group(group)
    return dist.ProcessGroup.unbox(group)
