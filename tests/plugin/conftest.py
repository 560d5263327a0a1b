"""The plugin's own tests run pytest inside pytest and match its output line by line."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _inner_sessions_keep_their_order(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest-randomly, where installed, would shuffle the inner sessions' tests too (it
    # registers itself through its entry point): their output is matched in order.
    # Set after pytester is made: it clears PYTEST_ADDOPTS for its sessions.
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{os.environ.get('PYTEST_ADDOPTS', '')} -p no:randomly".strip())
