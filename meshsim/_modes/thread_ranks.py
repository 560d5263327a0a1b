"""Thread ranks: a test body on simulated (sim) or real gloo ranks, each a thread of this process.

The mode takes the test function, its (partly per-rank) arguments and a world
size, and either returns normally or raises what the failing rank raised. The
pytest plugin picks the mode; the modes know nothing about pytest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from meshsim._engine.world import run
from meshsim._modes.fixtures import RankFixtures, resolve
from meshsim._process.cuda import Spec
from meshsim._record.ledger import Ledger

__all__ = ["TestFunction", "local_device", "run_on_threads"]

TestFunction = Callable[..., object]


def local_device() -> None:
    """The calling rank starts on its local emulated GPU, as meshsim's torchrun ranks on real ones.

    Where meshsim makes a test's default group, its torchrun ranks and spawned ranks with
    GPUs call ``torch.cuda.set_device(LOCAL_RANK)``; thread ranks emulating CUDA do the
    same (nothing where the thread does not emulate CUDA).
    """
    import torch.distributed as dist

    from meshsim._process.cuda import take_local_device

    take_local_device(dist.get_rank())


def _body(test: TestFunction, funcargs: dict[str, Any], record: bool, own_device: bool) -> Ledger | None:
    if own_device:
        local_device()  # before the rank's fixtures: they may make tensors on it
    fixtures = RankFixtures()
    if record:
        fixtures.open_ledger()
    kwargs = resolve(funcargs, fixtures)
    with fixtures.recording():
        test(**kwargs)
    fixtures.finish()  # the user fixtures built on this rank: the world ends with the test
    return fixtures.ledger


def run_on_threads(
    test: TestFunction,
    funcargs: dict[str, Any],
    world_size: int,
    *,
    backend: str,
    timeout: float,
    num_threads: int | str | None = 1,
    record: bool = False,
    cuda: Spec | None = None,
) -> list[Ledger | None]:
    """Run the test body on ``world_size`` thread ranks (``backend`` "sim" or "gloo").

    ``cuda``: the CUDA emulation (``--mesh-cuda``, resolved; None: off), which the world
    sizes to ``world_size``.

    Returns:
        each rank's ledger of the body, rank 0's first: recorded when ``record`` is
        true or the test asked for its ``ledger``, else None.
    """
    # gloo thread ranks run at once and share one current device (docs/cuda.md): none takes its own
    body = functools.partial(_body, test, funcargs, record, cuda is not None and backend == "sim")
    # traces and error tables call the world's function by the test's name, not this module's
    body.__qualname__ = getattr(test, "__qualname__", None) or getattr(test, "__name__", "test")  # type: ignore[attr-defined]
    return run(
        body,
        world_size,
        backend=backend,
        timeout=timeout,
        num_threads=num_threads,
        cuda=cuda,
    )
