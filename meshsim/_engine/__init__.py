"""One world of rank threads: its life (start, call, close), its threads and CPUs, its outcomes.

The scheduler and doorbells that decide which rank runs live in :mod:`meshsim._baton`.
This package is also the face the layers above (the plugin, the modes) reach the
backend and the process state through: the few names they need are re-exported here.
"""

from meshsim._engine.session import Session
from meshsim._process import cuda
from meshsim._process.handover import hold
from meshsim._process.modules import declared_modules, per_rank_module
from meshsim._process.patches import install_cuda, uninstall_cuda
from meshsim._process.state import torchrun_environment
from meshsim._record.ledger import Ledger
from meshsim._record.sites import library_code
from meshsim._sim.backend import restart_numbering

__all__ = [
    "Ledger",
    "Session",
    "cuda",
    "declared_modules",
    "hold",
    "install_cuda",
    "library_code",
    "per_rank_module",
    "restart_numbering",
    "torchrun_environment",
    "uninstall_cuda",
]
