"""Stopping rank threads that still run user code after their world failed.

A rank blocked in a collective leaves when its world aborts; one running its own
code (a loop, a slow computation) is interrupted: :class:`WorldAborted` is raised
in its thread asynchronously (``PyThreadState_SetAsyncExc``, through ctypes), at a
point where that is safe.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from typing import Any

from meshsim._base import MESHSIM_DIR
from meshsim._base.errors import WorldAborted

__all__ = ["interrupt"]


def interrupt(idents: Sequence[int], done: set[int]) -> None:
    """Raise :class:`WorldAborted` once in each rank thread that is at a safe point.

    An exception raised asynchronously inside an import corrupts the module's
    import lock (every later importer of that module then blocks forever), and
    one raised inside meshsim's own machinery or a second time during clean-up
    would break the clean-up: so only once, and only in user or torch code. One
    that Python swallowed (it landed in a ``__del__`` or a gc or weakref callback)
    is reported by meshsim's unraisable hook and leaves ``done``: it is raised again.
    """
    frames = sys._current_frames()
    try:
        for ident in idents:
            if ident in done or not _safe_point(frames.get(ident)):
                continue
            done.add(ident)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(WorldAborted))
    finally:
        # The map holds this very frame, whose locals hold the map: a cycle that kept
        # every rank's frames (and on gloo, their groups' sockets) alive until a gc.
        frames.clear()


def _safe_point(frame: Any) -> bool:
    if frame is None or frame.f_code.co_filename.startswith(MESHSIM_DIR):
        return False
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib") or f"{os.sep}importlib{os.sep}" in name:
            return False
        frame = frame.f_back
    return True
