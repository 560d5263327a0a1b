"""The world's key-value store: a ``torch.distributed.Store`` whose waits are cooperative.

c10d's stores block in C++; with one rank running at a time, a rank waiting
there for a key another rank has yet to set would stall the world until the
store's own timeout. This store blocks through the scheduler instead, so a
store-based barrier (``TORCH_DIST_INIT_BARRIER=1``) or user code waiting on the
store works, and a key nobody will set is reported as a deadlock at once.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch._C._distributed_c10d import Store as _CStore

from meshsim._base.waits import Blocking, Waitable
from meshsim._record.sites import call_site

Store: Any = _CStore  # a class the stubs do not let mypy subclass

__all__ = ["SimStore"]


class _KeysWait(Waitable):
    def __init__(self, store: SimStore, keys: list[str], what: str, site: str) -> None:
        super().__init__()
        self.store = store
        self.keys = keys
        self.what = what
        self.site = site

    def ready(self) -> bool:
        return all(k in self.store._data for k in self.keys)

    def describe(self, rank: int) -> str:
        missing = [k for k in self.keys if k not in self.store._data]
        return f"waiting in store.{self.what} for key(s) {missing} at {self.site}; no rank has set them"

    def missing(self) -> tuple[int, ...]:
        return ()


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SimStore(Store):  # type: ignore[misc]
    """An in-memory store for one world; ``current_rank`` says which rank is calling."""

    def __init__(self, scheduler: Blocking, current_rank: Callable[[], int | None]) -> None:
        super().__init__()
        self._scheduler = scheduler
        self._current_rank = current_rank
        self._data: dict[str, bytes] = {}
        self._waits: list[_KeysWait] = []

    # -- writes ---------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        with self._scheduler:
            self._data[key] = _bytes(value)
            self._wake()

    def add(self, key: str, amount: int) -> int:
        with self._scheduler:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._wake()
            return value

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self._scheduler:
            current = self._data.get(key)
            if (current is None and _bytes(expected) == b"") or current == _bytes(expected):
                self._data[key] = _bytes(desired)
                self._wake()
                return self._data[key]
            return current if current is not None else _bytes(expected)

    def delete_key(self, key: str) -> bool:
        with self._scheduler:
            return self._data.pop(key, None) is not None

    def append(self, key: str, value: Any) -> None:
        with self._scheduler:
            self._data[key] = self._data.get(key, b"") + _bytes(value)
            self._wake()

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        with self._scheduler:
            for key, value in zip(keys, values):
                self._data[key] = _bytes(value)
            self._wake()

    # -- reads ------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        self._wait_for([key], "get")
        return self._data[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait_for(list(keys), "multi_get")
        return [self._data[k] for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(list(keys), "wait")

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    def num_keys(self) -> int:
        return len(self._data)

    def list_keys(self) -> list[str]:
        return list(self._data)

    def set_timeout(self, timeout: timedelta) -> None:
        """The world's timeout governs every wait; a store-level one is not needed."""

    # -- internals ----------------------------------------------------------------

    def _wait_for(self, keys: list[str], what: str) -> None:
        if all(k in self._data for k in keys):
            return
        rank = self._current_rank()
        if rank is None:
            raise RuntimeError(
                f"store.{what}({keys}) would block a thread that is not a rank of this world; "
                "only rank threads may wait on a meshsim store"
            )
        wait = _KeysWait(self, keys, what, call_site(2))
        with self._scheduler:
            if wait.ready():
                return
            self._waits.append(wait)
        self._scheduler.wait(rank, wait)

    def _wake(self) -> None:
        """Complete every wait whose keys are now all set. Call with the lock held."""
        ready = [w for w in self._waits if w.ready()]
        for wait in ready:
            self._waits.remove(wait)
            self._scheduler.wake(wait)
