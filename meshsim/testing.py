"""Drop-in replacements for torch's distributed unittest bases, on simulated ranks.

A test file written for torch's ``MultiThreadedTestCase``, ``DTensorTestBase``,
``DTensorOpTestBase``, ``with_comms`` and ``spawn_threads_and_init_comms`` moves
over by changing its imports (torch's skip decorators ``skip_if_lt_x_gpu``,
``skip_if_no_gpu``, ``skip_unless_torch_gpu`` and ``requires_gloo`` are here too,
torch's own, as they work unchanged)::

    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms
    # becomes
    from meshsim.testing import DTensorTestBase, with_comms

Each test method then runs on ``world_size`` rank threads of one meshsim world
(:func:`meshsim.run`, the simulated backend), under ``python -m unittest`` and
under pytest alike. As on torch's bases, ``setUp`` and ``tearDown`` run once, in
the caller; every rank has its own instance of the test class, with its own
``self.rank``; ``self.world_size``, ``self.device_type`` and the DTensor helpers
(``build_device_mesh``, ``init_pg``, ``_test_op``, ``run_subtests``...) answer as
torch's do. A rank's exception reaches unittest (and an outer ``assertRaises``) as
that very exception, a skip on a rank skips the test unless a rank failed, and
``self.subTest`` works on ranks: each rank's subtests are reported, with ``rank``
among their parameters, once the world has ended.

What it cannot do: run what needs one process per rank (per-process globals such
as environment variables changed by one rank and read by another, ``os.fork``,
CUDA device contexts per rank), nor tests of torch's threaded process group
itself. torch's LocalTensor variants (``create_local_tensor_test_class``) keep
running as torch runs them: once, in the caller, under ``LocalTensorMode``.
Importing this module imports torch's ``torch.testing._internal.common_utils``
(it needs ``expecttest``), whose ``TestCase`` the bases derive from.
"""

from __future__ import annotations

# torch's skip decorators work unchanged on meshsim's ranks (they skip through the
# test's _handle_test_skip or torch's skip exit codes, which the bases take as a skip):
# re-exported as they are, so a file moves over by its imports (checked in torch 2.11-2.15)
from torch.testing._internal.common_distributed import (
    requires_gloo,
    skip_if_lt_x_gpu,
    skip_if_no_gpu,
)
from torch.testing._internal.distributed._tensor.common_dtensor import skip_unless_torch_gpu

from meshsim._unittest.bases import DTensorOpTestBase, DTensorTestBase, MultiThreadedTestCase, with_comms
from meshsim._unittest.threads import spawn_threads_and_init_comms

__all__ = [
    "DTensorOpTestBase",
    "DTensorTestBase",
    "MultiThreadedTestCase",
    "requires_gloo",
    "skip_if_lt_x_gpu",
    "skip_if_no_gpu",
    "skip_unless_torch_gpu",
    "spawn_threads_and_init_comms",
    "with_comms",
]
