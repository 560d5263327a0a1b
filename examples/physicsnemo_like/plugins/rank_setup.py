"""A plugin whose pytest_configure must run once in every process (every rank)."""

from __future__ import annotations

import pytest
from manager import Manager


def pytest_configure(config: pytest.Config) -> None:
    Manager().configured += 1
