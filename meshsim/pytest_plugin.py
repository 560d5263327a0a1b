"""pytest plugin: run one test body on N ranks, simulated or real (the ``pytest11`` entry point).

Registered through the ``pytest11`` entry point, so any project that installs
meshsim has it. Each feature is a plugin of its own, in :mod:`meshsim._pytest`:

- :mod:`~meshsim._pytest.options`: the options, the ``world`` / ``multigpu_static``
  markers, which tests ``--multigpu-static`` / ``--multigpu-dynamic`` select;
- :mod:`~meshsim._pytest.ranks`: a distributed test's body on its ranks;
- :mod:`~meshsim._pytest.fixtures`: per-rank fixtures, meshsim's and the user's;
- :mod:`~meshsim._pytest.static`: the simulated static suite (one job for the session);
- :mod:`~meshsim._pytest.launch`: torchrun's ranks, and ``--mesh-backend=spawn``'s launch;
- :mod:`~meshsim._pytest.snapshots`: ledger snapshots;
- :mod:`~meshsim._pytest.cost`: each test's estimated GPU communication time (``--mesh-cost``);
- :mod:`~meshsim._pytest.findings`: the wasted-collectives report (``--mesh-redundant``);
- :mod:`~meshsim._pytest.traces`: timelines per test (``--mesh-trace``);
- :mod:`~meshsim._pytest.cuda`: GPU code without a GPU (``--mesh-cuda``).

Their shared state is one object in ``config.stash`` (:mod:`meshsim._pytest.state`).
The plugins import torch lazily: collecting a project that never uses it costs nothing.
"""

# Registered in this order; pytest calls a hook's implementations of equal priority
# last-registered first, so options configure first and the static suite's job
# starts after the findings' and traces' settings are made.
pytest_plugins = [
    "meshsim._pytest.launch",
    "meshsim._pytest.static",
    "meshsim._pytest.snapshots",
    "meshsim._pytest.cost",
    "meshsim._pytest.traces",
    "meshsim._pytest.findings",
    "meshsim._pytest.ranks",
    "meshsim._pytest.fixtures",
    "meshsim._pytest.options",
    "meshsim._pytest.cuda",
]
