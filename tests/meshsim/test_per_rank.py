"""meshsim.per_rank: class attributes, module globals and singletons that each rank owns."""

from __future__ import annotations

import os
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

import meshsim


class Borg:
    """A Borg singleton as distributed managers write them: one class-level dict for every instance."""

    _shared_state: ClassVar[dict[str, Any]] = {}

    def __init__(self) -> None:
        self.__dict__ = self._shared_state

    @classmethod
    def initialize(cls) -> None:
        manager = cls()
        manager.rank = dist.get_rank()
        manager.groups = {}


@pytest.fixture
def borg() -> Iterator[type[Borg]]:
    Borg._shared_state = {}
    with meshsim.per_rank(Borg, "_shared_state", fresh=dict):
        yield Borg
    Borg._shared_state = {}


def test_a_borg_answers_per_rank_and_the_caller_keeps_its_own(borg: type[Borg]) -> None:
    borg._shared_state["owner"] = "caller"

    def body() -> tuple[int, bool, dict[str, Any]]:
        fresh = "owner" not in borg._shared_state
        borg.initialize()
        borg().groups[dist.get_rank()] = "mine"
        dist.barrier()  # every rank has written before anyone reads
        return borg().rank, fresh, dict(borg().groups)

    results = meshsim.run(body, 4)
    assert results == [(r, True, {r: "mine"}) for r in range(4)]
    assert borg._shared_state == {"owner": "caller"}


def test_reassigning_the_attribute_stays_per_rank(borg: type[Borg]) -> None:
    def body() -> int:
        borg.initialize()
        dist.barrier()
        if dist.get_rank() == 1:
            borg._shared_state = {"rank": -1}  # a cleanup() that starts over
        dist.barrier()
        return int(borg().rank)

    assert meshsim.run(body, 3) == [0, -1, 2]
    assert borg._shared_state == {}


def test_module_globals_start_from_a_copy_of_the_callers(tmp_path: Path) -> None:
    state = types.ModuleType("parallel_state")
    state.GROUP = None
    state.SIZES = [1]

    def body() -> tuple[Any, list[int]]:
        started = (state.GROUP, list(state.SIZES))
        state.GROUP = dist.get_rank()
        state.SIZES.append(dist.get_rank())
        dist.barrier()
        return started, [state.GROUP, *state.SIZES]

    with meshsim.per_rank(state, "GROUP", "SIZES") as handle:
        assert handle.names == ("parallel_state.GROUP", "parallel_state.SIZES")
        results = meshsim.run(body, 3)
    assert results == [((None, [1]), [r, 1, r]) for r in range(3)]
    assert (state.GROUP, state.SIZES) == (None, [1])


def test_a_value_every_rank_shares_at_first_is_still_per_rank_when_one_rebinds_it_late() -> None:
    # ranks start from the caller's very objects (an int, a name), and nothing is swapped
    # while none rebinds them; a rebinding after several hand-overs is still one rank's own
    state = types.ModuleType("flags")
    state.LEVEL, state.NAME = 0, "caller"

    def body() -> list[tuple[int, str]]:
        seen = []
        for step in range(4):
            if step == 2 and dist.get_rank() == 1:
                state.LEVEL = 11
            if step == 3 and dist.get_rank() == 2:
                state.NAME = "two"
            dist.barrier()
            seen.append((state.LEVEL, state.NAME))
        return seen

    with meshsim.per_rank(state, "LEVEL", "NAME"):
        results = meshsim.run(body, 3)
    assert results == [
        [(0, "caller")] * 4,
        [(0, "caller"), (0, "caller"), (11, "caller"), (11, "caller")],
        [(0, "caller")] * 3 + [(0, "two")],
    ]
    assert (state.LEVEL, state.NAME) == (0, "caller")


def test_a_shared_value_rebound_to_one_that_does_not_compare_is_still_per_rank() -> None:
    # a tensor shared by every rank (fresh returns the same one), rebound by one rank to
    # another: the two do not compare to a bool, and the rebinding is still that rank's
    state = types.ModuleType("weights")
    shared = torch.zeros(3)
    state.W = shared

    def body() -> list[float]:
        if dist.get_rank() == 1:
            state.W = torch.ones(3)
        dist.barrier()
        return state.W.tolist()

    with meshsim.per_rank(state, "W", fresh=lambda: shared):
        results = meshsim.run(body, 3)
    assert results == [[0.0] * 3, [1.0] * 3, [0.0] * 3]
    assert state.W is shared


def test_a_singletons_attributes_are_per_rank() -> None:
    class Settings:
        def __init__(self) -> None:
            self.device = "cpu"

    settings = Settings()

    def body() -> str:
        settings.device = f"cuda:{dist.get_rank()}"
        dist.barrier()
        return settings.device

    with meshsim.per_rank(settings):
        assert meshsim.run(body, 2) == ["cuda:0", "cuda:1"]
    assert settings.device == "cpu"


class _Dispatcher:
    """An object whose table lives in its own dict, beside one a property serves."""

    def __init__(self) -> None:
        self.table: dict[str, int] = {"start": 0}
        self._limit = 1

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit = value


@pytest.mark.parametrize("name", ["table", "limit"])
def test_an_objects_attribute_is_per_rank(name: str) -> None:
    dispatcher = _Dispatcher()
    before = getattr(dispatcher, name)

    def body() -> object:
        rank = dist.get_rank()
        if name == "table":
            dispatcher.table[f"rank {rank}"] = rank  # in place, in the copy ranks share at first
        else:
            dispatcher.limit = rank + 10
        dist.barrier()
        return getattr(dispatcher, name)

    with meshsim.per_rank(dispatcher, name):
        got = meshsim.run(body, 2)
    if name == "table":
        assert got == [{"start": 0, "rank 0": 0}, {"start": 0, "rank 1": 1}]
    else:
        assert got == [10, 11]
    assert getattr(dispatcher, name) == before


def test_without_a_declaration_the_value_is_shared() -> None:
    state = types.ModuleType("shared")
    state.VALUE = None

    def body() -> int:
        state.VALUE = dist.get_rank()
        dist.barrier()
        return int(state.VALUE)

    assert meshsim.run(body, 3) == [2, 2, 2]  # the last writer's, as threads share it


def test_a_declaration_made_inside_a_rank_joins_at_the_next_hand_over() -> None:
    state = types.ModuleType("late")
    state.VALUE = "pristine"
    handles: list[meshsim._process.handover.PerRankState] = []

    def body() -> tuple[str, str]:
        if dist.get_rank() == 0:
            handles.append(meshsim.per_rank(state, "VALUE"))
        seen = state.VALUE
        state.VALUE = f"rank {dist.get_rank()}"
        dist.barrier()
        return seen, state.VALUE

    try:
        results = meshsim.run(body, 3)
    finally:
        for handle in handles:
            handle.remove()
    assert results == [("pristine", "rank 0"), ("pristine", "rank 1"), ("pristine", "rank 2")]
    assert state.VALUE == "pristine"


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((None,), {}, TypeError, "needs a class, module or object"),
        ((Borg, 3), {}, TypeError, "names must be strings, got 3"),
        ((Borg, "not a name"), {}, ValueError, "must be identifiers, got 'not a name'"),
        ((Borg,), {}, TypeError, r"name the attributes, e\.g\. per_rank\(Borg, '_shared_state'\)"),
        ((types,), {}, TypeError, "name the attributes"),
        ((Borg, "_shared_state"), {"fresh": 1}, TypeError, "fresh must be a callable"),
    ],
    ids=["none", "name-not-str", "not-identifier", "class-whole", "module-whole", "fresh-not-callable"],
)
def test_bad_declarations_are_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        meshsim.per_rank(*args, **kwargs)


def test_declaring_twice_is_refused(borg: type[Borg]) -> None:
    with pytest.raises(ValueError, match=r"Borg\._shared_state is already declared per rank"):
        meshsim.per_rank(Borg, "_shared_state")


def test_values_that_cannot_be_copied_need_fresh() -> None:
    import threading

    state = types.ModuleType("locked")
    state.LOCK = threading.Lock()
    with pytest.raises(TypeError, match=r"locked\.LOCK .*Pass fresh=\.\.\."):
        meshsim.per_rank(state, "LOCK")


# -- init_process_group inside a rank ------------------------------------------------


def _torchrun_style_init() -> tuple[int, int, str]:
    dist.init_process_group(
        "gloo" if not torch.cuda.is_available() else "nccl",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()), os.environ["MASTER_ADDR"]


def test_init_process_group_in_a_rank_adopts_its_group() -> None:
    before = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    assert meshsim.run(_torchrun_style_init, 3) == [(r, 3, "127.0.0.1") for r in range(3)]
    assert {k: os.environ.get(k) for k in before} == before


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_a_destroyed_default_group_is_made_again(backend: str) -> None:
    def body() -> float:
        dist.destroy_process_group()
        assert not dist.is_initialized()
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    assert meshsim.run(body, 2, backend=backend) == [2.0, 2.0]


def test_init_process_group_with_another_rank_is_refused() -> None:
    def body() -> None:
        dist.init_process_group("gloo", rank=0, world_size=2)

    with pytest.raises(meshsim.RankError, match=r"init_process_group\(rank=0\) inside rank 1 of a 2-rank"):
        meshsim.run(body, 2)


# -- PhysicsNeMo's DistributedManager ------------------------------------------------

# Shaped like physicsnemo.distributed.manager (2.2): a Borg whose initialize() reads
# torchrun's variables and calls init_process_group. Written for these tests.
_MANAGER = """
import os
import torch
import torch.distributed as dist


class DistributedManager:
    _shared_state = {}

    def __new__(cls):
        obj = super().__new__(cls)
        obj.__dict__ = cls._shared_state
        obj.__dict__.setdefault("_rank", 0)
        obj.__dict__.setdefault("_world_size", 1)
        obj.__dict__.setdefault("_is_initialized", False)
        return obj

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size

    @classmethod
    def is_initialized(cls):
        return cls._shared_state.get("_is_initialized", False)

    @staticmethod
    def initialize():
        if DistributedManager.is_initialized():
            return
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
        DistributedManager._shared_state["_is_initialized"] = True
        manager = DistributedManager()
        manager._rank, manager._world_size = rank, size
        manager._device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=size, device_id=manager._device)

    @staticmethod
    def cleanup():
        if DistributedManager._shared_state.get("_is_initialized"):
            dist.destroy_process_group()
        DistributedManager._shared_state = {}
"""


@pytest.fixture
def fake_physicsnemo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    package = tmp_path / "physicsnemo" / "distributed"
    package.mkdir(parents=True)
    (tmp_path / "physicsnemo" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from physicsnemo.distributed.manager import DistributedManager\n")
    (package / "manager.py").write_text(textwrap.dedent(_MANAGER))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [n for n in sys.modules if n == "physicsnemo" or n.startswith("physicsnemo.")]:
        del sys.modules[name]


def _physicsnemo_body() -> tuple[int, int]:
    from physicsnemo.distributed import DistributedManager

    DistributedManager.initialize()
    manager = DistributedManager()
    dist.barrier()
    result = (manager.rank, manager.world_size)
    DistributedManager.cleanup()
    return result


def test_physicsnemo_manager_imported_inside_a_rank_is_per_rank(fake_physicsnemo: None) -> None:
    assert meshsim.run(_physicsnemo_body, 4) == [(r, 4) for r in range(4)]
    manager = sys.modules["physicsnemo.distributed.manager"].DistributedManager
    assert manager._shared_state == {}


def test_physicsnemo_manager_imported_before_the_world_is_per_rank(fake_physicsnemo: None) -> None:
    from physicsnemo.distributed import DistributedManager  # type: ignore[import-not-found]

    DistributedManager._shared_state["caller"] = True
    assert meshsim.run(_physicsnemo_body, 2) == [(0, 2), (1, 2)]
    assert DistributedManager._shared_state == {"caller": True}


def test_fresh_is_given_the_rank_when_it_takes_one() -> None:
    """What a process of each rank computes at import (its LOCAL_RANK, its device), built per rank."""

    class Helper:
        rank = 0  # computed once, when the pytest process imported it

    def body() -> tuple[int, int]:
        return Helper.rank, int(__import__("os").environ["LOCAL_RANK"])

    with meshsim.per_rank(Helper, "rank", fresh=lambda rank: rank):
        assert meshsim.run(body, 3) == [(0, 0), (1, 1), (2, 2)]
    assert Helper.rank == 0  # the caller's value is back
    with meshsim.per_rank(Helper, "rank", fresh=int):  # a builtin without a signature: called bare
        assert [r for r, _ in meshsim.run(body, 2)] == [0, 0]
