"""Where a collective was called from: the user's line, and the library line that made the call.

Ledger entries, mismatch tables and timeouts name the user's line that issued a
call (``file.py:LINE in function``): the first frame outside torch, meshsim,
shardtensor, the standard library and the folders declared library code with
:func:`library_code` (upstream PhysicsNeMo, for its users). When a library made the
call for the user (``ShardTensor.from_local`` gathering shapes), the ledger keeps
that library's own line too, as the entry's ``via``.

Formatting a frame costs microseconds, so callers keep the frame and format it only
when the text is needed (see :class:`meshsim._sim.rendezvous.Call`); texts are
cached per code line.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch

from meshsim._base import MESHSIM_DIR

__all__ = [
    "ENVIRONMENT",
    "call_site",
    "call_where",
    "library_code",
    "made_by_torch",
    "site_of",
    "user_frame",
    "where_of",
]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
# shardtensor ships beside meshsim; it is a library to its users (found without importing it)
_SHARDTENSOR_DIR = os.path.join(os.path.dirname(MESHSIM_DIR.rstrip(os.sep)), "shardtensor") + os.sep
# Decorator shims that sit between user code and torch (torch's @deprecated).
_SHIMS = ("typing_extensions.py",)

ENVIRONMENT = "MESHSIM_LIBRARY"
_libraries: list[str] = [_SHARDTENSOR_DIR]  # folders whose frames are a library's, not the user's
_internal: dict[str, bool] = {}  # per file name: torch, meshsim, the stdlib
_library: dict[str, bool] = {}  # per file name: under one of _libraries
_texts: dict[tuple[object, int, bool], str] = {}


def _is_internal(filename: str) -> bool:
    known = _internal.get(filename)
    if known is None:
        path = os.path.abspath(filename)
        known = (
            path.startswith((_TORCH_DIR, MESHSIM_DIR))
            or (path.startswith(_STDLIB_DIR) and "site-packages" not in path)
            or filename.startswith("<frozen")
            or os.path.basename(path) in _SHIMS
        )
        _internal[filename] = known
    return known


def _is_library(filename: str) -> bool:
    known = _library.get(filename)
    if known is None:
        known = _library[filename] = os.path.abspath(filename).startswith(tuple(_libraries))
    return known


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame, walking outward from ``frame``, outside torch, meshsim, the stdlib and libraries."""
    while frame is not None and (
        _is_internal(frame.f_code.co_filename) or _is_library(frame.f_code.co_filename)
    ):
        frame = frame.f_back
    return frame


def _text(frame: FrameType, *, folder: bool = False) -> str:
    code = frame.f_code
    key = (code, frame.f_lineno, folder)
    text = _texts.get(key)
    if text is None:
        name = os.path.basename(code.co_filename)
        if folder:  # a library's line names its package folder: shardtensor/_collectives.py
            name = os.path.join(os.path.basename(os.path.dirname(code.co_filename)), name)
        text = f"{name}:{frame.f_lineno} in {code.co_name}"
        if len(_texts) < 100_000:  # bounded: generated code could make endless keys
            _texts[key] = text
    return text


def where_of(frame: FrameType | None) -> tuple[str, str | None]:
    """The user's line and the library line that made the call (None: the user called directly).

    Walks outward from ``frame``. Where every frame is a library's or internal, the
    site is the library's line and there is no ``via``.
    """
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "<unknown>", None
    if not _is_library(frame.f_code.co_filename):
        return _text(frame), None
    user = user_frame(frame)
    if user is None:
        return _text(frame, folder=True), None
    return _text(user), _text(frame, folder=True)


def site_of(frame: FrameType | None) -> str:
    """``file.py:LINE in function`` of the user's line, from ``frame`` out (see :func:`where_of`)."""
    return where_of(frame)[0]


def call_site(depth: int = 1) -> str:
    """``file.py:LINE in function`` of the first caller outside torch, meshsim and libraries."""
    return where_of(sys._getframe(depth))[0]


def call_where(depth: int = 1) -> tuple[str, str | None]:
    """:func:`where_of` the caller ``depth`` frames up."""
    return where_of(sys._getframe(depth))


# torch's own modules whose collectives are made by design, not asked for call by call:
# DDP's and FSDP's parameter sync and gradient reductions, tensor parallelism's parameter
# distribution, pipeline schedules, checkpointing, ZeRO (paths below torch/; torch 2.11-2.15).
_BY_DESIGN = tuple(
    part.replace("/", os.sep)
    for part in (
        "nn/parallel/",
        "distributed/fsdp/",
        "distributed/_composable/",
        "distributed/algorithms/",
        "distributed/utils.py",
        "distributed/tensor/parallel/",
        "distributed/pipelining/",
        "distributed/checkpoint/",
        "distributed/optim/",
    )
)
_made_by: dict[str, str | None] = {}
_AUTOGRAD_DIR = os.path.join(_TORCH_DIR, "autograd") + os.sep


def _torch_module(filename: str) -> str | None:
    known = _made_by.get(filename, "")
    if known == "":
        path = os.path.abspath(filename)
        known = None
        if path.startswith(_TORCH_DIR) and path[len(_TORCH_DIR) :].startswith(_BY_DESIGN):
            relative = path[len(_TORCH_DIR) :].removesuffix(".py").removesuffix(os.sep + "__init__")
            known = "torch." + relative.replace(os.sep, ".")
        _made_by[filename] = known
    return known


def made_by_torch(frame: FrameType | None) -> str | None:
    """The torch module that made the call by design (``torch.nn.parallel.distributed``), or None.

    Walks outward from ``frame`` to the user's line: a call that passed through one of
    torch's parallelism modules (DDP, FSDP, tensor parallelism's set-up, pipelining,
    checkpointing) is theirs, not the user's; DTensor's and the collectives' own modules
    do what the user asked, call by call.
    """
    made = None  # the outermost such module: DDP's constructor, not the helper it calls
    first_torch = True
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            break
        if first_torch and filename.startswith(_TORCH_DIR):
            first_torch = False
            if filename.startswith(_AUTOGRAD_DIR):
                # issued from C++ inside a backward pass, with no Python collective call in
                # between: DDP's reducer (torch 2.11-2.15 has no other C++ caller)
                return "torch.nn.parallel.distributed (its C++ gradient reducer)"
        made = _torch_module(filename) or made
        frame = frame.f_back
    return made


def _folder_of(name: str) -> str:
    """A folder path as given, or an importable module's folder (a package) or file."""
    if os.sep in name or os.path.isdir(name):
        if not os.path.exists(name):
            raise ValueError(f"library_code: {name!r} is neither an existing folder nor a module name")
        return os.path.abspath(name).rstrip(os.sep) + os.sep
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"library_code: module {name!r} cannot be found ({exc})") from None
    if spec is None or (spec.origin is None and not spec.submodule_search_locations):
        raise ValueError(
            f"library_code: no module named {name!r} is importable here; give a module "
            "name (e.g. 'physicsnemo') or a folder path"
        )
    if spec.submodule_search_locations:
        return os.path.abspath(next(iter(spec.submodule_search_locations))).rstrip(os.sep) + os.sep
    return os.path.abspath(str(spec.origin))


@contextmanager
def library_code(*names: str) -> Iterator[list[str]]:
    """Count these modules' (or folders') frames as library code while the block runs.

    Ledger sites then name the first caller outside them, as they do for shardtensor,
    and keep the library's own line as the entry's ``via``: upstream PhysicsNeMo's
    ``ShardTensor`` counts as a library for the tests of its users with
    ``library_code("physicsnemo")`` (or the plugin's ``--mesh-library`` / ``mesh_library``).

    Args:
        names: module names (``"physicsnemo"``, ``"physicsnemo.distributed"``: found
            without importing them) or folder paths.

    Returns:
        a context manager; it yields the folders of the names given.

    Raises:
        ValueError: a name that is neither an importable module nor an existing folder.
    """
    folders = [_folder_of(name) for name in names]
    added = [f for f in folders if f not in _libraries]
    _libraries.extend(added)
    _library.clear()  # per file answers; the texts stay right (they name lines, not kinds)
    # the hand-off to processes started meanwhile (spawned ranks, torchrun's): they read it at import
    before = os.environ.get(ENVIRONMENT)
    os.environ[ENVIRONMENT] = os.pathsep.join(_libraries[1:])
    try:
        yield folders
    finally:
        for folder in added:
            _libraries.remove(folder)
        _library.clear()
        if before is None:
            os.environ.pop(ENVIRONMENT, None)
        else:
            os.environ[ENVIRONMENT] = before


def _from_environment() -> None:
    """The folders a parent process declared (``MESHSIM_LIBRARY``, os.pathsep-separated)."""
    for name in filter(None, os.environ.get(ENVIRONMENT, "").split(os.pathsep)):
        try:
            folder = _folder_of(name)
        except ValueError as exc:
            warnings.warn(f"{ENVIRONMENT}: {exc}; ignored", RuntimeWarning, stacklevel=2)
            continue
        if folder not in _libraries:
            _libraries.append(folder)


_from_environment()
