"""Every private torch API meshsim depends on, and the patches built on them.

Checked against torch 2.11, 2.12, 2.13 and 2.14 source. Nothing outside this module
touches a ``torch._C`` name or a private ``torch.distributed`` attribute; when torch
moves one of these, this is the only file to change. Each process-global change
comes as a pair (install, uninstall); :mod:`meshsim._patches` applies them.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import itertools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    PrefixStore,
    Store,
    _create_work_from_future,
    _resolve_process_group,
)
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "as_process_group",
    "completed_work",
    "copy_to_all",
    "write",
    "install_default_group",
    "install_thread_worlds",
    "resolve_group",
]

ReduceOpType = Any  # torch.distributed.ReduceOp.RedOpType, untyped in the stubs


def completed_work(result: object = None) -> dist.Work:
    """A Work that is already complete, whose future holds ``result``."""
    # torch._C.Future skips torch.futures.Future's Python constructor: this runs
    # once per rank per collective.
    fut: Any = torch._C.Future([])
    fut.set_result(result)
    work: dist.Work = _create_work_from_future(fut)
    return work


_FOREACH_COPY: Callable[..., None] | None = getattr(torch, "_foreach_copy_", None)


def copy_to_all(outs: Sequence[torch.Tensor], value: torch.Tensor) -> None:
    """``out.copy_(value)`` for every tensor of ``outs``: all of ``value``'s shape, dtype and device.

    ``torch._foreach_copy_`` does it in one dispatch, about half the cost of a loop
    of ``copy_`` from four tensors up (it runs once per rank per collective). As
    :func:`write`, it leaves the outputs' version counters as they were.
    """
    outs = outs if isinstance(outs, list) else list(outs)
    versions = tuple(out._version for out in outs)
    if _FOREACH_COPY is None or len(outs) < 2:
        for out in outs:
            out.copy_(value)
    else:
        _FOREACH_COPY(outs, [value] * len(outs))
    _SET_VERSIONS(tuple(outs), versions)


def write(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out.copy_(value)``, as a process group writes it: the version counter does not move.

    gloo and NCCL write a collective's output in C++, under autograd's radar; a
    Python ``copy_`` bumps the counter, and a view of a tensor that an in-place
    collective wrote (``torch.chunk(x, n)[r]`` with ``dist.broadcast(x.detach())``)
    would then fail autograd's in-place check in its next use, where on gloo it does
    not. ``torch._C._autograd._unsafe_set_version_counter`` takes tuples in 2.11-2.15.
    """
    version = out._version
    out.copy_(value)
    _SET_VERSIONS((out,), (version,))


_SET_VERSIONS: Callable[[tuple[torch.Tensor, ...], tuple[int, ...]], None] = (
    torch._C._autograd._unsafe_set_version_counter  # type: ignore[attr-defined]
)


# -- dist.* calls as tools see them: through c10d's dispatcher ops -------------------

dispatch_modes_active: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""How many TorchDispatchModes the calling thread has entered (0: none; one C call)."""


def dispatcher_twin(rank: int, size: int, name: str, description: str) -> Any:
    """A C++ ``ProcessGroup`` whose methods reach c10d's dispatcher ops (``c10d.allreduce_``, ...).

    On gloo and NCCL, ``dist.all_reduce`` calls the C++ ``ProcessGroup.allreduce``,
    which calls the dispatcher op that dispatch modes (``CommDebugMode``) see. A
    Python process group's own methods are called directly instead. The twin takes
    the same call while modes are active, so that they see the same op; it has no
    backend: :func:`through_dispatcher` carries the op out (checked in 2.11-2.15).
    """
    twin = torch._C._distributed_c10d.ProcessGroup(  # type: ignore[attr-defined]
        torch._C._distributed_c10d.HashStore(),
        rank,
        size,  # type: ignore[attr-defined]
    )
    twin._set_group_name(cast(Any, name))  # a GroupName in the stubs, a str at run time
    twin._set_group_desc(description)
    return twin


def through_dispatcher(
    twin: Any, names: Sequence[str], args: Sequence[Any], kwargs: dict[str, Any], run: Callable[[], Any]
) -> Any:
    """Call the twin's method (the first of ``names`` it has) so the c10d op reaches the modes.

    A mode put beneath the calling thread's dispatch modes receives the op last, runs
    ``run()`` (the simulated collective, with the original arguments) and answers as
    the op's kernel would: ``(the op's first argument, Work)`` or the Work alone.
    """
    method = next((getattr(twin, name) for name in names if hasattr(twin, name)), None)
    if method is None:
        return run()
    beneath = _CarryOut(run)
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(dispatch_modes_active())]
    torch._C._push_on_torch_dispatch_stack(beneath)
    for mode in reversed(above):
        torch._C._push_on_torch_dispatch_stack(mode)
    try:
        returned = method(*args, **kwargs)
    finally:
        for _ in above:
            torch._C._pop_torch_dispatch_stack(None)
        torch._C._pop_torch_dispatch_stack(None)  # beneath
        for mode in reversed(above):
            torch._C._push_on_torch_dispatch_stack(mode)
    # The Work itself, not the twin's copy: a boxed Python Work comes back from C++
    # without its Python methods (a pending recv's cooperative wait among them).
    return beneath.work if beneath.work is not None else returned


class _CarryOut(TorchDispatchMode):  # type: ignore[misc]
    """The bottom of the mode stack during one routed call: carries out its c10d op."""

    def __init__(self, run: Callable[[], Any]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._run: Callable[[], Any] | None = run
        self.work: Any = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        run, kwargs = self._run, kwargs or {}
        if run is None or func.namespace != "c10d":
            return func(*args, **kwargs)  # anything else the modes above ran
        self._run = None
        self.work = work = run()
        boxed = work.boxed()
        return (args[0], boxed) if len(func._schema.returns) == 2 else boxed


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` in this thread's registry."""
    group: dist.ProcessGroup = _resolve_process_group(cast(Any, group_name))
    return group


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


class _ThreadWorlds(threading.local):
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


_rank = threading.local()  # .token, .gpu_paths: set while a thread is a rank
_TOKENS = itertools.count(1)


def install_thread_worlds() -> _ThreadWorlds:
    """Replace ``c10d._world`` with a per-thread view; returns it for :func:`uninstall_thread_worlds`."""
    worlds = _ThreadWorlds(c10d._world)
    c10d._world = worlds  # type: ignore[assignment]
    # Funcol and DTensor find groups by name in a C++ registry; per-thread
    # registries keep rank threads' identically named groups apart. There is no
    # public getter, so we assume it was off, as it is unless torch's own
    # threaded test harness is running.
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    return worlds


def uninstall_thread_worlds(worlds: _ThreadWorlds) -> None:
    if c10d._world is worlds:  # type: ignore[comparison-overlap]
        c10d._world = worlds._original
    torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]


def disable_autograd_threads() -> bool:
    """Run backward in the calling thread for every device; returns the previous setting.

    CUDA backward otherwise runs in autograd's device threads, which are not rank
    threads; torch's own threaded process group makes the same change.
    """
    previous = bool(torch._C._is_multithreading_enabled())
    torch._C._set_multithreading_enabled(False)
    return previous


def restore_autograd_threads(previous: bool) -> None:
    torch._C._set_multithreading_enabled(previous)


def enter_rank_thread(
    worlds: _ThreadWorlds, *, gpu_paths: bool, group_timeout: datetime.timedelta | None = None
) -> None:
    """Give the calling thread its own c10d world and mark it as a rank for the patches below.

    ``group_timeout``: the timeout of groups made without one (``new_group``, meshes).
    """
    worlds.enter()
    # DeviceMesh hashes and compares by _thread_id; a unique token per rank thread
    # keeps torch's process-wide redistribute-plan cache from handing one rank's
    # plan (which embeds its mesh coordinate) to another. Thread idents are reused
    # after a thread ends, so they are not unique enough.
    _rank.token = next(_TOKENS)
    _rank.gpu_paths = gpu_paths
    _rank.group_timeout = group_timeout


def leave_rank_thread(worlds: _ThreadWorlds) -> None:
    _rank.token = None
    _rank.gpu_paths = False
    _rank.group_timeout = None
    worlds.leave()


def patch_init_process_group(adopt: Callable[[dict[str, Any]], bool]) -> Callable[..., None]:
    """Route ``init_process_group`` calls through ``adopt``; returns the original for the unpatch.

    ``adopt`` receives the call's arguments by name (defaults filled in) and returns
    True when it took care of the call; otherwise torch's own function runs. The
    function is bound twice, as ``torch.distributed.init_process_group`` and in
    ``distributed_c10d`` (checked in 2.11-2.14); code that imported the name before
    the patch keeps torch's.
    """
    original = cast(Callable[..., None], c10d.init_process_group)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if adopt(dict(bound.arguments)):
            return None
        return original(*args, **kwargs)

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
    return original


def unpatch_init_process_group(original: Callable[..., None]) -> None:
    c10d.init_process_group = original
    dist.init_process_group = original


def init_process_group_unpatched(*args: Any, **kwargs: Any) -> None:
    """torch's own ``init_process_group``, whether or not it is patched now."""
    init = c10d.init_process_group
    getattr(init, "__wrapped__", init)(*args, **kwargs)


def is_rank_thread() -> bool:
    """Whether the calling thread is a simulated rank (between enter and leave_rank_thread)."""
    return getattr(_rank, "token", None) is not None


def patch_default_timeout() -> Callable[[Any], datetime.timedelta]:
    """Groups a rank thread makes without a timeout get its world's, not c10d's 30 minutes.

    ``new_group`` and ``init_device_mesh`` look the default up through the module
    function ``_get_default_timeout``; a gloo peer blocked on a failed rank waits that
    long, longer than a world may last.
    """
    original = cast(Callable[[Any], datetime.timedelta], c10d._get_default_timeout)

    def default_timeout(backend: Any) -> datetime.timedelta:
        override = getattr(_rank, "group_timeout", None)
        return override if override is not None else original(backend)

    c10d._get_default_timeout = default_timeout
    return original


def unpatch_default_timeout(original: Callable[[Any], datetime.timedelta]) -> None:
    c10d._get_default_timeout = original  # type: ignore[assignment]


def patch_device_mesh() -> Callable[..., None]:
    """Make meshes built in a rank thread carry that thread's token; returns the original ``__init__``."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__
    local = _rank

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        token = getattr(local, "token", None)
        if token is not None:
            self._thread_id = token
            self._hash = None

    DeviceMesh.__init__ = __init__  # type: ignore[method-assign]
    return original


def unpatch_device_mesh(original: Callable[..., None]) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    DeviceMesh.__init__ = original  # type: ignore[method-assign]


class _NotLocalTensorMode:
    """Returned to DTensor's CPU check so that it takes the all_to_all path."""


def patch_dtensor_cpu_alltoall() -> Callable[[], Any]:
    # torch/distributed/tensor/_collective_utils.py:shard_dim_alltoall falls back to
    # all_gather + chunk when `mesh.device_type == "cpu" and local_tensor_mode() is
    # None`. GPUs take one all_to_all; a simulated mesh should record what GPUs do.
    from torch.distributed.tensor import _collective_utils

    original: Callable[[], Any] = _collective_utils.local_tensor_mode  # type: ignore[attr-defined]
    marker = _NotLocalTensorMode()
    local = _rank

    def local_tensor_mode() -> Any:
        mode = original()
        if mode is None and getattr(local, "gpu_paths", False):
            return marker
        return mode

    _collective_utils.local_tensor_mode = local_tensor_mode  # type: ignore[attr-defined]
    return original


def unpatch_dtensor_cpu_alltoall(original: Callable[[], Any]) -> None:
    from torch.distributed.tensor import _collective_utils

    _collective_utils.local_tensor_mode = original  # type: ignore[attr-defined]


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


_BACKEND_TABLES = ("backend_capability", "backend_type_map", "default_device_backend_map", "_plugins")


def register_backend(name: str, creator: Callable[..., Any]) -> dict[str, Any]:
    """Register a c10d backend plugin; returns what :func:`unregister_backend` needs.

    What it saves is only what this registration changes (the entries for ``name`` and
    the device defaults it took), so that undoing it keeps what others registered
    meanwhile: a module imported inside a world may register a backend of its own
    (DTensor's first use imports torch's ``fake`` process group), and Python keeps
    the module, which will not register it again.
    """
    backend = dist.Backend
    lower, upper = name.lower(), name.upper()
    keys = {"backend_capability": lower, "backend_type_map": lower, "_plugins": upper}
    saved: dict[str, Any] = {t: (k, getattr(backend, t).get(k, _ABSENT)) for t, k in keys.items()}
    saved["devices"] = dict(backend.default_device_backend_map)
    saved["listed"] = lower in backend.backend_list
    saved["had_attr"] = hasattr(backend, upper)
    saved["name"] = name
    backend.register_backend(name, creator, extended_api=True, devices=["cpu", "cuda"])
    return saved


def unregister_backend(saved: dict[str, Any]) -> None:
    backend = dist.Backend
    lower = saved["name"].lower()
    for table in ("backend_capability", "backend_type_map", "_plugins"):
        key, previous = saved[table]
        current = getattr(backend, table)  # changed in place: other modules may hold these objects
        if previous is _ABSENT:
            current.pop(key, None)
        else:
            current[key] = previous
    devices = backend.default_device_backend_map
    for device, value in list(devices.items()):
        if value == lower:  # a default this registration took, unless someone changed it since
            if device in saved["devices"]:
                devices[device] = saved["devices"][device]
            else:
                del devices[device]
    if not saved["listed"] and lower in backend.backend_list:
        backend.backend_list.remove(lower)
    if not saved["had_attr"] and hasattr(backend, saved["name"].upper()):
        delattr(backend, saved["name"].upper())


_ABSENT = object()


_BACKEND_CONFIGS: dict[str, str] = {}


def install_default_group(pg: dist.ProcessGroup, backend: str, store: Store, world_size: int) -> None:
    """Make ``pg``, of ``world_size`` ranks, this thread's default group as ``init_process_group`` would.

    ``store`` should be what c10d keeps for a default group: the world's store
    under the prefixes ``default_pg`` and ``0/`` (see :func:`default_group_store`).

    ``init_process_group`` costs ~250 us per rank, most of it generic checks and a
    throwaway C++ ProcessGroup; a 4-rank world must set up in well under 1 ms.
    This writes the same c10d state directly (pinned by tests/meshsim/
    test_torch_private.py against the real call, so a torch change is caught).
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
    torch._C._distributed_c10d._register_process_group(name, pg)
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
    torch._C._distributed_c10d._unregister_all_process_groups()


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


@functools.cache
def reduce_op_names_by_hash() -> dict[int, str]:
    """The names of the ReduceOp kinds, keyed by ``hash(ReduceOp)``; empty if hashes do not tell them apart.

    A ReduceOp read from a collective's options is a fresh object each call, and
    comparing it (or reading ``.op``) costs 1-2 us through pybind while ``hash`` costs
    0.3 us: c10d hashes a ReduceOp as its kind's value (checked in 2.11-2.14). The
    table is built from the kinds themselves and used only while every kind, and a
    PREMUL_SUM op (not in the table: its factor must be read), hashes differently.
    """
    kinds = {name: kind for name, kind in dist.ReduceOp.RedOpType.__members__.items() if name != "PREMUL_SUM"}
    table = {hash(dist.ReduceOp(kind)): name for name, kind in kinds.items()}
    premul = hash(dist._make_nccl_premul_sum(1.0))  # type: ignore[attr-defined]
    if len(table) != len(kinds) or premul in table:
        return {}
    return table


def premul_factor(reduce_op: Any) -> float | torch.Tensor:
    """The scale factor of a PREMUL_SUM ``ReduceOp`` (``torch.distributed._make_nccl_premul_sum``)."""
    factor: float | torch.Tensor = reduce_op.factor
    return factor


def thread_fingerprint() -> tuple[Any, ...]:
    """torch's per-thread state, to tell whether a finished rank thread is as good as new.

    Grad, forward-grad and inference modes, the torch-function and dispatch mode
    stacks (``set_default_device`` and ``autocast`` live there or in the dispatch
    key sets), saved-tensor hooks and DeviceMesh's per-thread mesh stack: a rank
    thread whose fingerprint differs from the one it had when new is not reused.
    """
    C: Any = torch._C
    mesh_env = _mesh_env()
    return (
        torch.is_grad_enabled(),
        C._is_fwd_grad_enabled(),
        torch.is_inference_mode_enabled(),
        C._len_torch_function_stack(),
        C._len_torch_dispatch_stack(),
        C._dispatch_tls_local_include_set(),
        C._dispatch_tls_local_exclude_set(),
        C._autograd._saved_tensors_hooks_is_enabled(),
        C._autograd._top_saved_tensors_default_hooks(True) is None,
        len(getattr(mesh_env, "mesh_stack", ())),
    )


@functools.cache
def _mesh_env() -> Any:
    """DeviceMesh's per-thread mesh stack holder (a threading.local), None where torch has none."""
    import torch.distributed.device_mesh as device_mesh

    return getattr(device_mesh, "_mesh_resources", None)


def forward_ad_level() -> int:
    """The innermost forward-AD dual level (-1: none), which ``forward_ad`` keeps in a module global."""
    level: int = forward_ad._current_level
    return level


def exit_forward_ad_levels(down_to: int) -> None:
    """Exit the dual levels entered since the process was at level ``down_to`` (innermost first)."""
    while forward_ad._current_level > down_to:
        forward_ad.exit_dual_level()  # type: ignore[no-untyped-call]


# -- torch.testing._internal, for meshsim.testing ----------------------------------------
# meshsim.testing stands in for torch's distributed test bases; these are the pieces of
# torch's test helpers it keeps (checked against torch 2.13). They are imported on first
# use: torch.testing._internal.common_utils needs expecttest and takes ~1 s to import.


def torch_test_case() -> type[Any]:
    """torch's ``common_utils.TestCase``, the base of every torch test class."""
    from torch.testing._internal.common_utils import TestCase

    return cast(type[Any], TestCase)


def distributed_test_defaults() -> tuple[int, int, str]:
    """``(DEFAULT_WORLD_SIZE, NUM_DEVICES, DEVICE_TYPE)`` as torch's distributed bases use them."""
    from torch.testing._internal.common_distributed import DEFAULT_WORLD_SIZE
    from torch.testing._internal.distributed._tensor.common_dtensor import DEVICE_TYPE, NUM_DEVICES

    return int(DEFAULT_WORLD_SIZE), int(NUM_DEVICES), str(DEVICE_TYPE)


def test_skip_messages() -> dict[int, str]:
    """The messages of torch's skip exit codes (``TEST_SKIPS``), by exit code."""
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


def accelerator_backends() -> tuple[str, ...]:
    """Backend names that need one accelerator per rank (``ACCELERATOR_DIST_BACKENDS``)."""
    from torch.testing._internal.common_distributed import ACCELERATOR_DIST_BACKENDS

    return tuple(ACCELERATOR_DIST_BACKENDS)


def run_subtests(
    test: Any, config: dict[str, list[Any]], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> None:
    """torch's ``run_subtests``: ``fn`` once per combination of ``config``, each in ``test.subTest``."""
    from torch.testing._internal.common_distributed import run_subtests as torch_run_subtests

    torch_run_subtests(test, config, fn, *args, **kwargs)


def dtensor_converter(mesh: Any, args: Any, kwargs: Any) -> Any:
    """torch's ``DTensorConverter``: iterates over shardings of an op's tensor arguments."""
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorConverter

    return DTensorConverter(mesh, args, kwargs)
