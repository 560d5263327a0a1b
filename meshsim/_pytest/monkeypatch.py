"""A distributed test's ``monkeypatch`` on simulated ranks: one per rank, what it sets that rank's own.

Used by :mod:`meshsim._pytest.fixtures` (a user fixture that runs on ranks and takes
``monkeypatch``) and :mod:`meshsim._pytest.ranks` (a body that takes it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator
from typing import Any

import pytest

__all__ = ["rank_monkeypatch", "release_rank_monkeypatches"]

_MONKEYPATCH = pytest.StashKey[Any]()  # the test's per-rank monkeypatch placeholder
_HELD = pytest.StashKey[list[Callable[[], None]]]()  # what the test's ranks' monkeypatches hold


def rank_monkeypatch(item: pytest.Item) -> Any:
    """The test's ``monkeypatch`` on its ranks: one per rank, the attributes it sets that rank's own.

    Ranks share one process, so a module attribute one rank patches would be every
    rank's (the last rank's closure over its own mesh, say); under torchrun each
    process patches its own module. Each rank's monkeypatch makes what it sets
    per rank (:func:`meshsim._process.handover.hold`) and undoes it when the test
    ends on that rank. ``setitem``, ``setenv`` and ``syspath_prepend`` act as pytest's do.
    """
    from meshsim._modes.fixtures import recipe

    placeholder = item.stash.get(_MONKEYPATCH, None)
    if placeholder is None:
        held = item.stash[_HELD] = []

        def monkeypatch() -> Generator[_RankMonkeyPatch, None, None]:
            patch = _RankMonkeyPatch(held)
            yield patch
            patch.undo()

        placeholder = item.stash[_MONKEYPATCH] = recipe("monkeypatch", monkeypatch, {}, "function", object())
    return placeholder


def release_rank_monkeypatches(item: pytest.Item) -> None:
    """Make what the test's ranks patched process-wide again (a rank that failed did not undo it)."""
    for release in item.stash.get(_HELD, []):
        release()


_NOTSET: Any = object()


class _RankMonkeyPatch:
    """pytest's monkeypatch, whose attributes are this rank's own while the test runs.

    A wrapper (pytest's class is final): what it does not change, pytest's does.
    """

    def __init__(self, held: list[Callable[[], None]]) -> None:
        self._patcher = pytest.MonkeyPatch()
        self._held = held
        self._mine: list[Callable[[], None]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._patcher, name)

    def setattr(self, target: Any, name: Any = _NOTSET, value: Any = _NOTSET, raising: bool = True) -> None:
        patcher = self._patcher
        if value is _NOTSET:  # setattr("package.module.name", value)
            self._patch(target, None, lambda: patcher.setattr(target, name, raising=raising))
        else:
            self._patch(target, name, lambda: patcher.setattr(target, name, value, raising=raising))

    def delattr(self, target: Any, name: Any = _NOTSET, raising: bool = True) -> None:
        patcher = self._patcher
        if name is _NOTSET:  # delattr("package.module.name")
            self._patch(target, None, lambda: patcher.delattr(target, raising=raising))
        else:
            self._patch(target, name, lambda: patcher.delattr(target, name, raising=raising))

    def undo(self) -> None:
        self._patcher.undo()
        mine, self._mine = self._mine, []
        for release in reversed(mine):
            release()

    def _patch(self, target: Any, name: Any, change: Callable[[], None]) -> None:
        """Make the attribute this rank's own, then ``change`` it (pytest checks the arguments)."""
        from meshsim._engine import hold

        if name is None:
            if not isinstance(target, str):
                change()  # pytest's own error for a non-string target without a name
                return
            owner, name = _dotted(target)
        else:
            owner = target
        if not isinstance(name, str):
            change()  # pytest's own error
            return
        release = hold(owner, name)
        try:
            change()
        except BaseException:
            release()
            raise
        self._mine.append(release)
        self._held.append(release)


def _dotted(target: str) -> tuple[object, str]:
    """The object and attribute name that a dotted ``package.module.name`` target means."""
    path, _, attribute = target.rpartition(".")
    parts = path.split(".") if path else []
    for end in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            owner: object = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            owner = getattr(owner, part)
        return owner, attribute
    raise ValueError(
        f"monkeypatch target {target!r}: expected a dotted path to an attribute of an importable module, "
        "such as 'package.module.name'"
    )
