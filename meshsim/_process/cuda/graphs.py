"""CUDA graphs under emulation: a capture records the ops it ran, a replay runs them again on its tensors.

The emulated "H100" makes frameworks turn CUDA graphs on (``torch.cuda.graph``,
``torch.cuda.CUDAGraph``, ``torch.cuda.make_graphed_callables``, and
``torch.cuda.is_current_stream_capturing`` to ask whether a capture is underway);
torch's own versions reach the real CUDA runtime. Here a graph is a recording:

- **Capture** runs the block eagerly, as without a graph, while the thread's dispatch
  mode (:class:`meshsim._process.cuda.tensors.CudaMode`, whose ``capture`` is the
  :class:`Capture` being recorded) notes every aten op: the op, the tensors and values
  it was called with, and the tensors it made. Those are the graph's static tensors;
  the recording keeps them alive, as a graph's memory pool does.
- **A capture changes nothing that existed before it**, as on CUDA, where a capture
  launches no kernel: before an op first writes a tensor the capture did not make (a
  parameter, an accumulated gradient, an optimizer's state, a buffer an in-place
  collective reduces), its values are saved, and the capture's end puts them back; the
  offsets of the CUDA generators it drew from are put back too. Without this, code that
  captures a step and then replays it (Megatron's ``FullCudaGraphWrapper``, torch's
  whole-network recipe) ran that step twice: gradients accumulated into a static
  buffer were doubled. Tensors the capture made keep the values the eager pass gave
  them (on CUDA they hold garbage until the first replay).
- **Replay** runs the recorded ops again in order, on the same tensors (so new
  values copied into a static input are read) under ``no_grad``: an op that writes
  its arguments (``add_``, ``out=``, an optimizer's ``_foreach_*_``, ``copy_``) writes
  them again; an op that made a tensor makes it afresh and its values are copied into
  the tensor the capture made (whatever holds that tensor, a later op or the caller's
  static output, sees the new values); a view is not rerun (it already shares its
  base's storage). Random ops draw again from the generator state they drew from at the
  capture (Megatron's RNG tracker swaps states in with ``graphsafe_set_state`` around
  the ops it captures), moving its offset, as a registered generator's Philox offset
  moves at every replay.
- **Collectives** inside a capture run at the capture (so the ranks' captures agree
  and the block's outputs have values) and again at every replay, each run entering
  the ledger: NCCL's captured collectives are replayed by ``replay()`` too (NCCL sends
  nothing at capture; the emulation's one extra run is the capture's eager pass).
  Functional collectives are waited for at replay before their results are copied.

So captured and replayed code gives the results eager code gives. Not emulated: the
speed, memory pools shared between graphs (each graph keeps its own tensors), and
work the mode does not see (compiled kernels, which run with the mode off).

torch names replaced, checked in torch 2.13: ``torch.cuda.CUDAGraph``, ``graph``,
``graph_pool_handle``, ``is_current_stream_capturing``, and the same names in
``torch.cuda.graphs`` (``make_graphed_callables`` calls ``graph_pool_handle`` there).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

import torch

from meshsim._base.context import current
from meshsim._process.cuda.rank import Generator, now

__all__ = [
    "CUDAGraph",
    "Capture",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "note_call",
    "note_writes",
    "patches",
]

_HERE = current()  # one object; its fields (``cuda``: the thread's CudaMode) are per thread
_REAL_DATA: Any = torch._C.TensorBase.data
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_pools = itertools.count(1)

# One recorded op: (op, args, kwargs as the op was called, what it returned)
Step = tuple[Any, tuple[Any, ...], dict[str, Any], Any]
_CALL = object()  # a step that is a call to run again, not an op: (_CALL, (fn,), {}, None)


class Drawn:
    """A random op as a capture ran it: the op and the generator state it drew from."""

    __slots__ = ("func", "index", "shared")

    def __init__(self, func: Any, index: int, shared: object) -> None:
        self.func = func
        self.index = index  # the device whose generator drew
        self.shared = shared

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with now().generator(self.index).drawing_from(self.shared):
            return self.func(*args, **kwargs)

    def __str__(self) -> str:
        return str(self.func)


class Capture:
    """A capture underway in a thread: its steps, and what it must put back when it ends.

    Attributes:
        steps: what a replay runs, in order: (op, args, kwargs, what it returned).
    """

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._made: set[int] = set()  # storages of the tensors the capture made
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, its values before)
        self._offsets: dict[int, tuple[Any, int]] = {}  # id -> (generator state, offset before)

    def record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Add a step; the tensors ``func`` made are the capture's own from now on."""
        self.steps.append((func, args, kwargs, out))
        _, fresh = _how_to_replay(func.func if isinstance(func, Drawn) else func)
        for is_fresh, value in zip(fresh, out if isinstance(out, (list, tuple)) else (out,)):
            if is_fresh:
                for tensor in _tensors(value):
                    key = _storage_of(tensor)
                    if key is not None:
                        self._made.add(key)

    def drawing(self, func: Any, index: int) -> Drawn:
        """A random op about to draw from device ``index``'s generator: the step to record for it.

        The state it draws from now is noted, and its offset put back when the capture ends.
        """
        shared = now().generator(index).shared()
        if id(shared) not in self._offsets:
            self._offsets[id(shared)] = (shared, now().generator(index).offset)
        return Drawn(func, index, shared)

    def before_write(self, mode: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Save what ``func`` is about to write among the tensors that existed before the capture."""
        written = _written(func, args, kwargs)
        if not written:
            return
        mode.capture = None  # the copies are not part of the graph
        try:
            for tensor in written:
                if id(tensor) in self._saved:
                    continue
                key = _storage_of(tensor)
                if key is None or key in self._made:
                    continue  # empty, made by the capture, or a wrapper (its inner tensors are written)
                self._saved[id(tensor)] = (tensor, _REAL_DATA.__get__(tensor).clone())
        finally:
            mode.capture = self

    def undo(self) -> None:
        """Put back what the capture wrote (latest first, so overlapping views end as before)."""
        with torch.no_grad():
            for tensor, before in reversed(list(self._saved.values())):
                _REAL_DATA.__get__(tensor).copy_(before)
        for shared, offset in self._offsets.values():
            shared.offset = offset
        self._saved.clear()
        self._offsets.clear()


def _storage_of(tensor: torch.Tensor) -> int | None:
    """Where a tensor's bytes are (None: no bytes, or a wrapper subclass that has no storage)."""
    if not tensor.numel():
        return None
    try:
        return int(tensor.untyped_storage().data_ptr())
    except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
        return None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


# op -> (positions, names) of the arguments it writes
_writes: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    where = _writes.get(func)
    if where is None:
        schema = func._schema
        marked = [
            (i, a)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        where = _writes[func] = (
            tuple(i for i, a in marked if not a.kwarg_only),
            tuple(a.name for _, a in marked),
        )
    positions, names = where
    found: list[torch.Tensor] = []
    for i in positions:
        if i < len(args):
            found += _tensors(args[i])
    for name in names:
        if name in kwargs:
            found += _tensors(kwargs[name])
    return found


def note_writes(func: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """In a capture, save the values of the tensors ``func`` is about to write (see :class:`Capture`).

    For ops that run beneath the dispatch mode that records the capture: meshsim's
    backend runs an in-place collective's writes itself (:mod:`meshsim._sim.dispatch`).
    """
    mode = _HERE.cuda
    if mode is not None and mode.capture is not None:
        mode.capture.before_write(mode, func, args, kwargs)


def note_call(fn: Callable[[], Any]) -> None:
    """In a capture, record that replay must call ``fn()`` (and wait for the Work it returns).

    meshsim's backend runs a collective in Python, beneath the dispatcher op the modes
    see (:mod:`meshsim._sim.dispatch`); that op cannot run alone, so the collective's
    own call is what a replay runs again. The op seen around it is then not recorded.
    """
    mode = _HERE.cuda
    if mode is not None and mode.capture is not None:
        mode.capture.steps.append((_CALL, (fn,), {}, None))


def is_current_stream_capturing() -> bool:
    """Whether the calling thread is capturing a graph (``torch.cuda.is_current_stream_capturing``)."""
    mode = _HERE.cuda
    return mode is not None and mode.capture is not None


def graph_pool_handle() -> tuple[int, int]:
    """A new memory pool's token; graphs that share one share nothing here (each keeps its own tensors)."""
    return (next(_pools), 0)


class CUDAGraph:
    """``torch.cuda.CUDAGraph``: the ops a capture ran, run again by :meth:`replay` (see the module doc)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph = keep_graph
        self._steps: list[Step] | None = None  # None until a capture ends
        self._recording: Capture | None = None
        self._pool = graph_pool_handle()
        self._debug = False

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global", check_input_liveness: bool = False
    ) -> None:
        """Start recording the calling thread's ops into this graph.

        Raises:
            RuntimeError: the thread does not emulate CUDA, it captures already, or this
                graph holds a capture (``reset()`` it first).
        """
        mode = _HERE.cuda
        if mode is None:
            raise RuntimeError(
                "CUDAGraph.capture_begin() in a thread that does not emulate CUDA: capture in the rank "
                "(or the pytest process) that runs with meshsim's CUDA emulation"
            )
        if mode.capture is not None:
            raise RuntimeError(
                "CUDAGraph.capture_begin(): this thread is capturing a graph already (one capture at a "
                "time per stream); end it with capture_end() first"
            )
        if self._steps is not None or self._recording is not None:
            raise RuntimeError("CUDAGraph.capture_begin(): this graph was captured already; reset() it first")
        if pool is not None:
            self._pool = pool
        self._recording = mode.capture = Capture()

    def capture_end(self) -> None:
        """Stop recording, put back what the capture changed; the graph can be replayed from now on.

        Raises:
            RuntimeError: this graph is not being captured in the calling thread.
        """
        mode = _HERE.cuda
        if mode is None or self._recording is None or mode.capture is not self._recording:
            raise RuntimeError("CUDAGraph.capture_end() without capture_begin() on this graph in this thread")
        mode.capture = None
        recording, self._recording = self._recording, None
        recording.undo()  # a capture launches nothing: what existed before it is as it was
        self._steps = recording.steps

    def instantiate(self) -> None:
        """Nothing to build: the recording is the graph."""

    def register_generator_state(self, state: Any) -> None:
        """Accept a CUDA generator (or its ``graphsafe_get_state()``) whose offset replays advance.

        A replay reruns the captured random ops, each drawing from its generator's state as
        it stands then, so every generator a graph draws from moves on at each replay, as a
        registered one does on CUDA.

        Raises:
            TypeError: ``state`` is not an emulated CUDA generator.
        """
        if not isinstance(state, Generator):
            raise TypeError(
                "CUDAGraph.register_generator_state() takes a CUDA generator "
                f"(torch.cuda.default_generators[i], or its graphsafe_get_state()), got {state!r}"
            )

    def replay(self) -> None:
        """Run the captured ops again on the graph's tensors.

        Raises:
            RuntimeError: the graph was never captured (or was reset).
        """
        if self._steps is None:
            raise RuntimeError("CUDAGraph.replay() of a graph that holds no capture: capture it first")
        replay(self._steps)

    def reset(self) -> None:
        """Forget the capture and the tensors it kept."""
        self._steps = self._recording = None

    def pool(self) -> Any:
        return self._pool

    def enable_debug_mode(self) -> None:
        self._debug = True

    def debug_dump(self, debug_path: str) -> None:
        """Write the recorded ops, one a line (a real graph writes a DOT file of its kernels)."""
        if not self._debug:
            raise RuntimeError("CUDAGraph.debug_dump() needs enable_debug_mode() before the capture")
        with open(os.fspath(debug_path), "w") as out:
            for func, args, *_ in self._steps or ():
                out.write(f"{args[0] if func is _CALL else func}\n")

    def raw_cuda_graph(self) -> int:
        raise RuntimeError("meshsim emulates CUDA graphs: there is no cudaGraph_t to hand out")

    def raw_cuda_graph_exec(self) -> int:
        raise RuntimeError("meshsim emulates CUDA graphs: there is no cudaGraphExec_t to hand out")

    def __repr__(self) -> str:
        ops = "not captured" if self._steps is None else f"{len(self._steps)} ops"
        return f"<torch.cuda.CUDAGraph (meshsim, emulated): {ops}>"


class graph:  # torch's name
    """``torch.cuda.graph``: capture the block into ``cuda_graph`` on a side stream (torch's signature)."""

    default_capture_stream: Any = None

    def __init__(
        self,
        cuda_graph: CUDAGraph,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        enable_annotations: bool = False,
        check_input_liveness: bool = False,
    ) -> None:
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"torch.cuda.graph() takes a torch.cuda.CUDAGraph, got {cuda_graph!r}")
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        # the emulation's Stream and stream(), which mypy knows as torch's untyped ones
        self.capture_stream = stream if stream is not None else torch.cuda.Stream()  # type: ignore[no-untyped-call]
        self.stream_ctx: Any = torch.cuda.stream(self.capture_stream)

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        self.stream_ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            self.stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.cuda_graph.capture_end()
        finally:
            self.stream_ctx.__exit__(*exc_info)


# -- replay ---------------------------------------------------------------------------------

# op -> (rerun at replay, which results to copy into the captured ones)
_replays: dict[Any, tuple[bool, tuple[bool, ...]]] = {}


def _how_to_replay(func: Any) -> tuple[bool, tuple[bool, ...]]:
    how = _replays.get(func)
    if how is None:
        schema = func._schema
        returns = tuple(r.alias_info is None for r in schema.returns)  # made afresh: copied
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        # a pure view shares storage with what it views: nothing to run again
        rerun = func is not _WAIT_TENSOR and (writes or any(returns) or not schema.returns)
        how = _replays[func] = (rerun, returns)
    return how


def replay(steps: list[Step]) -> None:
    """Run ``steps`` again in order, writing what each makes into what the capture made."""
    with torch.no_grad():
        for func, args, kwargs, captured in steps:
            if func is _CALL:
                _write(None, args[0](), func)  # a collective: run, and wait for its Work
                continue
            rerun, fresh = _how_to_replay(func.func if isinstance(func, Drawn) else func)
            if not rerun:
                continue
            made = func(*args, **kwargs)
            if not isinstance(func, Drawn) and func.namespace == "_c10d_functional":
                made = _waited(made)
            if len(fresh) == 1:
                if fresh[0]:
                    _write(captured, made, func)
            else:
                for is_fresh, old, new in zip(fresh, captured or (), made or ()):
                    if is_fresh:
                        _write(old, new, func)


def _waited(made: Any) -> Any:
    if isinstance(made, torch.Tensor):
        return _WAIT_TENSOR(made)
    if isinstance(made, (list, tuple)):
        return type(made)(_waited(item) for item in made)
    return made


def _write(old: Any, new: Any, func: Any) -> None:
    """Put ``new``'s values into ``old`` (the captured result), in place; wait for a collective's Work."""
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if old is new or (old.numel() and old.data_ptr() == new.data_ptr()):
            return
        if old.shape != new.shape:
            raise RuntimeError(
                f"CUDA graph replay: {func} made a tensor of shape {tuple(new.shape)}, but the capture's was "
                f"{tuple(old.shape)}; a graph cannot hold ops whose shapes depend on values"
            )
        _REAL_DATA.__get__(old).copy_(new)  # .data: no version bump on a tensor autograd saved
    elif isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        for a, b in zip(old, new):
            _write(a, b, func)
    elif hasattr(new, "wait") and not isinstance(new, torch.Tensor):
        new.wait()  # a collective's Work: replay is stream-ordered, so it is done before what follows


def patches() -> list[tuple[Any, str, Any]]:
    """What graphs change process-wide, as (owner, name, value)."""
    import torch.cuda.graphs as graphs

    names: dict[str, Callable[..., Any] | type] = {
        "CUDAGraph": CUDAGraph,
        "graph": graph,
        "graph_pool_handle": graph_pool_handle,
        "is_current_stream_capturing": is_current_stream_capturing,
    }
    return [(owner, name, value) for owner in (torch.cuda, graphs) for name, value in names.items()]
