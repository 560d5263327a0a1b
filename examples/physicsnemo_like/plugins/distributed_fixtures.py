"""Session-scoped meshes, built through the manager once per process (per rank)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from manager import Manager


@pytest.fixture(scope="session")
def distributed_mesh() -> Iterator[Any]:
    yield Manager().initialize_mesh((-1,), ("domain",))


@pytest.fixture(scope="session")
def distributed_mesh_2d() -> Iterator[Any]:
    manager = Manager()
    yield manager.initialize_mesh((-1, manager.world_size // 2), ("axis1", "axis2"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    Manager.cleanup()
