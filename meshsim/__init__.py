"""meshsim: run distributed PyTorch code on N simulated ranks, with an exact collective ledger.

See the README for a guide; every name below is documented where it is defined.
"""

from meshsim._errors import CollectiveMismatchError, DeadlockError, MeshError, RankError, StateLeakWarning
from meshsim._ledger import Collective, Ledger, record
from meshsim._perrank import per_rank
from meshsim._snapshot import SnapshotMismatchError, check_snapshot
from meshsim._threads import end_idle_threads
from meshsim._world import run

__all__ = [
    "Collective",
    "CollectiveMismatchError",
    "DeadlockError",
    "Ledger",
    "MeshError",
    "RankError",
    "SnapshotMismatchError",
    "StateLeakWarning",
    "check_snapshot",
    "end_idle_threads",
    "per_rank",
    "record",
    "run",
]
