"""torch's distributed unittest bases, with each test method run on one simulated world.

The public names are in :mod:`meshsim.testing`; this module holds how they work:

- ``__init__`` replaces the test method with a launcher, as torch's bases do. Called
  (by unittest, after ``setUp`` in the calling thread), the launcher makes one
  instance of the test class per rank, as torch makes one per thread or process,
  and runs the original method on each in a world of ``world_size`` ranks
  (:func:`meshsim.run`). A rank's instance starts with the attributes ``setUp``
  gave the caller's and its own ``rank``.
- A rank that raises ends the world; the launcher raises that rank's own exception
  (a note names the rank), so unittest reports it with its traceback and an outer
  ``assertRaises`` sees its type. A skip on a rank skips the test, unless a rank
  failed (a failure is never hidden by a skip).
- ``subTest`` on a rank records each subtest's outcome and lets the rank go on, as
  unittest does; once the world has ended, the records are replayed in the calling
  thread through unittest's own ``subTest``, rank by rank, with ``rank`` added to
  the subtest's parameters. Runners only ever see the calling thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import unittest
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

# torch's test helpers that meshsim.testing keeps (private: torch.testing._internal,
# checked in torch 2.11-2.15). common_utils needs expecttest and takes about a second to
# import: meshsim.testing is imported only by the suites that use it.
from torch.testing._internal import common_distributed, common_utils
from torch.testing._internal.distributed._tensor import common_dtensor

from meshsim._base import MESHSIM_DIR
from meshsim._base.errors import MeshError, RankError
from meshsim._engine.world import num_threads_from_environment, run_ranks

__all__ = [
    "DTensorOpTestBase",
    "DTensorTestBase",
    "MultiThreadedTestCase",
    "with_comms",
]

# unittest leaves out the leading traceback levels of modules that set this (as its own
# do): a failure's report starts at the test's code, not at the launcher.
__unittest = True

_TorchTestCase: Any = common_utils.TestCase
_DEFAULT_WORLD_SIZE = int(common_distributed.DEFAULT_WORLD_SIZE)
_NUM_DEVICES, _DEVICE_TYPE = int(common_dtensor.NUM_DEVICES), str(common_dtensor.DEVICE_TYPE)
_MAIN_RANK = -1  # torch's MAIN_THREAD_RANK / MAIN_PROCESS_RANK: the caller, not a rank
_NO_MESSAGE: Any = object()  # subTest() called without a message
# the messages of torch's skip exit codes (TEST_SKIPS), by exit code
_SKIP_MESSAGES = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}


def _timeout() -> float:
    """Seconds a world may go without progress: torch's ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT`` or 300."""
    value = os.environ.get("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "300")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"DISTRIBUTED_TESTS_DEFAULT_TIMEOUT must be a number of seconds, got {value!r}"
        ) from None
    return seconds


@dataclass
class _Subtest:
    """One ``subTest`` block a rank ran: its message, parameters and how it ended (None: passed)."""

    rank: int
    message: Any
    params: dict[str, Any]
    error: BaseException | None


@dataclass
class _RankLog:
    """What a rank's instance records for the caller: its subtests, in order."""

    rank: int
    subtests: list[_Subtest] = field(default_factory=list)
    open_params: list[dict[str, Any]] = field(default_factory=list)  # enclosing subTest blocks


def _skip_types() -> tuple[type[BaseException], ...]:
    """Exception types that skip: unittest's, and pytest's when pytest is loaded (it raised it)."""
    outcomes = sys.modules.get("_pytest.outcomes")
    skipped = getattr(outcomes, "Skipped", None)
    return (unittest.SkipTest, skipped) if skipped is not None else (unittest.SkipTest,)


def _skip_reason(error: BaseException) -> str | None:
    """The reason when ``error`` skips the test, else None.

    torch's skip helpers exit with a ``TEST_SKIPS`` code where they find no
    ``_handle_test_skip`` hook; those exits skip too, with torch's message.
    """
    if isinstance(error, _skip_types()):
        return str(getattr(error, "msg", None) or error)
    if isinstance(error, SystemExit) and isinstance(error.code, int):
        return _SKIP_MESSAGES.get(error.code)
    return None


def _surfaced(error: RankError) -> BaseException:
    """What the caller raises for a failed world: the first failing rank's own exception, else a skip."""
    world_size = error.world_size
    failures = list(error.failures) or [(error.rank, error.__cause__ or error)]
    reasons = [(rank, exc, _skip_reason(exc)) for rank, exc in failures]
    failed = [(rank, exc) for rank, exc, reason in reasons if reason is None]
    if failed:
        rank, exc = failed[0]
        exc.__traceback__ = _user_frames(exc.__traceback__)
        exc.add_note(f"(raised on rank {rank} of a {world_size}-rank meshsim world)")
        for other, _, why in reasons:
            if why is not None:
                exc.add_note(f"(rank {other} skipped: {why})")
        return exc
    rank, exc, reason = reasons[0]
    skip = unittest.SkipTest(f"{reason} (rank {rank})")
    skip.__cause__ = exc
    return skip


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without its leading meshsim frames (the world's, the rank's launcher): from the test's code."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(MESHSIM_DIR):
        tb = tb.tb_next
    return tb


def _thread_locals(cls: type) -> tuple[tuple[threading.local, dict[str, Any]], ...]:
    """Every ``threading.local`` the test class and its bases hold, with the caller thread's values.

    torch's test machinery keeps per-test state in class-level thread-locals, filled in the
    thread that defined or set up the class: ``DeviceTypeTestBase._tls`` holds ``precision``
    and ``rel_tol``, which every test that ``instantiate_device_type_tests`` made reads first
    (torch 2.11-2.15). torch's threaded bases give each rank thread those values; so do
    these, for every thread-local found, not a list of attributes.
    """
    found: dict[int, tuple[threading.local, dict[str, Any]]] = {}
    for klass in cls.__mro__:
        for value in vars(klass).values():
            if isinstance(value, threading.local) and id(value) not in found:
                found[id(value)] = (value, dict(value.__dict__))
    return tuple(found.values())


def _run_rank(instances: Sequence[_SimTestCase], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The world's per-rank program: this rank's instance runs the test method."""
    instances[dist.get_rank()]._run_as_rank(args, kwargs)


class _SimTestCase(_TorchTestCase):  # type: ignore[misc]
    """What the public bases share: the launcher, per-rank instances, subtests and outcomes."""

    rank: int = _MAIN_RANK
    _meshsim_log: _RankLog | None = None  # set on a rank's instance only
    _meshsim_test: Callable[..., Any] | None = None  # the original test method, bound
    # the test class's thread-locals and the caller's values of them (see _thread_locals)
    _meshsim_locals: tuple[tuple[threading.local, dict[str, Any]], ...] = ()

    def __init__(self, method_name: str = "runTest", methodName: str = "runTest") -> None:
        # torch's bases take both spellings (testslide passes methodName by keyword)
        if methodName != "runTest":
            method_name = methodName
        super().__init__(method_name)
        test = getattr(self, method_name, None)
        # torch's LocalTensor variants (create_local_tensor_test_class) run once, in the
        # caller, under LocalTensorMode: they keep doing so.
        if test is None or getattr(self, "is_local_tensor_enabled", False):
            return
        self._meshsim_test = test
        setattr(self, method_name, self._launcher(test))

    def _launcher(self, test: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(test)  # keeps unittest's skip and expectedFailure marks
        def run_on_ranks(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True  # pytest: the report starts at the test's code
            self._run_world(args, kwargs)

        return run_on_ranks

    def setUp(self) -> None:
        super().setUp()
        self.rank = _MAIN_RANK

    # -- the caller's side ----------------------------------------------------------

    def _run_world(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        __tracebackhide__ = True
        world_size = self.world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"{type(self).__name__}.world_size must be a positive int, got {world_size!r}")
        thread_locals = _thread_locals(type(self))
        instances = [self._instance_for_rank(rank, thread_locals) for rank in range(world_size)]
        failure: RankError | None = None
        try:
            # gpu_paths=False: torch's own collectives for the mesh's device (all_gather+chunk
            # for Shard->Shard on CPU), which torch's tests count on when there is no GPU
            run_ranks(
                _run_rank,
                world_size,
                args=(instances, args, kwargs),
                timeout=_timeout(),
                gpu_paths=False,
                num_threads=num_threads_from_environment(),
            )
        except RankError as error:
            failure = error
        self._replay_subtests(instances)
        if failure is not None:
            # raised outside the except block: the rank's exception is not "during" the RankError
            raise _surfaced(failure)

    def _instance_for_rank(
        self, rank: int, thread_locals: tuple[tuple[threading.local, dict[str, Any]], ...]
    ) -> _SimTestCase:
        instance = type(self)(self._testMethodName)
        for name, value in vars(self).items():  # what setUp gave the caller's instance
            instance.__dict__.setdefault(name, value)
        instance._meshsim_locals = thread_locals
        instance.rank = rank
        instance._meshsim_log = _RankLog(rank)
        return instance

    def _replay_subtests(self, instances: Sequence[_SimTestCase]) -> None:
        """Report each rank's subtests through unittest's ``subTest``, in rank order."""
        for instance in instances:
            assert instance._meshsim_log is not None
            for subtest in instance._meshsim_log.subtests:
                params = dict(subtest.params)
                params.setdefault("rank", subtest.rank)
                block = (
                    super().subTest(**params)
                    if subtest.message is _NO_MESSAGE
                    else super().subTest(subtest.message, **params)
                )
                with block:
                    if subtest.error is not None:
                        raise subtest.error

    # -- a rank's side ----------------------------------------------------------------

    def _run_as_rank(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._meshsim_test is not None
        for local, values in self._meshsim_locals:  # as the caller's thread sees them
            local.__dict__.clear()  # a pooled rank thread: nothing left from an earlier test
            local.__dict__.update(values)
        self._set_up_rank()
        try:
            self._meshsim_test(*args, **kwargs)
        finally:
            try:
                self._clean_up_rank()
            finally:
                self._tear_down_rank()

    def _set_up_rank(self) -> None:
        """Run on each rank before the test method (``perThreadSetUp`` in MultiThreadedTestCase)."""

    def _tear_down_rank(self) -> None:
        """Run on each rank after the test method, whatever its outcome."""

    def _clean_up_rank(self) -> None:
        """Run the cleanups a rank added (``addCleanup``), last first; raise the first error."""
        # unittest's doCleanups reports through the test's result, which belongs to the
        # caller's thread; a rank runs its own and raises like any rank code.
        errors: list[Exception] = []
        cleanups = self._cleanups
        while cleanups:
            function, args, kwargs = cleanups.pop()
            try:
                function(*args, **kwargs)
            except Exception as error:
                errors.append(error)
        if errors:
            raise errors[0]

    def _handle_test_skip(self, msg: str) -> None:
        """torch's skip helpers (``skip_if_lt_x_gpu``) call this instead of exiting the process."""
        self.skipTest(msg)

    @contextlib.contextmanager
    def subTest(self, msg: Any = _NO_MESSAGE, **params: Any) -> Iterator[None]:
        """unittest's ``subTest``, usable on ranks: see the module's docstring."""
        log = self._meshsim_log
        if log is None:
            with super().subTest(**params) if msg is _NO_MESSAGE else super().subTest(msg, **params):
                yield
            return
        merged = {**(log.open_params[-1] if log.open_params else {}), **params}
        log.open_params.append(merged)
        error: BaseException | None = None
        try:
            yield
        except MeshError:
            raise  # the world has failed: the rank must stop, not carry on to its next subtest
        except _skip_types() as skipped:  # pytest's skip is a BaseException
            error = skipped
        except Exception as failed:
            error = failed
        finally:
            log.open_params.pop()
        log.subtests.append(_Subtest(log.rank, msg, merged, error))


class MultiThreadedTestCase(_SimTestCase):
    """torch's ``MultiThreadedTestCase``: each test method runs on ``world_size`` simulated ranks.

    As in torch, ``self.rank`` is the rank (``MAIN_THREAD_RANK``, -1, in ``setUp``
    and ``tearDown``, which run once, in the caller), each rank has its own
    instance, and ``perThreadSetUp`` / ``perThreadTearDown`` run on every rank
    around the method, the rank's default process group already made. Unlike
    torch's, ranks do not share one RNG (each starts from the caller's state after
    ``setUp``), ``setUp`` need not call ``_spawn_threads``, and a rank's instance
    sees what ``setUp`` set.
    """

    MAIN_THREAD_RANK = _MAIN_RANK

    @property
    def world_size(self) -> int:
        """The number of ranks: torch's ``DEFAULT_WORLD_SIZE`` (4) unless a subclass says."""
        return _DEFAULT_WORLD_SIZE

    def perThreadSetUp(self) -> None:
        """Run on each rank before the test method."""

    def perThreadTearDown(self) -> None:
        """Run on each rank after the test method."""

    def _set_up_rank(self) -> None:
        self.perThreadSetUp()

    def _tear_down_rank(self) -> None:
        self.perThreadTearDown()

    def _spawn_threads(self) -> None:
        """Nothing to do: torch's subclasses call this from ``setUp``; meshsim starts ranks per test."""

    @property
    def _current_test_name(self) -> str:
        return str(self.id().split(".")[-1])

    def assertEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        """``assertEqual(x, y)`` on rank ``rank`` only."""
        if self.rank == rank:
            self.assertEqual(x, y, msg)

    def assertNotEqualOnRank(self, x: Any, y: Any, msg: str | None = None, *, rank: int = 0) -> None:
        """``assertNotEqual(x, y)`` on rank ``rank`` only."""
        if self.rank == rank:
            self.assertNotEqual(x, y, msg)


class DTensorOpTestBase(MultiThreadedTestCase):
    """torch's ``DTensorOpTestBase``: a MultiThreadedTestCase of ``NUM_DEVICES`` ranks on ``DEVICE_TYPE``."""

    @property
    def world_size(self) -> int:
        """torch's ``NUM_DEVICES`` (4, or the GPU count when there are 2 or 3)."""
        return _NUM_DEVICES

    @property
    def device_type(self) -> str:
        """The accelerator's device type when there is one, else ``"cpu"``."""
        return _DEVICE_TYPE

    def build_device_mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` over every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))


class DTensorTestBase(_SimTestCase):
    """torch's ``DTensorTestBase``, on simulated ranks instead of processes.

    ``rank``, ``world_size`` (``NUM_DEVICES``), ``device_type`` (``"cpu"`` unless
    there is an accelerator per rank), ``backend``, ``init_pg``/``destroy_pg`` (used
    by :func:`with_comms`), ``build_device_mesh``, ``_test_op`` and ``run_subtests``
    behave as torch's. Every backend name is served by meshsim's simulated backend,
    and a rank's default process group exists before ``with_comms`` asks for it.
    """

    MAIN_PROCESS_RANK = _MAIN_RANK

    @property
    def world_size(self) -> int:
        """torch's ``NUM_DEVICES`` (4, or the GPU count when there are 2 or 3)."""
        return _NUM_DEVICES

    @property
    def is_local_tensor_enabled(self) -> bool:
        """False: ranks are real (torch's LocalTensor variants, made from these classes, say True)."""
        return False

    @property
    def device_type(self) -> str:
        """The accelerator's type when there is one per rank, else ``"cpu"``."""
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or torch.accelerator.device_count() < self.world_size:
            return "cpu"
        return str(accelerator.type)

    @property
    def backend(self) -> str:
        """The backend torch would pick for ``device_type`` (``"gloo"`` on CPU)."""
        return str(dist.get_default_backend_for_device(self.device_type))

    @property
    def is_master(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0

    @property
    def destroy_pg_upon_exit(self) -> bool:
        """True, as in torch: a rank's groups are torn down when its test ends."""
        return True

    def _current_test_name(self) -> str:
        return str(self.id().split(".")[-1])

    def _spawn_processes(self) -> None:
        """Nothing to do: torch's ``setUp`` spawns processes here; meshsim starts ranks per test."""

    def init_pg(self, eager_init: bool, backend: str | None = None) -> None:
        """Make this rank's default process group (it already has one: this adopts it).

        Args:
            eager_init: torch's flag for NCCL's eager communicator; nothing to do here.
            backend: the backend name torch would use; None: :attr:`backend`.

        Raises:
            unittest.SkipTest: the backend needs an accelerator per rank and there are fewer.
            RuntimeError: a backend name torch's ``DTensorTestBase`` does not accept.
        """
        del eager_init
        backend = self.backend if backend is None else backend
        accepted = {
            "nccl", "gloo", "mpi", "hccl", "xccl", "fake", "cuda:ncclx",
            "cpu:gloo,cuda:ncclx", "cpu:gloo,xpu:xccl",
            f"cpu:gloo,{self.device_type}:{dist.get_default_backend_for_device(self.device_type)}",
        }  # fmt: skip
        needs_devices = any(name in backend for name in common_distributed.ACCELERATOR_DIST_BACKENDS)
        if needs_devices and torch.accelerator.device_count() < self.world_size:
            self.skipTest(f"Need at least {self.world_size} CUDA devices")
        if backend not in accepted:
            raise RuntimeError(f"Backend {backend} not supported!")
        dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size)

    def destroy_pg(self, device_id: int | None = None) -> None:
        """Wait for every rank (a barrier), then destroy this rank's default process group."""
        del device_id
        dist.barrier()
        dist.destroy_process_group()

    def build_device_mesh(self) -> Any:
        """A 1-D ``DeviceMesh`` over every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device_type, (self.world_size,))

    def init_manual_seed_for_rank(self) -> None:
        """Seed torch's RNG with the rank, so that ranks draw different numbers."""
        torch.manual_seed(self.rank)

    def run_subtests(self, *args: Any, **kwargs: Any) -> None:
        """torch's ``run_subtests``: the test function once per combination, each a subtest."""
        common_distributed.run_subtests(self, *args, **kwargs)

    def _test_op(self, mesh: Any, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Check ``op_call`` on every sharding of its tensor arguments against the plain op."""
        expected = op_call(*args, **kwargs)
        converter = common_dtensor.DTensorConverter(mesh, args, kwargs)
        for dist_args, dist_kwargs in converter:
            self.assertEqual(converter.successful(), True)
            self.assertEqual(op_call(*dist_args, **dist_kwargs).full_tensor(), expected)

    def _test_op_on_dtensor(self, op_call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Check ``op_call(dtensors).full_tensor() == op_call(full tensors)``."""
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_flatten, tree_map_only

        def full(value: DTensor) -> torch.Tensor:
            return value.full_tensor().detach().clone()

        full_args = tree_map_only(DTensor, full, args)
        full_kwargs = tree_map_only(DTensor, full, kwargs)
        expected, _ = tree_flatten(op_call(*full_args, **full_kwargs))
        actual, _ = tree_flatten(op_call(*args, **kwargs))
        self.assertEqual(expected, [value.full_tensor() for value in actual])


def with_comms(
    eager_init: Callable[..., Any] | bool = False, backend: str | None = None
) -> Callable[..., Any]:
    """torch's ``with_comms``: the test runs between ``self.init_pg()`` and ``self.destroy_pg()``.

    Use bare (``@with_comms``) or called (``@with_comms(eager_init=True,
    backend="gloo")``). On a class without ``init_pg`` (DTensorOpTestBase) the test
    just runs. When the test raises, the rank's default group is destroyed without
    the closing barrier, and the exception goes on.

    Args:
        eager_init: the test function (bare use), or torch's eager-init flag.
        backend: the backend name passed to ``init_pg``.

    Returns:
        the wrapped test, or a decorator that wraps one.
    """
    if callable(eager_init):
        return _comms_wrapper(eager_init, eager_init=False, backend=None)
    flag = eager_init
    return lambda test: _comms_wrapper(test, eager_init=flag, backend=backend)


def _comms_wrapper(test: Callable[..., Any], *, eager_init: bool, backend: str | None) -> Callable[..., None]:
    @functools.wraps(test)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        if not hasattr(self, "init_pg"):
            test(self, *args, **kwargs)
            return
        self.init_pg(eager_init, backend)
        try:
            test(self, *args, **kwargs)
        except Exception:
            dist.destroy_process_group()
            raise
        self.destroy_pg()

    return wrapper
