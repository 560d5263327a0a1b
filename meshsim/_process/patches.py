"""The process-global changes meshsim makes, each with its undo step, in one list.

Two groups of changes share the list: what a running world needs (installed by the
first world, removed by the last: :func:`install`), and the CUDA emulation's
(``torch.cuda``'s stand-ins, torch.Tensor's device face: :func:`install_cuda`, made by
the first user that emulates, a world or the pytest process, and undone by the last).
Each change is made by one function, which returns the step that undoes it;
:class:`_Patches` keeps those steps in one list and undoes a group's in reverse order.
Each group is reference counted, so worlds may overlap (worlds started from several
threads), and a process that never runs a world is never touched.

Private torch names patched here, checked in torch 2.11, 2.12, 2.13, 2.14 and 2.15:
``DeviceMesh._thread_id`` and ``_hash``, ``c10d._get_default_timeout``,
``torch.distributed.tensor._collective_utils.local_tensor_mode``,
``torch.distributed.tensor._redistribute``'s plan caches,
``_collective_utils.MeshTopoInfo.build_from_mesh`` and the sharding propagator's caches
(``propagate_op_sharding`` and ``torch._C._clear_DTensor_sharding_propagator_cache``, per
thread, and ``_propagate_tensor_meta_cached``), the tables of
``dist.Backend`` (``backend_capability``, ``backend_type_map``,
``default_device_backend_map``, ``_plugins``, ``backend_list``) and
``torch._C._set_multithreading_enabled``, ``distributed_c10d._new_process_group_helper``;
called: ``torch._C._ensureCUDADeviceGuardSet``.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import sys
import threading
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshsim._base.context import current
from meshsim._base.errors import WorldAborted
from meshsim._process import cuda as _cuda
from meshsim._process import integrations as _integrations
from meshsim._process import rng as _rng
from meshsim._process import thread_worlds as _thread_worlds

__all__ = [
    "enter_rank_thread",
    "init_process_group_unpatched",
    "install",
    "install_cuda",
    "leave_rank_thread",
    "take_swallowed_interrupts",
    "uninstall",
    "uninstall_cuda",
]

Undo = Callable[[], None]


_WORLDS, _CUDA = "worlds", "cuda"  # the groups of changes


class _Patches:
    """The undo steps of the changes made for the running worlds and the CUDA emulation, in the order made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = {_WORLDS: 0, _CUDA: 0}
        self._undo: list[tuple[str, Undo]] = []  # (group, step)
        self.worlds: _thread_worlds.ThreadWorlds | None = None
        self.cuda: _cuda.Spec | None = None  # the first user's emulation: its storage is everyone's

    def acquire(self, backend_name: str, creator: Callable[..., Any]) -> None:
        with self._lock:
            self._users[_WORLDS] += 1
            if self._users[_WORLDS] == 1:
                self._install(backend_name, creator)

    def release(self) -> None:
        with self._lock:
            self._users[_WORLDS] -= 1
            if self._users[_WORLDS] == 0:
                self._uninstall(_WORLDS)
                self.worlds = None

    def acquire_cuda(self, spec: _cuda.Spec) -> None:
        with self._lock:
            if self._users[_CUDA]:
                assert self.cuda is not None
                if self.cuda.storage != spec.storage:
                    raise ValueError(
                        f"CUDA is emulated with storage on {self.cuda.text} already; a world cannot "
                        f"emulate it on {spec.text} at the same time"
                    )
            else:
                try:
                    self._undo.extend((_CUDA, step) for step in _cuda.changes(spec))
                except BaseException:
                    self._uninstall(_CUDA)
                    raise
                self.cuda = spec
            self._users[_CUDA] += 1
            _cuda.IN_USE.add(spec)

    def release_cuda(self, spec: _cuda.Spec) -> None:
        with self._lock:
            _cuda.IN_USE.remove(spec)
            self._users[_CUDA] -= 1
            if self._users[_CUDA] == 0:
                self._uninstall(_CUDA)
                self.cuda = None

    def _install(self, backend_name: str, creator: Callable[..., Any]) -> None:
        def add(step: Undo) -> None:
            self._undo.append((_WORLDS, step))

        try:
            add(_clear_dtensor_caches)  # undone last: plans that hold ended worlds' meshes
            _fake_cuda_guard_in_main_thread()
            self.worlds, undo_worlds = _thread_worlds.install()
            add(undo_worlds)
            add(_backward_in_calling_thread())
            add(_meshes_per_rank_thread())
            add(_group_timeout_per_world())
            add(_adopting_init_process_group())
            add(_dtensor_gpu_paths())
            add(_registered_backend(backend_name, creator))
            add(_subgroups_served_by(backend_name))
            add(_rng.install())
            add(_integrations.install())
            add(_unraisable_hook_installed())
        except BaseException:
            self._uninstall(_WORLDS)
            self.worlds = None
            raise

    def _uninstall(self, group: str) -> None:
        """Undo ``group``'s changes, the last made first; the other group's stay."""
        undo = self._undo
        for i in range(len(undo) - 1, -1, -1):
            if undo[i][0] == group:
                _, step = undo.pop(i)
                step()


_PATCHES = _Patches()


# -- the changes -------------------------------------------------------------------------


def _clear_dtensor_caches() -> None:
    """Forget the process-wide caches that hold meshes of ended worlds.

    A mesh holds its process groups (``DeviceMesh._pg_registry``), and a gloo group's
    worker threads and sockets live as long as the group object: a cache entry that
    keeps an ended world's mesh keeps them too (six threads a 2-rank world; thousands
    over a gloo test session). Cleared: DTensor's redistribute plans, its cost model's
    mesh topology (``MeshTopoInfo.build_from_mesh``, filled by every op whose sharding
    strategy is chosen by cost), the sharding propagator's caches (the per-thread one
    of the calling thread only: see :func:`_clear_thread_caches`), and shardtensor's
    operator plans, whose specs hold meshes.
    """
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    if redistribute is not None:
        _cache_clear(getattr(redistribute, "_gen_transform_infos", None))
        planners = getattr(redistribute, "_planner_cache", None)
        if isinstance(planners, dict):
            # A planner refers to itself (its cost_function closure): dropped, it would
            # keep its mesh until a collection. Nothing else uses one once its world ended.
            for planner in list(planners.values()):
                vars(planner).clear()
        clear_planner = getattr(redistribute, "clear_redistribute_planner_cache", None)
        if clear_planner is not None:
            clear_planner()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    if collective_utils is not None:
        topology = getattr(collective_utils, "MeshTopoInfo", None)
        _cache_clear(getattr(topology, "build_from_mesh", None))
    propagator = _sharding_propagator()
    if propagator is not None:
        _cache_clear(getattr(propagator, "_propagate_tensor_meta_cached", None))
    _clear_thread_caches()
    plans = sys.modules.get("shardtensor._dispatch")
    clear_plans = getattr(plans, "plan_cache_clear", None)
    if clear_plans is not None:
        clear_plans()


def _clear_thread_caches() -> None:
    """Forget the calling thread's own caches that hold meshes (DTensor's sharding propagation).

    ``ShardingPropagator.propagate_op_sharding`` and the C++ dispatch fast path each
    keep one unbounded cache per thread, keyed by op schemas that hold meshes; rank
    threads are kept for later worlds, so each clears its own as its rank ends.
    """
    propagator = _sharding_propagator()
    if propagator is not None:
        _cache_clear(getattr(propagator, "propagate_op_sharding", None))
        _clear_fast_path_cache()


# torch 2.11-2.15; it answers for the calling thread
_clear_fast_path_cache: Callable[[], None] = getattr(
    torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None
)


def _sharding_propagator() -> Any:
    """DTensor's sharding propagator, or None where DTensor is not loaded."""
    api = sys.modules.get("torch.distributed.tensor._api")
    dispatcher = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    return getattr(dispatcher, "sharding_propagator", None)


def _cache_clear(cached: Any) -> None:
    clear = getattr(cached, "cache_clear", None)
    if clear is not None:
        clear()


def _fake_cuda_guard_in_main_thread() -> None:
    """Register FakeTensorMode's no-op CUDA device guard here, from the main thread.

    Without a usable GPU, entering FakeTensorMode (as DTensor's sharding propagation
    does for every new layout) first calls ``ensureCUDADeviceGuardSet``, which
    replaces a CUDA guard that sees no device by a no-op one, process-wide. torch
    2.11 keeps that no-op guard in a ``thread_local`` of the first thread to call:
    when that thread exits (a failed world's rank threads end, idle ones are
    reaped), the registry points at freed memory and the next FakeTensorMode entry,
    in any thread, segfaults. Called first by the main thread, which lives as long
    as the process, the guard never dangles. torch 2.13, 2.14 and 2.15 keep the
    guard in a static (checked in their ``libc10``), where this early call changes
    nothing torch would not. It leaves a guard that sees a GPU alone, and there is
    nothing to undo: torch never removes the guard it registers.
    """
    if threading.current_thread() is threading.main_thread():
        torch._C._ensureCUDADeviceGuardSet()


def _backward_in_calling_thread() -> Undo:
    """Run backward in the calling thread for every device.

    CUDA backward otherwise runs in autograd's device threads, which are not rank
    threads; torch's own threaded process group makes the same change.
    """
    previous = bool(torch._C._is_multithreading_enabled())
    torch._C._set_multithreading_enabled(False)
    return functools.partial(torch._C._set_multithreading_enabled, previous)


_WRAPPERS: dict[Callable[[Any], Any], tuple[Any, Any]] = {}  # per maker: (original, its wrapper)


def _wrapper(make: Callable[[Any], Any], original: Any) -> Any:
    """``make(original)``, made once per original: every world's start installs the same wrapper.

    The wrappers below read the rank context when called, so one serves every world.
    """
    made = _WRAPPERS.get(make)
    if made is None or made[0] is not original:
        made = _WRAPPERS[make] = (original, make(original))
    return made[1]


def _meshes_per_rank_thread() -> Undo:
    """Make meshes built in a rank thread carry that thread's identity (see ``mesh_token``)."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    DeviceMesh.__init__ = _wrapper(_mesh_init, original)  # type: ignore[method-assign]

    def undo() -> None:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]

    return undo


def _mesh_init(original: Callable[..., None]) -> Callable[..., None]:
    here = current()

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        token = here.mesh_token
        if token is not None:
            self._thread_id = token
            self._hash = None

    return __init__


def _group_timeout_per_world() -> Undo:
    """Groups a rank thread makes without a timeout get its world's, not c10d's 30 minutes.

    ``new_group`` and ``init_device_mesh`` look the default up through the module
    function ``_get_default_timeout``; a gloo peer blocked on a failed rank waits that
    long, longer than a world may last.
    """
    original = cast(Callable[[Any], datetime.timedelta], c10d._get_default_timeout)
    c10d._get_default_timeout = _wrapper(_default_timeout, original)

    def undo() -> None:
        c10d._get_default_timeout = original  # type: ignore[assignment]

    return undo


def _default_timeout(original: Callable[[Any], datetime.timedelta]) -> Callable[[Any], datetime.timedelta]:
    here = current()

    def default_timeout(backend: Any) -> datetime.timedelta:
        override = here.group_timeout
        return override if override is not None else original(backend)

    return default_timeout


def _adopting_init_process_group() -> Undo:
    """Route ``init_process_group`` through :func:`_adopt`; torch's runs when it declines.

    The function is bound twice, as ``torch.distributed.init_process_group`` and in
    ``distributed_c10d``; code that imported the name before the patch keeps torch's.
    """
    original = cast(Callable[..., None], c10d.init_process_group)
    c10d.init_process_group = dist.init_process_group = _wrapper(_adopting, original)

    def undo() -> None:
        c10d.init_process_group = original
        dist.init_process_group = original

    return undo


def _adopting(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        bound = _signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        if _adopt(dict(bound.arguments)):
            return None
        return original(*args, **kwargs)

    return init_process_group


@functools.lru_cache(maxsize=4)
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)  # looked up on the first call, not at every world's start


def init_process_group_unpatched(*args: Any, **kwargs: Any) -> None:
    """torch's own ``init_process_group``, whether or not it is patched now."""
    init = c10d.init_process_group
    getattr(init, "__wrapped__", init)(*args, **kwargs)


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
    here = current()
    context = here.seat if here.c10d is not None else None
    if context is None:
        return False
    _check_nccl(arguments.get("backend"), context.rank)
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


def _check_nccl(backend: Any, rank: int, call: str = "init_process_group") -> None:
    """NCCL needs CUDA: without a GPU or the emulation, fail as a CPU-only process would, and say why."""
    if backend is None or "nccl" not in str(backend).lower() or torch.cuda.is_available():
        return
    raise RuntimeError(
        f"{call}(backend={backend!r}) in rank {rank}: NCCL needs CUDA, and this process has "
        "no GPU (torch.cuda.is_available() is False), so a real process would fail here too. To run code "
        "written for GPUs on simulated ranks, emulate CUDA on the CPU: pytest --mesh-cuda=cpu, "
        "meshsim run --cuda cpu, meshsim.run(..., cuda='cpu') or MESHSIM_CUDA=cpu."
    )


class _NotLocalTensorMode:
    """Returned to DTensor's CPU check so that it takes the all_to_all path."""


def _subgroups_served_by(backend_name: str) -> Undo:
    """Groups a rank of a simulated world makes for another backend are served by meshsim's.

    ``new_group(ranks, backend="gloo")`` (or ``"nccl"``, ``"cpu:gloo,cuda:nccl"``;
    ``new_subgroups`` and ``DeviceMesh``'s ``backend_override`` come the same way) would
    build a real ``ProcessGroupGloo`` whose rendezvous cannot finish while ranks run one at
    a time: it would wait out its timeout. In a world whose default group is meshsim's,
    the group is meshsim's too, recorded in the ledger as every other, and
    ``dist.get_backend(group)`` answers the name the program asked for. NCCL without CUDA
    (real or emulated) fails as in a real process. gloo thread ranks, whose default group
    is gloo, keep torch's groups.

    All of them are made by ``distributed_c10d._new_process_group_helper`` (private; its
    ``backend`` and ``backend_options`` parameters and its ``(group, store)`` result are
    the same in torch 2.11-2.15).
    """
    original = c10d._new_process_group_helper
    signature = inspect.signature(original)

    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        asked = bound.arguments.get("backend")
        world = c10d._world
        default = world.pg_map.get(world.default_pg) if world.default_pg is not None else None
        here = current()
        if asked is None or default is None or default[0] != backend_name or here.seat is None:
            return original(*args, **kwargs)
        name = str(dist.Backend(str(asked)))
        if name == backend_name:
            return original(*args, **kwargs)
        _check_nccl(name, here.seat.rank, "new_group")
        bound.arguments["backend"] = backend_name
        bound.arguments["backend_options"] = None  # gloo's and NCCL's options mean nothing to meshsim's
        pg, store = original(*bound.args, **bound.kwargs)
        world.pg_map[pg] = (name, store)
        return pg, store

    c10d._new_process_group_helper = helper

    def undo() -> None:
        c10d._new_process_group_helper = original

    return undo


def _dtensor_gpu_paths() -> Undo:
    """DTensor's shard-to-shard redistribution on a CPU mesh takes the GPU path where the world asks.

    ``torch.distributed.tensor._collective_utils.shard_dim_alltoall`` falls back to
    all_gather + chunk when ``mesh.device_type == "cpu" and local_tensor_mode() is
    None``. GPUs take one all_to_all; a simulated mesh should record what GPUs do.
    """
    from torch.distributed.tensor import _collective_utils

    original: Callable[[], Any] = _collective_utils.local_tensor_mode  # type: ignore[attr-defined]
    _collective_utils.local_tensor_mode = _wrapper(_local_tensor_mode, original)  # type: ignore[attr-defined]

    def undo() -> None:
        _collective_utils.local_tensor_mode = original  # type: ignore[attr-defined]

    return undo


def _local_tensor_mode(original: Callable[[], Any]) -> Callable[[], Any]:
    marker = _NotLocalTensorMode()
    here = current()

    def local_tensor_mode() -> Any:
        mode = original()
        if mode is None and here.gpu_paths:
            return marker
        return mode

    return local_tensor_mode


_ABSENT = object()


def _registered_backend(name: str, creator: Callable[..., Any]) -> Undo:
    """Register a c10d backend plugin for the CPU and CUDA devices.

    The undo step puts back only what this registration changed (the entries for
    ``name`` and the device defaults it took), and keeps what others registered
    meanwhile: a module imported inside a world may register a backend of its own
    (DTensor's first use imports torch's ``fake`` process group), and Python keeps
    the module, which will not register it again.
    """
    backend = dist.Backend
    lower, upper = name.lower(), name.upper()
    keys = {"backend_capability": lower, "backend_type_map": lower, "_plugins": upper}
    saved = {table: (key, getattr(backend, table).get(key, _ABSENT)) for table, key in keys.items()}
    devices_before = dict(backend.default_device_backend_map)
    listed = lower in backend.backend_list
    had_attr = hasattr(backend, upper)
    backend.register_backend(name, creator, extended_api=True, devices=["cpu", "cuda"])

    def undo() -> None:
        for table, (key, previous) in saved.items():
            current = getattr(backend, table)  # changed in place: other modules may hold these objects
            if previous is _ABSENT:
                current.pop(key, None)
            else:
                current[key] = previous
        devices = backend.default_device_backend_map
        for device, value in list(devices.items()):
            if value == lower:  # a default this registration took, unless someone changed it since
                if device in devices_before:
                    devices[device] = devices_before[device]
                else:
                    del devices[device]
        if not listed and lower in backend.backend_list:
            backend.backend_list.remove(lower)
        if not had_attr and hasattr(backend, upper):
            delattr(backend, upper)

    return undo


# Threads in which an interrupt (WorldAborted, raised asynchronously to stop a rank)
# landed where Python swallows exceptions: a __del__, a weakref or gc callback.
_SWALLOWED: set[int] = set()
_SWALLOWED_LOCK = threading.Lock()


def _unraisable_hook_installed() -> Undo:
    """Note and hide a swallowed interrupt (the world interrupts that rank again); pass on the rest."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, WorldAborted) or unraisable.exc_type is WorldAborted:
            with _SWALLOWED_LOCK:
                _SWALLOWED.add(threading.get_ident())
            return
        previous(unraisable)

    sys.unraisablehook = hook

    def undo() -> None:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous

    return undo


def take_swallowed_interrupts() -> set[int]:
    """Idents of the threads whose interrupt was swallowed since the last call."""
    with _SWALLOWED_LOCK:
        taken = set(_SWALLOWED)
        _SWALLOWED.clear()
    return taken


# -- what worlds and rank threads call -----------------------------------------------------


def install(backend_name: str, creator: Callable[..., Any]) -> None:
    """Install what a world needs, with its c10d backend, until the matching :func:`uninstall`.

    Every world passes the same ``backend_name`` and ``creator``: the creator finds
    its world through the calling rank thread.
    """
    _PATCHES.acquire(backend_name, creator)


def uninstall() -> None:
    """Undo one :func:`install`; the last one out removes every change."""
    _PATCHES.release()


def install_cuda(spec: _cuda.Spec) -> None:
    """Make the CUDA emulation's process-wide changes (the first user) until the last :func:`uninstall_cuda`.

    Users: a world that emulates, the pytest process under ``--mesh-cuda``, a child
    process. Each thread that emulates then enters its own spec
    (:func:`meshsim._process.cuda.enter_rank`).

    Raises:
        ValueError: another user emulates with storage elsewhere (``cpu`` and ``cuda:N`` at once).
    """
    _PATCHES.acquire_cuda(spec)


def uninstall_cuda(spec: _cuda.Spec) -> None:
    """Undo the :func:`install_cuda` of ``spec``; the last one out puts torch back as it was."""
    _PATCHES.release_cuda(spec)


def enter_rank_thread(
    *,
    gpu_paths: bool,
    group_timeout: datetime.timedelta | None = None,
    cuda: _cuda.Spec | None = None,
    cuda_asked: _cuda.Spec | None = None,
) -> None:
    """Make the calling thread a rank: its own c10d world, RNGs and mesh identity (its rank context).

    ``group_timeout``: the timeout of the groups the rank makes without one. ``cuda``: the
    world's CUDA emulation, sized for it (installed by :func:`install_cuda`), and
    ``cuda_asked`` as it was asked for, which worlds the rank starts inherit. Undone by
    :func:`leave_rank_thread` in the same thread, which leaves the world view this
    thread entered (a later world may have installed another). Plain functions, not a
    context manager: every rank of every world runs them, in a world's set-up time.

    Must run between :func:`install` and :func:`uninstall`.
    """
    worlds = _PATCHES.worlds
    if worlds is None:
        raise RuntimeError("meshsim internal error: enter_rank_thread() outside a world")
    _thread_worlds.enter_rank_thread(worlds, gpu_paths=gpu_paths, group_timeout=group_timeout)
    _rng.enter_rank()
    if cuda is not None:
        _cuda.enter_rank(cuda, cuda_asked)


def leave_rank_thread() -> None:
    """Undo :func:`enter_rank_thread` in the calling thread."""
    _clear_thread_caches()  # the thread may serve a later world: its caches hold this one's meshes
    if current().cuda is not None:  # the world emulates (a rank thread enters nothing else)
        _cuda.leave_rank()
    _rng.leave_rank()
    _thread_worlds.leave_rank_thread()
