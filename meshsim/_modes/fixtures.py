"""Per-rank values for test fixtures, usable with or without pytest.

A distributed test's fixtures (``rank``, ``distributed_mesh``, ``ledger``, ...)
are per rank, but pytest resolves fixtures once, in one thread. The plugin's
fixtures therefore return :class:`PerRank` placeholders, and each rank resolves
them through a :class:`RankFixtures` when the test body starts on it. The same
class serves ``--multigpu-static``, where the one process is the rank.

The user's own fixtures that a torchrun process would run for itself (see
:func:`recipe`) become placeholders too: each rank runs the fixture function,
once per :class:`RankFixtures`, and its teardown when the rank's scope ends.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from meshsim._record.ledger import Ledger, recording_into

__all__ = ["PerRank", "RankFixtures", "Recipe", "mesh_device", "recipe", "resolve"]


def mesh_device() -> str:
    """The device type meshes use: ``cuda`` when this rank's default group is NCCL, else ``cpu``."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return "cuda"
    return "cpu"


@dataclass
class RankFixtures:
    """Builds one rank's fixture values; meshes are cached (``cache``) by shape and names.

    ``values`` holds the user fixtures built on this rank (see :func:`recipe`), and
    ``teardowns`` their generators, oldest first.
    """

    cache: dict[tuple[tuple[int, ...], tuple[str, ...] | None], Any] = field(default_factory=dict)
    ledger: Ledger | None = None
    values: dict[object, Any] = field(default_factory=dict)
    teardowns: list[tuple[object, str, Iterator[Any]]] = field(default_factory=list)

    def rank(self) -> int:
        return dist.get_rank()

    def world_size(self) -> int:
        return dist.get_world_size()

    def make_mesh(self, shape: Sequence[int] | int, names: Sequence[str] | None = None) -> Any:
        """A DeviceMesh of ``shape`` over every rank, built once per shape and names."""
        from torch.distributed.device_mesh import init_device_mesh

        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        key = (dims, tuple(names) if names is not None else None)
        if key not in self.cache:
            if _product(dims) != dist.get_world_size():
                raise ValueError(
                    f"make_mesh({list(dims)}) needs {_product(dims)} ranks, but the world has "
                    f"{dist.get_world_size()}"
                )
            self.cache[key] = init_device_mesh(mesh_device(), dims, mesh_dim_names=key[1])
        return self.cache[key]

    def distributed_mesh(self) -> Any:
        return self.make_mesh((dist.get_world_size(),), ("domain",))

    def distributed_mesh_2d(self) -> Any:
        world = dist.get_world_size()
        if world % 2:
            raise ValueError(
                f"distributed_mesh_2d is a (2, world_size // 2) mesh and needs an even world "
                f"size, got {world}"
            )
        return self.make_mesh((2, world // 2), ("axis1", "axis2"))

    def open_ledger(self) -> Ledger:
        if self.ledger is None:
            self.ledger = Ledger()
        return self.ledger

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Fill the ``ledger`` fixture (if a test asked for it) while the body runs."""
        if self.ledger is None:
            yield
            return
        with recording_into(self.ledger):
            yield

    def finish(self, key: object = None, *, scope: str | None = None) -> None:
        """Tear down, newest first, the user fixtures built here: one (``key``), a ``scope``'s, or all.

        Raises:
            RuntimeError: a fixture's generator yielded a second time.
        """
        keep: list[tuple[object, str, Iterator[Any]]] = []
        done: list[tuple[object, str, Iterator[Any]]] = []
        for entry in self.teardowns:
            chosen = (key is None and scope is None) or entry[0] == key or entry[1] == scope
            (done if chosen else keep).append(entry)
        self.teardowns = keep
        for entry_key, _, _ in done:
            self.values.pop(entry_key, None)
        for _, _, generator in reversed(done):
            _finish_generator(generator)


def _finish_generator(generator: Iterator[Any]) -> None:
    try:
        next(generator)
    except StopIteration:
        return
    name = getattr(getattr(generator, "gi_code", None), "co_name", "a fixture")
    raise RuntimeError(f"fixture {name!r} yielded a second time; a fixture function may yield once")


@dataclass(frozen=True, eq=False)
class Recipe:
    """How a rank builds its own value of a user fixture: the function and its arguments.

    ``kwargs`` may hold :class:`PerRank` values (fixtures it depends on), resolved
    on the rank first. ``key`` tells instances apart (one per fixture and parameter).
    """

    name: str
    func: Callable[..., Any]
    kwargs: dict[str, Any]
    scope: str
    key: object

    def build(self, fixtures: RankFixtures) -> Any:
        if self.key in fixtures.values:
            return fixtures.values[self.key]
        kwargs = resolve(self.kwargs, fixtures)
        try:
            if inspect.isgeneratorfunction(self.func):
                generator = self.func(**kwargs)
                value = next(generator)
                fixtures.teardowns.append((self.key, self.scope, generator))
            else:
                value = self.func(**kwargs)
        except BaseException as error:
            _at_the_test(error)
            raise
        fixtures.values[self.key] = value
        return value


def _at_the_test(error: BaseException) -> None:
    """A fixture's ``pytest.skip`` is reported at the test's line, as pytest reports it.

    pytest's own fixture set-up marks the skip so (``Skipped._use_item_location``, a
    private attribute, the same in pytest 8.0 to 9.2): the fixture's line would not
    tell which test skipped.
    """
    outcomes = sys.modules.get("_pytest.outcomes")  # loaded if pytest is: nothing to mark otherwise
    if outcomes is not None and isinstance(error, outcomes.Skipped):
        error._use_item_location = True


def recipe(name: str, func: Callable[..., Any], kwargs: dict[str, Any], scope: str, key: object) -> PerRank:
    """A placeholder whose value each rank builds by running the fixture function itself."""
    return PerRank(name, Recipe(name, func, kwargs, scope, key).build)


def _product(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


@dataclass(frozen=True)
class PerRank:
    """A fixture value resolved on each rank when the test body starts there."""

    name: str
    build: Callable[[RankFixtures], Any]

    def __repr__(self) -> str:
        return f"<{self.name}: resolved on each rank>"


def resolve(values: dict[str, Any], fixtures: RankFixtures) -> dict[str, Any]:
    """Replace every :class:`PerRank` in ``values`` with this rank's value."""
    return {k: v.build(fixtures) if isinstance(v, PerRank) else v for k, v in values.items()}


def _mesh_builder(fixtures: RankFixtures) -> Callable[..., Any]:
    return fixtures.make_mesh


# Module-level functions only: spawned ranks receive these placeholders pickled.
PLACEHOLDERS: dict[str, PerRank] = {
    "rank": PerRank("rank", RankFixtures.rank),
    "world_size": PerRank("world_size", RankFixtures.world_size),
    "distributed_mesh": PerRank("distributed_mesh", RankFixtures.distributed_mesh),
    "distributed_mesh_2d": PerRank("distributed_mesh_2d", RankFixtures.distributed_mesh_2d),
    "make_mesh": PerRank("make_mesh", _mesh_builder),
    "ledger": PerRank("ledger", RankFixtures.open_ledger),
    "ledger_snapshot": PerRank("ledger_snapshot", RankFixtures.open_ledger),  # the same ledger
}
