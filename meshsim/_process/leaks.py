"""torch.distributed module globals that a world leaves changed: found and reported.

A flag a rank sets is that rank's process's under torchrun, and gone with it. The
flags meshsim knows are per rank (:mod:`meshsim._process.integrations`); any other
simple module global of ``torch.distributed`` (a bool, number, string or None),
memos of facts about the installation aside (``_MEMOS``),
that differs after a world from what it was before is reported with a
:class:`meshsim.StateLeakWarning`, naming it and both values, so that a test
that passes or fails by test order shows why.

Only modules loaded when the world starts are watched; the list of names is kept
and grows as modules load, so a world pays for two passes over about a hundred
values.

DTensor's sharding-propagation registries (the rules and strategies registered per
operator) are one per process too, and big (a thousand entries): per rank they
would cost every world a copy per rank, and a module imported inside one rank
registers its strategies once for every rank, as every process would. So they
stay shared, and a world that leaves one with more or fewer entries than it had,
having imported no module, is reported naming it: a registration a rank made at
run time (torch's ``op_strategy_context`` around a collective, where ranks undo
each other's), which every later world and the caller would otherwise see. A world
that imported modules is not judged: torch registers strategies as modules load
(``prims.fma``'s as ``torch.compile`` first runs), as it would in every process.
Only sizes are compared (two ``len`` calls per registry and world); a registration
replaced in place is not seen.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from meshsim._base import MESHSIM_DIR
from meshsim._base.errors import StateLeakWarning

__all__ = ["LeakCheck"]

_PREFIX = "torch.distributed"
_SIMPLE = (bool, int, float, str, type(None))
_ABSENT: Any = object()
# Memos torch fills on first use with a fact about the installation, the same in every
# process: whichever world fills one leaves the value a rank's own process would compute.
_MEMOS = frozenset({("torch.distributed", "_spmd_types_available")})  # torch 2.14+


class _Names:
    """The simple globals of loaded torch.distributed modules, found once per module."""

    def __init__(self) -> None:
        self.keys: list[tuple[str, dict[str, Any], str]] = []  # (module, its namespace, global)
        self._modules: set[str] = set()
        self._seen = 0  # len(sys.modules) at the last look

    def refresh(self) -> None:
        if len(sys.modules) == self._seen:
            return
        self._seen = len(sys.modules)
        for name, module in list(sys.modules.items()):
            if module is None or name in self._modules or not name.startswith(_PREFIX):
                continue
            self._modules.add(name)
            namespace = vars(module)
            self.keys += [
                (name, namespace, key)
                for key, value in namespace.items()
                # type(), not isinstance: torch.distributed.reduce_op warns when asked its class
                if not key.startswith("__") and type(value) in _SIMPLE and (name, key) not in _MEMOS
            ]


def _still_equal(before: Any, after: Any) -> bool:
    """Whether a simple global rebound to another object still holds an equal value of its type."""
    return type(before) is type(after) and type(after) in _SIMPLE and before == after


_NAMES = _Names()


# DTensor's ShardingPropagator registries, per operator (checked in torch 2.11-2.15; a name
# a version lacks is skipped). Not op_to_schema_info: DTensor fills it on an operator's
# first use through a decomposition, a memo.
_TABLES = ("op_to_rules", "op_strategy_funcs", "op_single_dim_strategy_funcs")


def _table_sizes() -> list[tuple[str, int]]:
    """``(name, entries)`` of DTensor's sharding-propagation tables, if DTensor is loaded."""
    api = sys.modules.get("torch.distributed.tensor._api")
    dispatcher = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    if propagator is None:
        return []
    tables = [(name, getattr(propagator, name, None)) for name in _TABLES]
    return [(name, len(table)) for name, table in tables if isinstance(table, dict)]


class LeakCheck:
    """The watched globals' values as a world starts; :meth:`report` warns about those it changed."""

    def __init__(self) -> None:
        _NAMES.refresh()
        self._keys = _NAMES.keys
        self._before = [namespace.get(key, _ABSENT) for _, namespace, key in self._keys]
        self._tables = _table_sizes()
        self._modules = len(sys.modules)

    def report(self) -> None:
        self._report_globals()
        self._report_tables()

    def _report_tables(self) -> None:
        if len(sys.modules) != self._modules:  # imports register strategies, as in every process
            return
        before = dict(self._tables)
        lines = [
            f"  DTensor._op_dispatcher.sharding_propagator.{name}: {before[name]} -> {size} entries"
            for name, size in _table_sizes()
            if name in before and before[name] != size
        ]
        if not lines:
            return
        warnings.warn(
            StateLeakWarning(
                "the world left DTensor's sharding-propagation tables changed: ranks share one process's "
                "tables, and what a rank registered there at run time stays for every later world and the "
                "caller:\n" + "\n".join(lines) + "\nUndo a registration made in a rank before the world "
                "ends, and run a test that registers and undoes one around a collective on spawn (ranks "
                "undo each other's)."
            ),
            stacklevel=_caller_depth(),
        )

    def changed_globals(self) -> list[tuple[str, str, Any, Any]]:
        """``(module, name, before, after)`` for each watched global whose value changed since the start."""
        return [
            (module, key, before, after)
            for (module, namespace, key), before in zip(self._keys, self._before)
            # the identity test first: most globals are untouched, and a call per global costs
            if (after := namespace.get(key, _ABSENT)) is not before and not _still_equal(before, after)
        ]

    def _report_globals(self) -> None:
        changed = self.changed_globals()
        if not changed:
            return
        lines = [f"  {module}.{key}: {_show(old)} -> {_show(new)}" for module, key, old, new in changed]
        warnings.warn(
            StateLeakWarning(
                "the world left torch.distributed module globals changed, which a rank's own "
                "process would have taken with it:\n" + "\n".join(lines) + "\nSet them back in "
                "the rank, or declare them per rank: meshsim.per_rank(module, name)."
            ),
            stacklevel=_caller_depth(),
        )


def _caller_depth() -> int:
    """The ``stacklevel`` of the first frame outside meshsim (whoever ran the world)."""
    frame, depth = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(MESHSIM_DIR):
        frame, depth = frame.f_back, depth + 1
    return depth


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)
