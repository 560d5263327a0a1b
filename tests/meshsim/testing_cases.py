"""Small torch-style test classes on meshsim.testing's bases, run by tests/meshsim/test_testing.py.

Not collected by pytest (the file name does not start with ``test_``): several of
these fail or skip on purpose; the tests run them through unittest's API and check
what unittest records.
"""

from __future__ import annotations

import unittest

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_distributed import skip_if_lt_x_gpu
from torch.testing._internal.distributed._tensor.common_dtensor import DEVICE_TYPE

from meshsim.testing import DTensorOpTestBase, DTensorTestBase, MultiThreadedTestCase, with_comms


class Ranks(MultiThreadedTestCase):
    """What ``self`` answers on each rank; ``seen`` (made in setUp) is shared by the ranks."""

    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        super().setUp()
        self.seen: list[tuple[int, int, int]] = []
        self.main_rank = self.rank

    def test_rank_and_world_size(self) -> None:
        self.seen.append((self.rank, dist.get_rank(), self.world_size))

    def test_all_gather(self) -> None:
        out = [torch.empty(2) for _ in range(self.world_size)]
        dist.all_gather(out, torch.full((2,), float(self.rank)))
        self.assertEqual(torch.stack(out), torch.arange(4.0).repeat_interleave(2).view(4, 2))

    def test_per_thread_hooks(self) -> None:
        self.assertEqual(self.hooked, self.rank)

    def perThreadSetUp(self) -> None:
        self.hooked = dist.get_rank()  # the rank's group exists already

    def perThreadTearDown(self) -> None:
        self.seen.append((self.rank, -1, -1))


class Failures(MultiThreadedTestCase):
    world_size = 3

    def test_rank_2_raises(self) -> None:
        dist.barrier()
        if self.rank == 2:
            raise KeyError("only rank 2")
        dist.barrier()

    def test_assert_raises_on_ranks(self) -> None:
        with self.assertRaisesRegex(ValueError, "bad rank"):
            raise ValueError(f"bad rank {self.rank}")
        dist.barrier()

    def test_assertion_fails_on_rank_1(self) -> None:
        self.assertEqual(self.rank, 0 if self.rank != 1 else -1)

    @unittest.expectedFailure
    def test_expected_failure(self) -> None:
        self.assertNotEqual(self.rank, 1)

    def test_cleanup_runs_on_the_rank(self) -> None:
        self.addCleanup(dist.barrier)  # a collective: only a rank can run it
        self.addCleanup(self.assertEqual, dist.get_rank(), self.rank)


class Subtests(MultiThreadedTestCase):
    world_size = 2

    def test_subtests(self) -> None:
        for i in range(3):
            with self.subTest(i=i):
                dist.barrier()
                self.assertNotEqual((self.rank, i), (1, 1), "rank 1 fails i=1")
        with self.subTest("message", j=0):
            if self.rank == 0:
                self.skipTest("rank 0 skips j=0")
        dist.barrier()  # every rank got past its failed subtest

    def test_nested(self) -> None:
        with self.subTest(outer=1):
            with self.subTest(inner=2):
                self.assertEqual(self.rank, 0)


class Skips(MultiThreadedTestCase):
    world_size = 2

    def test_unittest_skip_on_rank_1(self) -> None:
        if self.rank == 1:
            self.skipTest("rank 1 has nothing to do")
        dist.barrier()

    def test_pytest_skip(self) -> None:
        pytest.skip("skipped with pytest")

    @skip_if_lt_x_gpu(2)
    def test_needs_gpus(self) -> None:
        dist.barrier()


class DTensors(DTensorTestBase):
    @with_comms
    def test_collectives_and_dtensor(self) -> None:
        t = torch.ones(2) * self.rank
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 6.0))
        mesh = self.build_device_mesh()
        self.assertEqual((mesh.device_type, mesh.size(), mesh.get_rank()), (self.device_type, 4, self.rank))
        full = torch.arange(16.0).view(8, 2)
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(sharded.to_local(), full[2 * self.rank : 2 * self.rank + 2])
        self.assertEqual(sharded.redistribute(mesh, [Replicate()]).to_local(), full)
        self.assertEqual(sharded.full_tensor(), full)
        self._test_op(mesh, torch.add, full, full)

    @with_comms()
    def test_with_comms_called(self) -> None:
        self.assertTrue(dist.is_initialized())
        self.assertEqual(self.backend, "gloo")  # torch's name for CPU; meshsim serves it

    @with_comms(eager_init=True, backend="gloo")
    def test_run_subtests(self) -> None:
        self.run_subtests({"n": [1, 2]}, self._check_sum)

    def _check_sum(self, n: int) -> None:
        t = torch.full((n,), 1.0)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((n,), 4.0))

    def test_without_with_comms(self) -> None:
        self.assertTrue(dist.is_initialized())


class OpBase(DTensorOpTestBase):
    @with_comms  # passthrough: no init_pg
    def test_mesh(self) -> None:
        mesh = self.build_device_mesh()
        d = DTensor.from_local(torch.ones(1), mesh, [Shard(0)])
        self.assertEqual(d.full_tensor(), torch.ones(self.world_size))
        self.assertEqual(self.device_type, DEVICE_TYPE)


class BadWorldSize(MultiThreadedTestCase):
    world_size = 0

    def test_nothing(self) -> None:
        pass
