"""The plugin tests' one way to start an inner pytest session under torchrun."""

from __future__ import annotations

import sys

import pytest


def torchrun_pytest(
    pytester: pytest.Pytester, *args: str, nproc: int = 2, timeout: float = 300
) -> pytest.RunResult:
    """``torchrun --standalone --nproc_per_node=NPROC -m pytest --multigpu-static ARGS``.

    It runs in pytester's directory; ``timeout`` bounds the whole job (pytester kills it and
    fails the test past it).
    """
    return pytester.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--multigpu-static",
        *args,
        timeout=timeout,
    )
