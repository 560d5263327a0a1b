"""A script as torchrun runs it, on the ranks of one simulated world: ``meshsim run``'s engine.

Each rank runs the script's code as ``__main__`` in a module of its own (its own
globals, its own ``sys.modules["__main__"]``, swapped at hand-overs as every per-rank
value is), with the ``sys.argv``, ``sys.path[0]`` and torchrun's environment a
process of that rank would have. ``sys.exit(0)`` (or ``None``) ends a rank's script
as success; any other exit status is that rank's failure, as under torchrun.

The code is found and compiled once, before any rank starts, so a missing script
or module, or a syntax error, is reported without starting a world.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import os
import sys
import threading
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType
from typing import Any, TextIO

from meshsim._base.context import current
from meshsim._process.handover import declare_accessor
from meshsim._process.state import rank_environment
from meshsim._record.ledger import Ledger, record
from meshsim._record.regions import collecting_regions

__all__ = [
    "RankRun",
    "Target",
    "exit_status",
    "find_target",
    "prefixed_output",
    "run_target",
    "script_process",
]


@dataclass(frozen=True)
class Target:
    """What a rank runs: a script file or a module's code, and the arguments after it.

    Attributes:
        name: the path or module name as given.
        file: the file whose code runs (``__file__``).
        code: the compiled code.
        spec: the module spec (``-m``), or None for a script path.
        argv: ``sys.argv`` as Python sets it: the file (``-m``: its full path), then the arguments.
        path0: ``sys.path[0]`` as Python sets it: the script's folder, or the working folder for ``-m``.
    """

    name: str
    file: str
    code: CodeType
    spec: ModuleSpec | None
    argv: tuple[str, ...]
    path0: str


def find_target(script: str | None, module: str | None, args: Sequence[str]) -> Target:
    """The code to run, found and compiled now (before any rank starts).

    Raises:
        ValueError: no such script or module, neither or both given; the message names it.
        SyntaxError: the code does not compile (with its file and line).
    """
    if (script is None) == (module is None):
        raise ValueError("meshsim run needs a script path or -m MODULE (one of them)")
    if script is not None:
        if not os.path.isfile(script):
            what = "a folder, not a script" if os.path.isdir(script) else "no such file"
            raise ValueError(f"cannot run script {script!r}: {what}")
        with open(script, "rb") as source:
            code = compile(source.read(), script, "exec")
        folder = os.path.dirname(os.path.abspath(script))
        return Target(script, script, code, None, (script, *args), folder)
    assert module is not None
    sys.path.insert(0, os.getcwd())  # where python -m looks first
    try:
        spec = _module_spec(module)
    finally:
        sys.path.pop(0)
    if spec.loader is None or not hasattr(spec.loader, "get_code"):
        raise ValueError(f"cannot run module {module!r}: its loader gives no code to run")
    code = spec.loader.get_code(spec.name)
    if code is None:
        raise ValueError(f"cannot run module {module!r}: it has no code (a namespace package?)")
    file = spec.origin or module
    return Target(module, file, code, spec, (file, *args), os.getcwd())


def _module_spec(name: str) -> ModuleSpec:
    """``name``'s spec, or its ``__main__``'s for a package, as ``python -m`` finds them."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"cannot run module {name!r}: {exc}") from None
    if spec is None:
        raise ValueError(f"cannot run module {name!r}: no module of that name is importable here")
    if spec.submodule_search_locations is not None:  # a package: its __main__, as python -m runs it
        main = importlib.util.find_spec(f"{name}.__main__")
        if main is None:
            raise ValueError(f"cannot run module {name!r}: it is a package without a __main__ module")
        spec = main
    return spec


@dataclass
class RankRun:
    """What one rank's script left: its whole ledger and its regions, in order."""

    ledger: Ledger
    regions: list[tuple[str, Ledger]]


def run_target(target: Target) -> RankRun:
    """The rank's run of the script (called on every rank of the world)."""
    module = ModuleType("__main__")
    module.__dict__.update(
        __file__=target.file,
        __builtins__=builtins,
        __spec__=target.spec,
        __loader__=target.spec.loader if target.spec is not None else None,
        __package__=target.spec.parent if target.spec is not None else None,
        __cached__=None,
    )
    sys.modules["__main__"] = module  # this rank's own (swapped at hand-overs)
    with collecting_regions() as regions, record() as ledger:
        try:
            exec(_own_copy(target.code), module.__dict__)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    return RankRun(ledger, regions)


def _own_copy(code: CodeType) -> CodeType:
    """A rank's own copy of the script's code, and of every function's and class body's inside it.

    ``torch.compile`` keeps what it compiled for a function on the function's code
    object (Dynamo's cache entries, torch 2.11-2.15), and the code it runs instead
    calls the compiled graph by a name it puts in the globals of the frame it compiled
    (``__compiled_fn_N``). The ranks' ``__main__`` namespaces differ, as each torchrun
    process's does: one code object shared by the ranks gave a rank another rank's
    entry, whose name its own globals lack (``NameError: __compiled_fn_...``).
    """
    consts = tuple(_own_copy(c) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_consts=consts)


def exit_status(error: BaseException) -> int:
    """The exit status a failed run ends with: a rank's ``sys.exit(n)``'s ``n``, else 1."""
    cause = error.__cause__
    if isinstance(cause, SystemExit) and isinstance(cause.code, int) and cause.code:
        return cause.code
    return 1


def _set_main(module: ModuleType | None) -> None:
    if module is None:
        sys.modules.pop("__main__", None)
    else:
        sys.modules["__main__"] = module


@contextmanager
def script_process(target: Target, *, threads_at_once: int | None = None) -> Iterator[None]:
    """The process as Python sets it up for the script: ``sys.argv``, ``sys.path[0]``; undone after.

    ``threads_at_once``: ranks run at once (gloo thread ranks) with this many per node;
    they share the process's environment, so ``os.environ`` answers each rank's own
    ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` and ``ROLE_RANK`` from the rank asking
    (Python's reads only; C code's ``getenv`` sees the process's).
    """
    argv, path, environ = sys.argv, list(sys.path), os.environ
    sys.argv = list(target.argv)
    sys.path.insert(0, target.path0)
    if threads_at_once is not None:
        os.environ = _RankEnviron(environ, threads_at_once)  # type: ignore[assignment]  # noqa: B003
    try:
        yield
    finally:
        sys.argv = argv
        sys.path[:] = path
        os.environ = environ  # noqa: B003


class _RankEnviron(MutableMapping[str, str]):
    """``os.environ`` for ranks that run at once: the per-rank variables answer for the asking rank."""

    def __init__(self, environ: MutableMapping[str, str], local_world_size: int) -> None:
        self.environ = environ
        self.local = local_world_size

    def _own(self) -> dict[str, str]:
        seat = current().seat
        if seat is None:
            return {}
        return dict(rank_environment(seat.rank, self.local))  # what a serialized world sets

    def __getitem__(self, key: str) -> str:
        own = self._own()
        return own[key] if key in own else self.environ[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.environ[key] = value

    def __delitem__(self, key: str) -> None:
        del self.environ[key]

    def __iter__(self) -> Iterator[str]:
        return iter({**self.environ, **self._own()})

    def __len__(self) -> int:
        return len({**self.environ, **self._own()})

    def copy(self) -> dict[str, str]:
        return dict(self)

    def __getattr__(self, name: str) -> Any:  # os.environ's own extras (encodekey, _data, ...)
        return getattr(self.environ, name)


class _RankLines(io.TextIOBase):
    """A stream whose lines say which rank wrote them (``[rank3]:``), as torchrun's ``--tee`` does.

    Lines of ranks outside ``ranks`` (None: all) are dropped; a thread that is no rank
    (the driver) writes through. A rank's unfinished line waits for its end.
    """

    def __init__(self, stream: TextIO, *, prefix: bool, ranks: frozenset[int] | None) -> None:
        super().__init__()
        self.stream = stream
        self.prefix = prefix
        self.ranks = ranks
        self.pending: dict[int, str] = {}
        self.lock = threading.Lock()  # gloo thread ranks write at once

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        seat = current().seat
        if seat is None:
            return self.stream.write(text)
        rank = seat.rank
        if self.ranks is not None and rank not in self.ranks:
            return len(text)
        with self.lock:
            lines = (self.pending.pop(rank, "") + text).split("\n")
            if lines[-1]:
                self.pending[rank] = lines[-1]
            head = f"[rank{rank}]:" if self.prefix else ""
            for line in lines[:-1]:
                self.stream.write(f"{head}{line}\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def finish(self) -> None:
        """Write what ranks left without a newline."""
        with self.lock:
            for rank, rest in sorted(self.pending.items()):
                head = f"[rank{rank}]:" if self.prefix else ""
                self.stream.write(f"{head}{rest}\n")
            self.pending.clear()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno: the real stream's
        return getattr(self.stream, name)


@contextmanager
def prefixed_output(*, prefix: bool, ranks: frozenset[int] | None) -> Iterator[None]:
    """Route ``sys.stdout`` and ``sys.stderr`` through :class:`_RankLines` while the block runs."""
    if not prefix and ranks is None:
        yield
        return
    out, err = sys.stdout, sys.stderr
    sys.stdout = rank_out = _RankLines(out, prefix=prefix, ranks=ranks)  # type: ignore[assignment]
    sys.stderr = rank_err = _RankLines(err, prefix=prefix, ranks=ranks)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err
        rank_out.finish()
        rank_err.finish()


# sys.modules["__main__"] is per rank while a script runs: each rank runs it as a
# process of its own would (declared when this module is imported, by meshsim run only).
declare_accessor(
    "sys.modules['__main__']",
    get=lambda: sys.modules.get("__main__"),
    set=_set_main,
)
