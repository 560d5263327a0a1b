"""Shaped like PhysicsNeMo's test/conftest.py: its own suite options, markers and set-up."""

from __future__ import annotations

import pytest

try:  # the manager's state is per rank on simulated ranks (torchrun needs nothing)
    from manager import Manager

    import meshsim

    meshsim.per_rank(Manager, "_shared_state", fresh=dict)
except ImportError:
    pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--multigpu-dynamic", action="store_true", default=False, help="dynamic suite")
    parser.addoption("--multigpu-static", action="store_true", default=False, help="static suite")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multigpu_dynamic: starts its own processes")
    config.addinivalue_line("markers", "multigpu_static: runs under torchrun")
    if config.getoption("--multigpu-static"):
        from manager import Manager

        Manager.initialize()
        config.pluginmanager.register(__import__("plugins.rank_setup", fromlist=[""]), name="rank_setup")
        config.pluginmanager.register(
            __import__("plugins.distributed_fixtures", fromlist=[""]), name="distributed_fixtures"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    static = config.getoption("--multigpu-static")
    dynamic = config.getoption("--multigpu-dynamic")
    if static and dynamic:
        raise pytest.UsageError("give --multigpu-static or --multigpu-dynamic, not both")
    for item in items:
        if static and "multigpu_static" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="not a static test"))
        elif dynamic and "multigpu_dynamic" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="not a dynamic test"))
        elif not static and not dynamic and "multigpu_static" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs --multigpu-static"))
