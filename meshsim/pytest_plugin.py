"""pytest plugin: run one test body on N ranks, simulated or real (the ``pytest11`` entry point).

Registered through the ``pytest11`` entry point, so any project that installs
meshsim has it. Each feature is a plugin of its own, in :mod:`meshsim._pytest`:

- :mod:`~meshsim._pytest.options`: the options, the ``world`` / ``multigpu_static``
  markers, which tests ``--multigpu-static`` / ``--multigpu-dynamic`` select;
- :mod:`~meshsim._pytest.ranks`: a distributed test's body on its ranks;
- :mod:`~meshsim._pytest.fixtures`: per-rank fixtures, meshsim's and the user's;
- :mod:`~meshsim._pytest.static`: the simulated static suite (one job for the session);
- :mod:`~meshsim._pytest.torchrun_style`: torchrun-style suites on it (``--mesh-unmarked=ranks``,
  ``--mesh-per-rank-modules``);
- :mod:`~meshsim._pytest.launch`: torchrun's ranks, and ``--mesh-backend=spawn``'s launch;
- :mod:`~meshsim._pytest.snapshots`: ledger snapshots;
- :mod:`~meshsim._pytest.cost`: each test's estimated GPU communication time (``--mesh-cost``);
- :mod:`~meshsim._pytest.findings`: the wasted-collectives report (``--mesh-redundant``);
- :mod:`~meshsim._pytest.traces`: timelines per test (``--mesh-trace``);
- :mod:`~meshsim._pytest.cuda`: GPU code without a GPU (``--mesh-cuda``).

Their shared state is one object in ``config.stash`` (:mod:`meshsim._pytest.state`).
The plugins import torch lazily: collecting a project that never uses it costs nothing.
"""

from __future__ import annotations

import importlib

import pytest

__all__: list[str] = []

# Registered in this order; pytest calls a hook's implementations of equal priority
# last-registered first, so options configure first and the static suite's job
# starts after the findings' and traces' settings are made.
PLUGINS = (
    "meshsim._pytest.launch",
    "meshsim._pytest.torchrun_style",
    "meshsim._pytest.static",
    "meshsim._pytest.snapshots",
    "meshsim._pytest.cost",
    "meshsim._pytest.traces",
    "meshsim._pytest.findings",
    "meshsim._pytest.ranks",
    "meshsim._pytest.fixtures",
    "meshsim._pytest.options",
    "meshsim._pytest.cuda",
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Register meshsim's feature plugins, once, as pytest registers this module.

    Not through ``pytest_plugins``: pytest's ``import_plugin`` marks each module
    named there for assertion rewriting just before importing it
    (``rewrite_hook.mark_rewrite(name)``), and ``mark_rewrite`` warns
    ``PytestAssertRewriteWarning: Module already imported so cannot be rewritten``
    for a module already in ``sys.modules`` that its own import hook did not load.
    The feature modules import each other (``ranks`` imports ``fixtures`` and
    ``options``, ``launch`` imports ``options``, ...), so by its turn in the list a
    module was imported plainly by an earlier one. In a regular install or a wheel
    pytest has marked the whole distribution (``meshsim``) before loading the entry
    point, so those imports went through its hook and nothing warned. An editable
    install's recorded files are setuptools' ``.pth`` and finder: pytest 8.x to 9.1
    mark nothing of meshsim, and 9.2's fallback for editable installs looks the
    package up on ``sys.path``, where the finder does not put it (only from this
    checkout's root is it found: the repository's own suite never warned). So in
    a user's project every run warned about ``fixtures`` and ``options``, and under
    ``-W error`` or ``filterwarnings = ["error"]`` the warning is raised while the
    entry point loads: pytest exits 3 with ``Error while loading plugin "pytest11"``.
    Checked with pytest 8.4.2, 9.0.3, 9.1.1 and 9.2.0.

    Registering the modules here asks for no rewriting of them, so no order in
    which they import each other can make pytest warn; the plugin's own asserts
    need no rewriting. Where pytest marks the distribution (a regular
    install, a wheel) it still rewrites meshsim as before. pytest calls
    ``pytest_addhooks`` when this module is registered (historic: at once, or at
    the start of command-line parsing for ``pytest.main(plugins=[...])``), which is
    when it would have imported ``pytest_plugins``: before any option is parsed.
    Like ``import_plugin``, a blocked (``-p no:NAME``) or already registered module
    is left alone.
    """
    for name in PLUGINS:
        if pluginmanager.is_blocked(name) or pluginmanager.has_plugin(name):
            continue
        pluginmanager.register(importlib.import_module(name), name)
