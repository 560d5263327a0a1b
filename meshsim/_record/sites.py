"""Where a collective was called from: the first frame outside torch, meshsim and the standard library.

Ledger entries, mismatch tables and timeouts name the user's line that issued a
call (``file.py:LINE in function``). Formatting a frame costs microseconds, so
callers keep the frame and format it only when the text is needed (see
:class:`meshsim._sim.rendezvous.Call`); texts are cached per code line.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

import torch

from meshsim._base import MESHSIM_DIR

__all__ = ["call_site", "site_of", "user_frame"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
# Decorator shims that sit between user code and torch (torch's @deprecated).
_SHIMS = ("typing_extensions.py",)
_internal: dict[str, bool] = {}


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


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame, walking outward from ``frame``, outside torch, meshsim and the stdlib."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


_sites: dict[tuple[object, int], str] = {}


def call_site(depth: int = 1) -> str:
    """``file.py:LINE in function`` of the first caller outside torch and meshsim."""
    return site_of(sys._getframe(depth))


def site_of(frame: FrameType | None) -> str:
    """``file.py:LINE in function`` of the first frame outside torch and meshsim, from ``frame`` out."""
    frame = user_frame(frame)
    if frame is None:
        return "<unknown>"
    code = frame.f_code
    key = (code, frame.f_lineno)
    site = _sites.get(key)
    if site is None:
        site = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        if len(_sites) < 100_000:  # bounded: generated code could make endless keys
            _sites[key] = site
    return site
