"""meshsim: run distributed PyTorch code on N simulated ranks, with an exact collective ledger.

See the README for a guide; every name below is documented where it is defined.

PYTEST_DONT_REWRITE: a program may import this package before it runs pytest in-process,
and pytest would warn that it cannot rewrite it; it has no asserts to rewrite.
"""

from meshsim._base.errors import (
    CollectiveMismatchError,
    DeadlockError,
    MeshError,
    RankError,
    StateLeakWarning,
)
from meshsim._engine.threads import end_idle_threads
from meshsim._engine.world import run
from meshsim._observe.cost import Schedule, critical_path, format_seconds
from meshsim._observe.snapshot import SnapshotMismatchError, check_snapshot
from meshsim._observe.topology import Topology, topology
from meshsim._process.handover import per_rank
from meshsim._process.modules import per_rank_module
from meshsim._record.ledger import Collective, Ledger, record
from meshsim._record.regions import region
from meshsim._record.sites import library_code

__all__ = [
    "Collective",
    "CollectiveMismatchError",
    "DeadlockError",
    "Ledger",
    "MeshError",
    "RankError",
    "Schedule",
    "SnapshotMismatchError",
    "StateLeakWarning",
    "Topology",
    "check_snapshot",
    "critical_path",
    "end_idle_threads",
    "format_seconds",
    "library_code",
    "per_rank",
    "per_rank_module",
    "record",
    "region",
    "run",
    "topology",
]
