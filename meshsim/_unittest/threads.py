"""torch's ``spawn_threads_and_init_comms`` decorator, with the function run on one simulated world.

torch's decorator (``torch.testing._internal.common_distributed``) runs a test
function on ``world_size`` threads, each with an initialized default process group
(torch's threaded one), passing every thread the same ``self``. When threads raise,
it raises a ``RuntimeError`` that lists each failing thread's traceback (torch's
own ``TestCollectivesWithWrapper`` tests expect that type), and when threads only
skipped, ``unittest.SkipTest``. This one does the same on meshsim's ranks:

- every rank calls ``func(self, *args, **kwargs)`` with the same ``self``, its
  default group initialized, taking torch's own CPU collectives (as meshsim's
  unittest bases do);
- a rank that fails (any exception but a skip or xfail) makes the call raise a
  ``RuntimeError`` naming each rank that failed on its own, with its traceback,
  chained to the first one's exception; ranks released from a collective by the
  failure have no say (:mod:`meshsim._engine.outcomes`);
- otherwise a skip (``unittest.SkipTest``, ``pytest.skip``, torch's skip exit codes)
  raises ``unittest.SkipTest`` with its reason and rank, and ``pytest.xfail`` is
  raised as the rank raised it;
- a world meshsim itself stops (ranks in different collectives, a deadlock, its
  timeout) raises a ``RuntimeError`` with meshsim's report, where torch's threads
  would hang until a timeout and then raise one.
"""

from __future__ import annotations

import functools
import unittest
from collections.abc import Callable
from typing import Any, TypeVar, overload

from meshsim._base.errors import MeshError, RankError, format_user_traceback
from meshsim._engine.outcomes import XFAILED, kind_of
from meshsim._engine.world import run_ranks
from meshsim._unittest.bases import _DEFAULT_WORLD_SIZE, _skip_reason, _timeout

__all__ = ["spawn_threads_and_init_comms"]

# unittest leaves out traceback levels of modules that set this: a report starts at the test
__unittest = True

F = TypeVar("F", bound=Callable[..., Any])


@overload
def spawn_threads_and_init_comms(
    func: None = None, timeout: float | None = None, world_size: int = _DEFAULT_WORLD_SIZE
) -> Callable[[F], F]: ...


@overload
def spawn_threads_and_init_comms(
    func: F, timeout: float | None = None, world_size: int = _DEFAULT_WORLD_SIZE
) -> F: ...


def spawn_threads_and_init_comms(
    func: Callable[..., Any] | None = None,
    timeout: float | None = None,
    world_size: int = _DEFAULT_WORLD_SIZE,
) -> Any:
    """Run the decorated test function on ``world_size`` simulated ranks, as torch's decorator does.

    Used bare (``@spawn_threads_and_init_comms``) or with arguments
    (``@spawn_threads_and_init_comms(world_size=4)``), as torch's is.

    Args:
        func: the function; each rank calls it with the same ``self`` and arguments.
        timeout: seconds the world may go without progress; None: torch's default
            (``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``, else 300).
        world_size: the number of ranks (torch's default: 4).

    Returns:
        the decorated function (or, without ``func``, a decorator).

    Raises:
        TypeError: ``world_size`` is not an int, or ``timeout`` not a number.
        ValueError: ``world_size`` is below 1, or ``timeout`` not positive.
    """
    _check(timeout, world_size)
    if func is None:
        return functools.partial(spawn_threads_and_init_comms, timeout=timeout, world_size=world_size)

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        seconds = _timeout() if timeout is None else float(timeout)
        try:
            # gpu_paths=False: torch's own CPU collectives, which torch's tests count on
            run_ranks(func, world_size, args=(self, *args), kwargs=kwargs, timeout=seconds, gpu_paths=False)
        except RankError as error:
            outcome = _outcome(error)
        except MeshError as error:
            raise RuntimeError(f"the {world_size}-rank meshsim world was stopped:\n{error}") from error
        else:
            return
        # raised outside the except block: a rank's exception is not "during" the RankError
        raise outcome

    return wrapper


def _outcome(error: RankError) -> BaseException:
    """torch's decorator's answer for a world whose ranks raised: failures, else the first skip."""
    failures = list(error.failures) or [(error.rank, error.__cause__ or error)]
    failed = [(rank, exc) for rank, exc in failures if _skip_reason(exc) is None and kind_of(exc) != XFAILED]
    if failed:
        text = "".join(
            f"Thread {rank} exited with exception:\n{format_user_traceback(exc)}\n" for rank, exc in failed
        )
        runtime = RuntimeError(text)
        runtime.__cause__ = failed[0][1]
        return runtime
    rank, exc = failures[0]
    reason = _skip_reason(exc)
    if reason is None:  # an xfail: pytest reports it as the rank raised it
        return exc
    skip = unittest.SkipTest(f"{reason} (rank {rank})")
    skip.__cause__ = exc
    return skip


def _check(timeout: object, world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"spawn_threads_and_init_comms: world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"spawn_threads_and_init_comms: world_size must be at least 1, got {world_size}")
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"spawn_threads_and_init_comms: timeout must be seconds (a number), got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"spawn_threads_and_init_comms: timeout must be positive, got {timeout!r}")
