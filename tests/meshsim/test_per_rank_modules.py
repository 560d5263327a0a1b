"""meshsim.per_rank_module: modules each simulated rank imports for itself, as each torchrun process does."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import meshsim

HELPER = """
import os
rank = int(os.environ["LOCAL_RANK"])
imports = []

class Utils:
    rank = int(os.environ["LOCAL_RANK"])
"""

STATE = """
from {helper} import Utils  # a declared module importing another binds the rank's own
import torch.distributed as dist

_GROUP = None
seen_at_import = Utils.rank

def initialize():
    global _GROUP
    _GROUP = dist.new_group(list(range(dist.get_world_size())))

def get_group():
    return _GROUP
"""


@pytest.fixture
def make_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, str], ModuleType]]:
    """Write a module under a name of this test's own, import it; it is forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made: list[str] = []

    def make(name: str, source: str) -> ModuleType:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


@pytest.fixture
def modules(
    make_module: Callable[[str, str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> tuple[ModuleType, ModuleType]:
    """A helper that reads LOCAL_RANK at import, and a parallel-state module with a module-global group."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # what the caller (the pytest process) imports them with
    suffix = request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    helper = make_module(f"helper_{suffix}", HELPER)
    state = make_module(f"state_{suffix}", STATE.format(helper=helper.__name__))
    return helper, state


def test_each_rank_runs_the_module_code_with_its_own_environment(
    modules: tuple[ModuleType, ModuleType],
) -> None:
    helper, state = modules
    get_group = state.get_group  # imported before the world: reads the running rank's globals
    with meshsim.per_rank_module(helper.__name__, state.__name__):

        def body() -> tuple[int, int, int, list[int]]:
            state.initialize()
            dist.barrier()  # every rank has set its global before any uses it
            t = torch.ones(1)
            dist.all_reduce(t, group=get_group())
            return (
                helper.rank,
                helper.Utils.rank,
                state.seen_at_import,
                dist.get_process_group_ranks(get_group()),
            )

        results = meshsim.run(body, 4)
    assert results == [(r, r, r, [0, 1, 2, 3]) for r in range(4)]
    assert (helper.rank, state.seen_at_import, state._GROUP) == (0, 0, None)  # the caller's, back


def test_a_session_keeps_each_ranks_globals_across_calls(modules: tuple[ModuleType, ModuleType]) -> None:
    helper, state = modules
    from meshsim._engine import Session

    session = Session(3)
    with meshsim.per_rank_module(state.__name__, helper.__name__):
        try:
            session.call(state.initialize)
            helper.imports.append("caller")  # between calls the caller has its own namespace
            ranks = session.call(
                lambda: [*dist.get_process_group_ranks(state.get_group()), len(helper.imports)]
            )
        finally:
            session.close()
    assert ranks == [[0, 1, 2, 0]] * 3
    assert helper.imports == ["caller"]


def test_a_shared_module_global_group_is_reported_with_its_cause(
    modules: tuple[ModuleType, ModuleType],
) -> None:
    _, state = modules

    def body() -> None:
        state.initialize()
        dist.barrier()  # rank 3 wrote the shared global last
        dist.all_reduce(torch.ones(1), group=state.get_group())

    with pytest.raises(meshsim.RankError) as info:
        meshsim.run(body, 4)
    message = str(info.value)
    assert info.value.rank == 0
    assert "rank 0 called all_reduce on a process group that rank 3 created" in message
    assert f"It is {state.__name__}._GROUP: a module global every rank thread shares" in message
    assert f"meshsim.per_rank_module('{state.__name__}')" in message
    # the cause is the last line, not torch's logger failing to look the foreign group up
    assert (
        message.rstrip().splitlines()[-1].startswith("meshsim._base.errors.ForeignGroupError: rank 0 called")
    )


def test_gloo_thread_ranks_refuse_declared_modules(modules: tuple[ModuleType, ModuleType]) -> None:
    helper, _ = modules
    with meshsim.per_rank_module(helper.__name__):
        with pytest.raises(
            RuntimeError, match=rf"modules declared per rank \({helper.__name__}\) need ranks that"
        ):
            meshsim.run(lambda: None, 2, backend="gloo")
    meshsim.run(lambda: None, 2, backend="gloo")  # removed: gloo runs again


def test_removing_the_declaration_makes_the_module_shared_again(
    modules: tuple[ModuleType, ModuleType],
) -> None:
    helper, _ = modules
    handle = meshsim.per_rank_module(helper)
    assert handle.names == (helper.__name__,)
    handle.remove()
    assert meshsim.run(lambda: helper.rank, 2) == [0, 0]  # imported once, by the caller


def test_a_name_covers_the_submodules_imported_by_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg_per_rank"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nrank = int(os.environ['RANK'])\n")
    (package / "inner.py").write_text("import os\nrank = int(os.environ['RANK'])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    try:
        inner = importlib.import_module("pkg_per_rank.inner")
        with meshsim.per_rank_module("pkg_per_rank") as handle:
            assert handle.names == ("pkg_per_rank", "pkg_per_rank.inner")
            results = meshsim.run(lambda: (sys.modules["pkg_per_rank"].rank, inner.rank), 2)
        assert results == [(0, 0), (1, 1)]
        assert sys.modules["pkg_per_rank"].inner is inner  # the package keeps its submodule attribute
    finally:
        for name in ("pkg_per_rank.inner", "pkg_per_rank"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        (3, TypeError, "takes module names or modules, got 3"),
        ("not a-name", ValueError, "'not a-name' is not a module name"),
        ("torch.distributed", ValueError, "meshsim, torch, pytest and the import system are one per process"),
        ("_json", ValueError, "C extension|no code a rank could run again"),
        ("no_such_module_anywhere", ImportError, "no_such_module_anywhere"),
    ],
    ids=["not-a-module", "not-a-name", "torch", "c-extension", "missing"],
)
def test_bad_declarations_say_what_was_wrong(given: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        meshsim.per_rank_module(given)  # type: ignore[arg-type]


def test_a_module_with_names_declared_per_rank_cannot_be_declared_whole(
    modules: tuple[ModuleType, ModuleType],
) -> None:
    _, state = modules
    with meshsim.per_rank(state, "_GROUP"):
        with pytest.raises(ValueError, match=rf"{state.__name__}._GROUP is declared per rank already"):
            meshsim.per_rank_module(state)


def test_groups_that_differ_because_ranks_share_state_name_the_likely_cause(
    make_module: Callable[[str, str], ModuleType],
) -> None:
    shared = make_module(
        "state_groups_per_rank",
        """
        import torch.distributed as dist

        _MADE = []  # a process's record of what it initialized: one per torchrun process

        def initialize():
            ranks = [dist.get_rank()] if _MADE else list(range(dist.get_world_size()))
            _MADE.append(dist.new_group(ranks))
        """,
    )
    with pytest.raises(
        meshsim.RankError, match=r"(?s)likely cause is state the rank threads share.*per_rank_module"
    ):
        meshsim.run(shared.initialize, 2)
    with meshsim.per_rank_module(shared):
        meshsim.run(shared.initialize, 2)
