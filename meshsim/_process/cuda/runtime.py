"""The real CUDA runtime's entries torch's own Python reaches under emulation, answered by the emulation.

On PyPI's CUDA build of torch with no GPU (``pip install torch`` on most laptops; every
torch 2.14+ wheel there) these functions exist and call the CUDA driver, which fails
(``CUDA driver version is insufficient for CUDA runtime version``). On the CPU build
they are stubs or absent, so the same program passed there (issue 38). Each entry
below names who reaches it; the list was made by running the emulation's tests,
``torch.compile`` (Dynamo, AOTAutograd, Inductor with its modes) and flex attention
on torch 2.14.1 (CUDA 13 build, no GPU) and 2.13.0+cpu.

``torch.cuda``'s own stand-ins (device count, current device, properties, streams,
memory, RNG) are in :mod:`.api`; these are the entries below them.
"""

from __future__ import annotations

from typing import Any

import torch

from meshsim._process.cuda.spec import Spec

__all__ = ["patches"]


def _not_capturing() -> bool:
    return False


def patches(spec: Spec) -> list[tuple[Any, str, Any]]:
    """Entries of the real runtime torch's Python calls while emulated, as (owner, name, value).

    With CUDA storage (``cuda:N``) there is a real GPU to answer: nothing to change.
    """
    if spec.storage.type != "cpu":
        return []
    import torch.cuda.graphs as graphs

    return [
        # Dynamo's trace_frame asks before every compile (torch 2.14.1
        # convert_frame.trace_frame), as do nn.functional's batch norm helpers
        # (torch/nn/modules/_functions.py) and torch.cuda.memory: no capture is under way.
        (torch.cuda, "is_current_stream_capturing", _not_capturing),
        (graphs, "is_current_stream_capturing", _not_capturing),
    ]
