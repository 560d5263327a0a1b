"""The ledger snapshot file: read and checked, written atomically under a lock, in a stable order.

The format is :mod:`meshsim._observe.snapshot`'s; this module only knows its shape:
``{"about": ..., "version": 1, "tests": {key: {"rank R of N": [line, ...],
"estimate of N on TOPOLOGY": "12.3 us"}}}``, keys in natural order, each entry's
names by world size (ranks first, then their estimates).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock

__all__ = ["ESTIMATE", "VERSION", "entry_of", "load", "shown", "store"]

VERSION = 1
_ABOUT = (
    "meshsim ledger snapshots: per test id and rank, one line per collective: op api group dtype "
    'in=bytes out=bytes [reduce op] [peer=global rank]; "estimate of N on TOPOLOGY": the N ranks\' '
    "estimated communication time on that GPU topology (pytest --mesh-cost), checked within 10%. "
    "Rewritten by pytest --mesh-snapshot-update."
)
_LOCK_TIMEOUT = 60.0  # seconds a writer waits for another one to finish with the file
ESTIMATE = "estimate of "  # the prefix of an entry's estimate names


def entry_of(document: dict[str, Any], key: str) -> dict[str, Any]:
    """The entry for ``key``: ``"rank R of N"`` -> lines, ``"estimate of N on T"`` -> a duration."""
    entry: dict[str, Any] = document["tests"].get(key, {})
    return entry


def load(path: Path) -> dict[str, Any]:
    """The file's contents (an empty document when it does not exist).

    Raises:
        ValueError: it is not a snapshot file of this version.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"tests": {}}
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{shown(path)} is not a ledger snapshot file: not JSON ({error}). Resolve the merge "
            "conflict, or delete it and rerun to write it afresh."
        ) from None
    if not _valid(document):
        raise ValueError(
            f"{shown(path)} is not a ledger snapshot file of version {VERSION}: expected "
            '{"version": 1, "tests": {test id: {"rank R of N": [line, ...], '
            '"estimate of N on TOPOLOGY": "12.3 us"}}}. '
            "Delete it and rerun to write it afresh."
        )
    return document  # type: ignore[no-any-return]


def _valid(document: object) -> bool:
    if not isinstance(document, dict) or document.get("version") != VERSION:
        return False
    tests = document.get("tests")
    if not isinstance(tests, dict):
        return False
    return all(
        isinstance(entry, dict) and all(_valid_value(name, value) for name, value in entry.items())
        for entry in tests.values()
    )


def _valid_value(name: object, value: object) -> bool:
    if isinstance(name, str) and name.startswith(ESTIMATE):
        from meshsim._observe.cost import parse_seconds

        try:
            parse_seconds(value)  # type: ignore[arg-type]
        except ValueError:
            return False
        return True
    return isinstance(value, list) and all(isinstance(x, str) for x in value)


def store(
    path: Path, key: str, estimate: dict[str, str], runs: dict[str, Any], *, stale: Sequence[str]
) -> None:
    """Replace this run's ranks (and estimate) of entry ``key``, dropping ``stale`` names (other world
    sizes' stay), under the folder's lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent):
        tests = load(path)["tests"]  # again: another writer may have added keys since
        kept = {name: value for name, value in tests.get(key, {}).items() if name not in stale}
        entry = {**kept, **runs, **estimate}
        tests[key] = {name: entry[name] for name in sorted(entry, key=_rank_order)}
        ordered = {k: tests[k] for k in sorted(tests, key=_id_order)}
        text = json.dumps(
            {"about": _ABOUT, "version": VERSION, "tests": ordered}, indent=2, ensure_ascii=False
        )
        _replace(path, text + "\n")


def _replace(path: Path, text: str) -> None:
    """Write ``path`` atomically: readers see the old file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold the folder's writers' lock (``filelock``: fcntl on POSIX, msvcrt on Windows).

    The lock file lives in the temporary directory, named after the folder, so nothing
    is left beside the snapshots; every process of the machine writing there (xdist
    workers, torchrun ranks) takes the same one.

    Raises:
        TimeoutError: another process held it for ``_LOCK_TIMEOUT`` seconds.
    """
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    lock = filelock.FileLock(os.path.join(tempfile.gettempdir(), f"meshsim-snapshots-{key}.lock"))
    try:
        lock.acquire(timeout=_LOCK_TIMEOUT)
    except filelock.Timeout:
        raise TimeoutError(
            f"another process held the lock on {shown(folder)} for {_LOCK_TIMEOUT:g} s; "
            "is a pytest run stuck?"
        ) from None
    try:
        yield
    finally:
        lock.release()


def _rank_order(name: str) -> tuple[int, int, str]:
    """``"rank R of N"`` sorts by N, then R, then N's estimates; anything else (a hand edit) after them."""
    words = name.split()
    if len(words) == 4 and words[1].isdigit() and words[3].isdigit():
        return int(words[3]), int(words[1]), ""
    if name.startswith(ESTIMATE) and len(words) >= 5 and words[2].isdigit():
        return int(words[2]), 1 << 61, name
    return (1 << 62, 0, name)


def _id_order(key: str) -> list[Any]:
    """Test ids in natural order: ``test[2]`` before ``test[10]``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, for messages."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
