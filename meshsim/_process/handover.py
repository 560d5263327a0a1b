"""The hand-over registry: every process-wide value that each simulated rank owns, as real ranks do.

Rank threads share one process, so a class attribute, a module global, a
singleton's attributes, torch's RNG or the default dtype are one value for every
rank. Each such value is an entry of one registry: in a serialized world (the
``sim`` backend) each rank has its own value of every entry, the scheduler swaps
them all at every hand-over (:meth:`WorldSlots.save` and :meth:`WorldSlots.load`,
once each), and the caller's values are back when the world ends.

Entries come from three places, one mechanism:

- meshsim's own accessors (:func:`declare_accessor`): torch's CPU and CUDA RNGs, the
  default dtype, ``RANK`` / ``LOCAL_RANK`` in the environment (:mod:`meshsim._process.state`);
- the state of the code ranks run (:func:`declare`): warnings, module hooks,
  torch.distributed flags, PhysicsNeMo's manager (:mod:`meshsim._process.integrations`);
- the user's declarations (:func:`per_rank`).

:func:`per_rank` is the user's way in. This serves Borg and singleton
managers (PhysicsNeMo's ``DistributedManager``, Megatron-style ``parallel_state``
module globals) and anything else a process owns once.

Declarations are process-wide and last until removed. A declaration made while a
world runs (a module imported inside a rank) joins that world at its next hand-over.

Non-goals: ranks that run at once (gloo thread ranks, ``serialize=False``) share
these values, as threads do; spawned and torchrun ranks are processes and need none
of this.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, NamedTuple

__all__ = [
    "PerRankState",
    "Slot",
    "WorldSlots",
    "add_slots",
    "declare",
    "declare_accessor",
    "declared",
    "declared_slots",
    "hold",
    "per_rank",
]

_ABSENT: Any = type("_Absent", (), {"__repr__": lambda self: "<absent>"})()

Share = Literal["empty", "unchanged"] | None  # see _Slot


class _Slot:
    """One per-rank value: ``owner.name``, or the whole ``owner.__dict__`` when ``name`` is None.

    ``fresh`` builds a rank's starting value; without it a rank starts from
    ``duplicate(caller's value)``. ``after_set`` runs when a swap changed the value
    (what else must learn of it: ``warnings`` caches decisions per filter list).
    ``share`` lets ranks share one copy of a container until one of them changes it
    (see :class:`WorldSlots`): ``"empty"`` while it is empty (hook tables),
    ``"unchanged"`` while it holds what it held when the world started (filter lists).
    """

    __slots__ = ("after_set", "duplicate", "fresh", "label", "name", "owner", "pristine", "share")

    # whether the caller's value is taken anew at each of a session's calls even when ranks
    # keep theirs (a per-rank module: what the pytest process sets between tests is its own)
    retake_caller = False

    def __init__(
        self,
        owner: Any,
        name: str | None,
        fresh: Callable[..., Any] | None,
        duplicate: Callable[[Any], Any] | None = None,
        after_set: Callable[[], None] | None = None,
        share: Share = None,
    ) -> None:
        self.owner = owner
        self.name = name
        self.fresh = fresh
        self.label = _label(owner, name)
        self.duplicate = duplicate or copy.deepcopy
        self.after_set = after_set
        self.share = share
        # What a rank starts from when the slot joins a world that is already running
        # (the caller's value is unknown then): the value at declaration, copied.
        self.pristine = None if fresh is not None else self.copy(self.get())

    def get(self) -> Any:
        if self.name is None:
            return self.owner.__dict__
        return getattr(self.owner, self.name, _ABSENT)

    def set(self, value: Any) -> None:
        if self.name is None:
            if self.owner.__dict__ is not value:
                self.owner.__dict__ = value
            return
        current = getattr(self.owner, self.name, _ABSENT)
        if current is value:
            return
        if value is _ABSENT:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, value)
        if self.after_set is not None:
            self.after_set()

    def start(self, caller: Any, rank: int = 0) -> Any:
        """A rank's starting value: ``fresh()`` (or ``fresh(rank)``), or a copy of the caller's (a fork's)."""
        if self.fresh is not None:
            return self.fresh(rank) if _takes_rank(self.fresh) else self.fresh()
        return self.copy(caller)

    def starts(self, caller: Any, world_size: int) -> list[Any]:
        """Every rank's starting value: one copy for all when they may share it, else :meth:`start` each."""
        if self.share is not None and caller is not _ABSENT and (self.share == "unchanged" or not caller):
            shared = self.copy(caller)  # the world's own: the caller's object is never handed out
            return [shared] * world_size
        if self.fresh is None and self.duplicate is copy_container and not isinstance(caller, _CONTAINERS):
            return [caller] * world_size  # what copy_container gives back as it is: no call per rank
        return [self.start(caller, rank) for rank in range(world_size)]

    def moved(self, before: Any, now: Any) -> bool:
        """Whether the caller's value changed between a session's calls (ranks then take it)."""
        return now is not before

    def joined_late(self, rank: int | None = None) -> Any:
        """The starting value of a rank (None: the caller, as rank 0) when the slot joins a running world."""
        if self.fresh is not None:
            return self.fresh(rank or 0) if _takes_rank(self.fresh) else self.fresh()
        return self.copy(self.pristine)

    def copy(self, value: Any) -> Any:
        if value is _ABSENT:
            return value
        try:
            return self.duplicate(value)
        except Exception as exc:
            raise TypeError(
                f"meshsim cannot give each rank its own copy of {self.label} ({type(value).__name__}): "
                f"copying it failed with {exc!r}. Pass fresh=... to per_rank() to build each rank's "
                "starting value instead (for a Borg's shared dict: fresh=dict)."
            ) from exc


def _label(owner: Any, name: str | None) -> str:
    if isinstance(owner, ModuleType):
        where = owner.__name__
    elif isinstance(owner, type):
        where = f"{owner.__module__}.{owner.__qualname__}"
    else:
        where = f"<{type(owner).__qualname__} object>"
    return where if name is None else f"{where}.{name}"


class _Accessor(_Slot):
    """A per-rank value that only functions reach (torch's RNG state, the default dtype, ``RANK``).

    ``get`` reads the process's current value (None: nothing to save, the rank's value
    never changes: ``RANK``); ``set`` makes a value current; ``start(caller, rank)`` is
    a rank's starting value; ``moved(before, now)`` says whether the caller's value
    changed between a session's calls.
    """

    __slots__ = ("_moved", "_start", "getter", "setter")

    def __init__(
        self,
        label: str,
        get: Callable[[], Any] | None,
        set: Callable[[Any], object],
        start: Callable[[Any, int], Any],
        moved: Callable[[Any, Any], bool],
    ) -> None:
        self.owner = self
        self.name = label
        self.label = label
        self.fresh = None
        self.duplicate = _same
        self.after_set = None
        self.share = None
        self.pristine = None
        self.getter = get
        self.setter = set
        self._start = start
        self._moved = moved

    def get(self) -> Any:
        return self.getter() if self.getter is not None else _ABSENT

    def set(self, value: Any) -> None:
        if value is not _ABSENT:
            self.setter(value)

    def start(self, caller: Any, rank: int = 0) -> Any:
        return self._start(caller, rank)

    def starts(self, caller: Any, world_size: int) -> list[Any]:
        return [self._start(caller, rank) for rank in range(world_size)]

    def moved(self, before: Any, now: Any) -> bool:
        return now is not _ABSENT and self._moved(before, now)

    def joined_late(self, rank: int | None = None) -> Any:
        return self.get()


@functools.lru_cache(maxsize=256)
def _takes_rank(fresh: Callable[..., Any]) -> bool:
    """Whether ``fresh`` takes the rank: one positional parameter without a default.

    ``dict``, ``list`` and other builtins without a signature take none.
    """
    try:
        parameters = inspect.signature(fresh).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) == 1


def _same(value: Any) -> Any:
    return value


class _Registry:
    """Every declared slot of the process, and a version that changes with it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: tuple[_Slot, ...] = ()
        self.version = 0
        self._taken: dict[tuple[int, str | None], _Slot] = {}
        # the last order and plan WorldSlots._order made, keyed by the slots it ordered
        self.plan: tuple[Any, list[int], _Plan] | None = None
        # the last slots presence() looked at, and per slot the dict and key it looks up
        self._probe: tuple[tuple[_Slot, ...], list[dict[str, Any]], list[str]] = ((), [], [])

    def presence(self, slots: list[_Slot]) -> tuple[bool, ...]:
        """Whether each slot is present now (:func:`_namespace_of`): one C pass (every world asks).

        What a slot would be looked up in is found once per list of slots: a module's or
        an object's namespace dict (taken as fixed, as the cached plans take it), or none.
        """
        probe = self._probe
        if probe[0] != tuple(slots):  # by identity: _Slot has no __eq__
            namespaces = [_namespace_of(slot) for slot in slots]
            probe = self._probe = (tuple(slots), namespaces, [slot.name or "" for slot in slots])
        return tuple(map(operator.contains, probe[1], probe[2]))

    def add(self, slots: Sequence[_Slot]) -> None:
        with self.lock:
            for slot in slots:
                if (id(slot.owner), slot.name) in self._taken or (id(slot.owner), None) in self._taken:
                    raise ValueError(f"{slot.label} is already declared per rank")
            self.slots = (*self.slots, *slots)
            self._taken.update(((id(slot.owner), slot.name), slot) for slot in slots)
            self.version += 1

    def remove(self, slots: Sequence[_Slot]) -> None:
        with self.lock:
            gone = {id(s) for s in slots}
            self.slots = tuple(s for s in self.slots if id(s) not in gone)
            for slot in slots:
                if self._taken.get((id(slot.owner), slot.name)) is slot:
                    del self._taken[(id(slot.owner), slot.name)]
            self.version += 1

    def declared(self, owner: Any, name: str | None) -> bool:
        slot = self._taken.get((id(owner), name))
        return slot is not None and slot.owner is owner


_REGISTRY = _Registry()


Slot = _Slot  # the base of registry entries declared elsewhere in _process (per-rank modules)


class PerRankState:
    """The handle :func:`per_rank` returns: ``remove()`` (or leaving a ``with`` block) undoes it."""

    def __init__(
        self, slots: tuple[_Slot, ...], on_remove: Callable[[tuple[_Slot, ...]], None] | None = None
    ) -> None:
        self._slots = slots
        self._removed = False
        self._on_remove = on_remove

    @property
    def names(self) -> tuple[str, ...]:
        """The declared values, as ``module.Class.attribute`` labels."""
        return tuple(slot.label for slot in self._slots)

    def remove(self) -> None:
        """Make the values process-wide again (worlds that run already keep swapping them)."""
        if not self._removed:
            self._removed = True
            _REGISTRY.remove(self._slots)
            if self._on_remove is not None:
                self._on_remove(self._slots)

    def __enter__(self) -> PerRankState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"<per_rank {', '.join(self.names)} ({state})>"


def per_rank(target: object, *names: str, fresh: Callable[..., Any] | None = None) -> PerRankState:
    """Declare process-wide values that each simulated rank owns, as a real rank's process would.

    In a serialized world (the ``sim`` backend, the default) each rank has its own
    value of every declared attribute, swapped in whenever the rank runs, and the
    caller's value is back when the world ends. Declare once, e.g. in a conftest::

        meshsim.per_rank(Manager, "_shared_state", fresh=dict)   # a Borg's shared dict
        meshsim.per_rank(parallel_state, "_TP_GROUP", "_DP_GROUP")  # module globals
        meshsim.per_rank(settings)                                # a singleton's attributes

    Args:
        target: a class, a module or an object.
        names: the attributes of ``target`` that are per rank. With none, the whole
            ``target.__dict__`` is (an instance: a singleton's attributes).

    Keyword args:
        fresh: builds each rank's starting value (``dict`` for a Borg's shared dict:
            every rank starts as a newly started process would); a callable that takes
            one argument is given the rank (``fresh=lambda rank: ...``), to build what a
            process of that rank computes at import (its ``LOCAL_RANK``, its device). By
            default each rank starts from a deep copy of the caller's value when the world
            starts, as a forked process would.

    Returns:
        a handle whose ``remove()`` (or the end of a ``with`` block) undoes the declaration.

    Raises:
        TypeError: a name is not a string, ``fresh`` is not callable, or ``target`` is a
            class or module without names (their ``__dict__`` cannot be swapped).
        ValueError: a name is not an identifier, or a value is already declared per rank.
    """
    if target is None:
        raise TypeError("per_rank() needs a class, module or object whose state is per rank, got None")
    if fresh is not None and not callable(fresh):
        raise TypeError(
            f"fresh must be a callable that builds a rank's starting value (given the rank if it "
            f"takes one argument), got {fresh!r}"
        )
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"per_rank() attribute names must be strings, got {name!r}")
        if not name.isidentifier():
            raise ValueError(f"per_rank() attribute names must be identifiers, got {name!r}")
    if not names:
        if isinstance(target, (type, ModuleType)) or not hasattr(target, "__dict__"):
            kind = "class" if isinstance(target, type) else type(target).__name__
            raise TypeError(
                f"per_rank({_label(target, None)}) without attribute names swaps an object's __dict__, "
                f"which a {kind} does not allow: name the attributes, e.g. "
                f"per_rank({_label(target, None).rsplit('.', 1)[-1]}, '_shared_state')"
            )
    slots = tuple(_Slot(target, name, fresh) for name in names) if names else (_Slot(target, None, fresh),)
    _REGISTRY.add(slots)
    return PerRankState(slots)


def add_slots(
    slots: tuple[_Slot, ...], *, on_remove: Callable[[tuple[_Slot, ...]], None] | None = None
) -> PerRankState:
    """Add entries made elsewhere in ``_process`` (their own kind of slot); ``on_remove`` runs on removal.

    Raises:
        ValueError: one of them is declared already.
    """
    _REGISTRY.add(slots)
    return PerRankState(slots, on_remove)


def declared_slots() -> tuple[_Slot, ...]:
    """Every entry of the registry now, in declaration order."""
    return _REGISTRY.slots


_CONTAINERS = (dict, list, set)  # what copy_container copies


def copy_container(value: Any) -> Any:
    """A shallow copy of a dict, list or set (their own ``copy``, in C); anything else as it is.

    For values that a rank changes by rebinding or by mutating a container: hook
    tables, filter lists, registries. Strings, numbers, functions and None cannot be
    changed in place, so ranks may share them.
    """
    if isinstance(value, _CONTAINERS):
        return value.copy()
    return value


def declare(
    owner: object,
    name: str,
    *,
    duplicate: Callable[[Any], Any] = copy_container,
    after_set: Callable[[], None] | None = None,
    share: Share = None,
) -> None:
    """Declare ``owner.name`` per rank for meshsim's own use (torch's and the stdlib's process state).

    As :func:`per_rank`, but each rank starts from ``duplicate(caller's value)``
    (:func:`copy_container` by default: hook tables hold functions bound to live
    objects, so a shallow copy), and nothing is declared twice. Not undone: it is
    inert outside worlds. ``share``: see :class:`_Slot`.
    """
    if share not in (None, "empty", "unchanged"):
        raise ValueError(f"share must be None, 'empty' or 'unchanged', got {share!r}")
    if not declared(owner, name):
        _REGISTRY.add((_Slot(owner, name, None, duplicate, after_set, share),))


def declare_accessor(
    label: str,
    *,
    get: Callable[[], Any] | None,
    set: Callable[[Any], object],
    start: Callable[[Any, int], Any] | None = None,
    moved: Callable[[Any, Any], bool] | None = None,
) -> None:
    """Declare a per-rank value that functions read and write, for meshsim's own use.

    ``get`` returns the process's current value, or is None for a value a rank never
    changes (it is then only loaded). ``start(caller's value, rank)`` gives each rank's
    starting value (default: the caller's, as after a fork); ``moved(before, now)``
    whether the caller changed it between a session's calls (default: ``!=``).
    Declared once, at import: it is inert outside worlds.
    """
    _REGISTRY.add((_Accessor(label, get, set, start or _callers, moved or operator.ne),))


def _callers(caller: Any, rank: int) -> Any:
    return caller


def declared(target: object, name: str | None) -> bool:
    """Whether ``target.name`` (or ``target.__dict__`` when ``name`` is None) is declared per rank."""
    return _REGISTRY.declared(target, name)


_HOLDS: dict[tuple[int, str], tuple[PerRankState | None, int]] = {}  # what hold() made per rank, holders
_HOLDS_LOCK = threading.Lock()


def hold(owner: object, name: str) -> Callable[[], None]:
    """Make ``owner.name`` per rank while held (a rank's monkeypatch); returns the release.

    Declared as :func:`declare` declares (ranks start from the caller's value,
    containers copied) by the first holder, unless it is declared already (it then
    stays as it was); removed when the last holder releases it. Releasing twice is a no-op.
    """
    key = (id(owner), name)
    with _HOLDS_LOCK:
        handle, holders = _HOLDS.get(key, (None, 0))
        if not holders and not declared(owner, name):
            slot = _Slot(owner, name, None, copy_container)
            _REGISTRY.add((slot,))
            handle = PerRankState((slot,))
        _HOLDS[key] = (handle, holders + 1)
    released = False

    def release() -> None:
        nonlocal released
        with _HOLDS_LOCK:
            if released:
                return
            released = True
            handle, holders = _HOLDS.pop(key)
            if holders > 1:
                _HOLDS[key] = (handle, holders - 1)
            elif handle is not None:
                handle.remove()

    return release


class WorldSlots:
    """The declared slots as one world sees them: the caller's values and each rank's.

    A rank's values are a plain list, in the order of :attr:`slots`; the world keeps
    one per rank, and :meth:`save` and :meth:`load` swap them at hand-overs.
    Module globals (and objects' own attributes, :func:`_namespace_of`) come first, grouped
    by module (or object), so that a hand-over saves a module's values with one
    ``itemgetter`` and loads them with one ``dict.update``:
    a Python-level loop over some twenty slots, four times per collective, cost more
    than the collective's own bookkeeping.

    A module's run of globals that every rank holds as the very same objects is
    *shared*: a hand-over loads nothing for it, and on the way out only compares it
    with its baseline (what it held when it became shared). Ranks start sharing
    what cannot change in place (flags, names, functions) and the containers
    declared to be shared (``share=``, in copies of the world's own: hook tables
    while empty, warnings filters). The first rank to change a shared run, by
    rebinding a value or by changing a container in place, keeps what it changed;
    every other rank gets copies of the baseline, and from then on each hand-over
    swaps that run. So a rank that registered a hook keeps the table its handle
    refers to, and a rank that saved the filter list to restore later (in
    ``catch_warnings``) restores an object no other rank holds.
    """

    def __init__(self) -> None:
        self.slots: list[_Slot] = list(_REGISTRY.slots)
        self.version = _REGISTRY.version
        self.caller: list[Any] = [slot.get() for slot in self.slots]
        self.ranks: list[list[Any]] = []
        self._plan = _Plan([], [], [])
        self._shared: list[_Shared | None] = []  # per run: while every rank shares it, its baseline
        # per rank, per run: its values as a tuple (to check on the way out) and by name (to load)
        self._packed: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = []
        self._swapped: list[int] = []  # the runs that are not shared
        # the shared runs' getters, namespaces and baselines, and their (namespace, name, object) held
        self._check: tuple[tuple[Any, ...], ...] = ((), (), (), ())
        self._order()

    def start(self, world_size: int) -> list[list[Any]]:
        """Every rank's starting values (kept by the world; :meth:`save` and :meth:`load` take a rank)."""
        # slot by slot, then turned into rank by rank in C
        columns = [slot.starts(value, world_size) for slot, value in zip(self.slots, self.caller)]
        self.ranks = (
            [list(values) for values in zip(*columns)] if columns else [[] for _ in range(world_size)]
        )
        self._find_shared()
        return self.ranks

    def _find_shared(self) -> None:
        """Mark the runs whose values are the very same objects in every rank, and put those in place.

        Runs in the caller's thread before ranks run (a world's or a session job's start).
        """
        self._shared = []
        ranks = self.ranks  # none: no world started yet
        if not ranks:
            self._shared = [None] * len(self._plan.runs)
            self._pack()
            return
        first = ranks[0]
        # per slot, whether every rank holds the first rank's very object: compared rank by
        # rank in C (a Python step per slot, four times per world, cost more)
        same = list(map(all, zip(*[list(map(operator.is_, first, other)) for other in ranks[1:]])))
        if not same:  # one rank
            same = [True] * len(first)
        for run in self._plan.runs:
            if not all(same[run.start : run.stop]):
                self._shared.append(None)
                continue
            values = tuple(first[run.start : run.stop])
            self._shared.append(_Shared.of(run, values))
            run.namespace.update(zip(run.names, values))  # shared runs are not loaded at hand-overs
        self._pack()

    def _pack(self) -> None:
        """Each rank's values of each swapped run in the forms a hand-over uses: a tuple and a dict.

        A shared run has none until it is unshared (:meth:`_unshare` packs it then).
        """
        runs = self._plan.runs
        shared = self._shared
        self._packed = [
            [
                _UNPACKED if known is not None else _packed(run, tuple(v[run.start : run.stop]))
                for run, known in zip(runs, shared)
            ]
            for v in self.ranks
        ]
        self._index_runs()

    def _index_runs(self) -> None:
        """What hand-overs go through: the shared runs' check, and the positions of the swapped runs."""
        runs = self._plan.runs
        shared = [(run, known) for run, known in zip(runs, self._shared) if known is not None]
        self._swapped = [i for i, known in enumerate(self._shared) if known is None]
        # a run of one global is checked as its bare value (a plain itemgetter, no wrapper)
        self._check = (
            tuple(run.get if len(run.names) > 1 else operator.itemgetter(run.names[0]) for run, _ in shared),
            tuple(run.namespace for run, _ in shared),
            tuple(known.baseline if len(run.names) > 1 else known.baseline[0] for run, known in shared),
            tuple((run.namespace, run.names[k], obj) for run, known in shared for k, obj in known.held),
        )

    def _unshare(self, i: int, keeper: int | None, got: tuple[Any, ...]) -> None:
        """Give every rank its own values of shared run ``i``: ``keeper`` keeps ``got``, others copy."""
        run = self._plan.runs[i]
        known = self._shared[i]
        assert known is not None
        slots = self.slots[run.start : run.stop]
        for rank, values in enumerate(self.ranks):
            if rank == keeper:
                mine = got
            else:
                mine = tuple(s.copy(b) if s.share is not None else b for s, b in zip(slots, known.baseline))
            values[run.start : run.stop] = mine
            self._packed[rank][i] = _packed(run, mine)
        self._shared[i] = None
        self._index_runs()

    def recapture(self) -> None:
        """Take the caller's values anew (a session's next call); ranks take those it changed.

        Between a session's calls the pytest process runs function-scoped fixtures;
        what they do to per-process state (seed the RNGs, set the default dtype,
        rebind a declared global), torchrun would have done in every process.
        """
        if self.version != _REGISTRY.version:
            self._refresh(None)
        n = len(self.ranks)
        for i, slot in enumerate(self.slots):
            now = slot.get()
            if slot.moved(self.caller[i], now):
                self.caller[i] = now
                for values, start in zip(self.ranks, slot.starts(now, n)):
                    values[i] = start
            elif slot.retake_caller:
                self.caller[i] = now
        self._find_shared()

    def save(self, rank: int) -> None:
        """Store the process's current values as ``rank``'s (runs at every hand-over)."""
        if self.version != _REGISTRY.version:
            self._refresh(rank)
        getters, namespaces, baselines, held = self._check
        if getters:
            # every shared run at once, in C: the common case is that none changed
            try:
                unchanged = tuple(map(_call, getters, namespaces)) == baselines
            except Exception:  # a rebound value that does not compare (a tensor): find it below
                unchanged = False
            if unchanged:
                for namespace, name, obj in held:
                    if namespace[name] is not obj:
                        unchanged = False
                        break
            if not unchanged:
                self._unshare_changed(rank)
        values = self.ranks[rank]
        runs = self._plan.runs
        packed = self._packed[rank]
        is_ = operator.is_
        for i in self._swapped:  # plain loops and tuple fields: this runs at every hand-over
            run = runs[i]
            got = run.get(run.namespace)
            if not all(map(is_, got, packed[i][0])):  # identity: an equal copy is another object
                packed[i] = _packed(run, got)
                values[run.start : run.stop] = got
        for index, get in self._plan.gets:
            values[index] = get()

    def _unshare_changed(self, rank: int) -> None:
        """Give up sharing each shared run that ``rank`` rebound a value of, or changed in place."""
        for i, known in enumerate(self._shared):
            if known is None:
                continue
            run = self._plan.runs[i]
            got = run.get(run.namespace)
            # equal, not only identical: what ranks share is immutable or compares by identity
            if _equal(got, known.baseline) and all(got[k] is obj for k, obj in known.held):
                continue
            self._unshare(i, rank, got)

    def load(self, rank: int) -> None:
        """Make ``rank``'s values the process's current ones (runs at every hand-over)."""
        if self.version != _REGISTRY.version:
            self._refresh(None)  # the rank that ran last finished: its values are moot
        runs = self._plan.runs
        packed = self._packed[rank]
        for i in self._swapped:  # shared runs are in place already
            run = runs[i]
            incoming, by_name = packed[i]
            namespace = run.namespace
            changed = False
            for k, name in run.watched:
                if namespace[name] is not incoming[k]:
                    changed = True
                    break
            namespace.update(by_name)
            if changed:
                for after in run.afters:
                    after()
        if self._plan.sets:
            values = self.ranks[rank]
            for index, put in self._plan.sets:
                put(values[index])

    def restore_caller(self) -> None:
        """Put the caller's values back (the world's end, or between a session's jobs)."""
        if self.version != _REGISTRY.version:
            self._refresh(None)
        for slot, value in zip(self.slots, self.caller):
            slot.set(value)

    def _refresh(self, saving_rank: int | None) -> None:
        """Take in declarations made since the world started (or removed since).

        ``saving_rank``: the rank that is running (its current values become its own);
        every other rank and the caller start a slot that joins late afresh.
        """
        for i, baseline in enumerate(self._shared):  # the runs change: every rank its own values
            if baseline is not None:
                run = self._plan.runs[i]
                self._unshare(i, saving_rank, run.get(run.namespace))
        saving = self.ranks[saving_rank] if saving_rank is not None else None
        current = list(_REGISTRY.slots)
        self.version = _REGISTRY.version
        still = {id(s) for s in current}
        for slot, value in zip(self.slots, self.caller):
            if id(slot) not in still:
                slot.set(value)  # process-wide again: the caller's value
        known = {id(s): i for i, s in enumerate(self.slots)}
        added = [s for s in current if id(s) not in known]
        kept = [known[id(s)] for s in current if id(s) in known]
        self.slots = [self.slots[i] for i in kept] + added
        self.caller = [self.caller[i] for i in kept] + [s.joined_late(None) for s in added]
        for rank, values in enumerate(self.ranks):
            fills = [s.get() if values is saving else s.joined_late(rank) for s in added]
            values[:] = [values[i] for i in kept] + fills
        self._order()
        self._shared = [None] * len(self._plan.runs)  # mid-world: every run swaps from now on
        self._pack()

    def _order(self) -> None:
        """Put module globals first, grouped by module, and plan the hand-overs' steps.

        The order and plan depend only on the registry's slots and on which module
        globals exist, so consecutive worlds share them (a world's set-up is short).
        """
        present = _REGISTRY.presence(self.slots)
        key = (tuple(self.slots), present)  # compared by identity: _Slot has no __eq__
        cached = _REGISTRY.plan
        if cached is not None and cached[0] == key:
            order, self._plan = cached[1], cached[2]
        else:
            order = sorted(range(len(self.slots)), key=lambda i: _group_key(self.slots[i], present[i]))
            self._plan = _plan([self.slots[i] for i in order], [present[i] for i in order])
            _REGISTRY.plan = (key, order, self._plan)
        self.slots = [self.slots[i] for i in order]
        self.caller = [self.caller[i] for i in order]
        for values in self.ranks:
            values[:] = [values[i] for i in order]


# operator.call (3.11+) calls each getter on its namespace from C
_call: Callable[[Callable[[Any], Any], Any], Any] = getattr(operator, "call", lambda f, x: f(x))


_UNPACKED: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})  # a shared run's place in a rank's packs


def _packed(run: _ModuleRun, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return values, dict(zip(run.names, values))


def _equal(got: tuple[Any, ...], baseline: tuple[Any, ...]) -> bool:
    """Whether a shared run's values still equal its baseline (a rebound value may not compare)."""
    try:
        return bool(got == baseline)
    except Exception:  # e.g. a tensor rebound in place of another: not the shared value
        return False


class _Shared(NamedTuple):
    """A run every rank shares: what a rank's hand-over compares it with."""

    # The values when sharing began, containers copied: a container changed in place no
    # longer equals its copy (compared against itself it always would).
    baseline: tuple[Any, ...]
    # (position, object) of the shared containers whose identity matters: a rank that
    # rebinds one to an equal copy (catch_warnings does) must keep its copy. Empty hook
    # tables are interchangeable, so not theirs.
    held: tuple[tuple[int, Any], ...]

    @classmethod
    def of(cls, run: _ModuleRun, values: tuple[Any, ...]) -> _Shared:
        if not run.copied:
            return cls(values, ())
        baseline = list(values)
        for k, slot in run.copied:
            baseline[k] = slot.copy(values[k])
        return cls(tuple(baseline), tuple((k, values[k]) for k in run.held))


def _plan(slots: list[_Slot], present: list[bool]) -> _Plan:
    """The hand-overs' plan for ``slots`` in that order: a run per module's globals, then each other slot."""
    plan = _Plan([], [], [])
    i = 0
    while i < len(slots):
        key = _group_key(slots[i], present[i])
        j = i + 1
        while key[0] == 0 and j < len(slots) and _group_key(slots[j], present[j])[:2] == key[:2]:
            j += 1
        if key[0] == 0:
            plan.runs.append(_module_run(slots[i:j], i))
        else:
            slot = slots[i]
            if isinstance(slot, _Accessor):  # its functions themselves: no wrapper at hand-overs
                if slot.getter is not None:
                    plan.gets.append((i, slot.getter))
                plan.sets.append((i, slot.setter))
            else:
                plan.gets.append((i, slot.get))
                plan.sets.append((i, slot.set))
        i = j
    return plan


_NOWHERE: dict[str, Any] = {}  # what a slot that is no namespace entry is looked up in: never present


def _namespace_of(slot: _Slot) -> dict[str, Any]:
    """The dict in which ``slot.name`` is looked up to tell whether the slot is *present*.

    Present: an entry of a namespace dict that exists now (saved and loaded with its run).
    A module global, or an object's own attribute (``DTensor._op_dispatcher._custom_op_handlers``):
    both live in a plain dict that a hand-over reads with one ``itemgetter`` and writes with
    one ``update``, and a run of them may be shared. A class's namespace is a read-only
    mappingproxy, and an attribute that a data descriptor of the class (a property, a
    ``__slots__`` member) serves is not read from the object's dict: those are single slots
    (:data:`_NOWHERE`). An object's ``__dict__`` is taken as fixed, as a module's is: the plans
    cached across worlds hold it (rebinding one is what ``per_rank(obj)`` does, and it owns
    that object).
    """
    owner, name = slot.owner, slot.name
    if name is None or isinstance(owner, type):
        return _NOWHERE
    if isinstance(owner, ModuleType):
        return vars(owner)
    namespace = getattr(owner, "__dict__", None)
    if type(namespace) is not dict or _data_descriptor(type(owner), name):
        return _NOWHERE
    return namespace


def _data_descriptor(cls: type, name: str) -> bool:
    """Whether ``cls`` (or a base) serves ``name`` through a data descriptor, ahead of an object's dict."""
    for klass in cls.__mro__:
        found = vars(klass).get(name, _ABSENT)
        if found is not _ABSENT:
            kind = type(found)
            return hasattr(kind, "__set__") or hasattr(kind, "__delete__")
    return False


def _group_key(slot: _Slot, present: bool) -> tuple[int, int, str]:
    """Namespace entries present now (0, grouped by module or object), then everything else (1)."""
    if present:
        return (0, id(slot.owner), slot.name or "")
    return (1, 0, slot.label)


class _ModuleRun(NamedTuple):
    """A module's globals, next to each other in a rank's values: saved and loaded in one C call each."""

    start: int
    stop: int
    get: Callable[[dict[str, Any]], Any]  # the values, in order, from the module's namespace
    namespace: dict[str, Any]
    names: tuple[str, ...]
    watched: tuple[tuple[int, str], ...]  # (position, name) of the slots that have an after_set
    afters: tuple[Callable[[], None], ...]  # their after_set functions, each once
    copied: tuple[tuple[int, _Slot], ...]  # (position, slot) of declared-shared values, copied in a baseline
    held: tuple[int, ...]  # positions of the containers whose identity a shared run holds (share="unchanged")


def _module_run(slots: list[_Slot], start: int) -> _ModuleRun:
    names = tuple(slot.name for slot in slots if slot.name is not None)
    get = operator.itemgetter(*names)
    watched = [(k, s) for k, s in enumerate(slots) if s.after_set is not None and s.name is not None]
    afters = tuple(dict.fromkeys(slot.after_set for _, slot in watched if slot.after_set is not None))
    return _ModuleRun(
        start,
        start + len(slots),
        get if len(names) > 1 else lambda ns: (get(ns),),
        vars(slots[0].owner),
        names,
        tuple((k, slot.name) for k, slot in watched if slot.name is not None),
        afters,
        tuple((k, slot) for k, slot in enumerate(slots) if slot.share is not None),
        tuple(k for k, slot in enumerate(slots) if slot.share == "unchanged"),
    )


class _Plan(NamedTuple):
    """How a hand-over saves and loads a rank's values: runs of module globals, then single slots."""

    runs: list[_ModuleRun]
    gets: list[tuple[int, Callable[[], Any]]]  # (position, getter) of the other slots, saved one by one
    sets: list[tuple[int, Callable[[Any], object]]]  # (position, setter), loaded one by one
