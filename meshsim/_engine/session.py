"""A session: one world kept across calls, started again after a failure, as a torchrun job is relaunched.

``meshsim.run`` gives each call a world of its own. A :class:`Session` keeps one
:class:`meshsim._engine.world.World` across calls, so what a rank sets up in one
call (a distributed manager's state, meshes, groups, module globals declared per
rank) is there in the next, as in a torchrun process that runs test after test.
Between calls the caller's own process state is in place; what the caller changes
meanwhile, every rank takes at the next call (:meth:`World.call`).

A call that fails on any rank ends the world, as a failure ends a torchrun job:
the next call starts a new one, which first replays the session's set-up calls
(:meth:`Session.add_setup`), as a relaunched job would run its start-up again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshsim._engine.world import World, _check_args
from meshsim._process.cuda import Spec

__all__ = ["Session"]


class Session:
    """Ranks that run call after call in one world, started on the first call.

    Args:
        world_size: the number of ranks.

    Keyword args:
        backend, timeout, gpu_paths, num_threads: as for :func:`meshsim.run`.
        cuda: the CUDA emulation every world of the session has (each sizes it), as for
            :class:`meshsim._engine.world.World`.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "sim",
        timeout: float = 60.0,
        gpu_paths: bool = True,
        num_threads: int | str | None = 1,
        cuda: Spec | str | None = None,
    ) -> None:
        _check_args(world_size, timeout, backend, num_threads)
        self.world_size = world_size
        self._options: dict[str, Any] = {
            "backend": backend,
            "timeout": timeout,
            "gpu_paths": gpu_paths,
            "num_threads": num_threads,
            "cuda": cuda,
        }
        self.worlds = 0  # worlds started so far (a failed call ends one)
        self._setup: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._world: World | None = None

    @property
    def running(self) -> bool:
        """Whether a world is up (it starts on the first call and ends with a failed one)."""
        return self._world is not None and not self._world.closed

    def add_setup(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on every rank now, and again first thing in every later world."""
        self._setup.append((fn, args))
        if self._world is not None and not self._world.closed:
            self._world.call(fn, args, traced=False)

    def call(self, fn: Callable[..., Any], *args: Any, name: str | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns each rank's result, or raises as :func:`meshsim.run`.

        ``name``: what a trace calls the call (under pytest ``--mesh-trace``); ``fn``'s name by default.
        """
        world = self._world
        if world is None or world.closed:
            world = self._world = World(self.world_size, **self._options).start()
            self.worlds += 1
            for setup, setup_args in self._setup:
                world.call(setup, setup_args, traced=False)
        return world.call(fn, args, name=name)

    def close(self) -> None:
        """End the world (if one runs), letting every rank finish; raises if that fails.

        A world a failed (or skipped) call ended was reported by that call: closing the
        session does not raise it again.
        """
        world, self._world = self._world, None
        if world is not None and not world.closed:
            world.close()
