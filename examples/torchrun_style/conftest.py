"""The conftest of a suite launched as ``torchrun -m pytest``: it marks nothing."""

from __future__ import annotations

import pytest
import torch.distributed as dist


def pytest_configure(config: pytest.Config) -> None:
    # Under torchrun each process makes its group; simulated ranks have theirs (adopted).
    if not dist.is_initialized():
        dist.init_process_group("gloo")


@pytest.fixture(scope="session")
def session_rank() -> int:
    """Set up once per process: on simulated ranks, once per rank."""
    return dist.get_rank()
