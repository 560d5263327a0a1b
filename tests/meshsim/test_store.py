"""The world's store: cooperative waits, c10d's store-based barrier, and deadlocks on missing keys."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import meshsim


def test_store_based_barrier_in_new_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")  # c10d then barriers through the store

    def body() -> list[int]:
        group = dist.new_group([0, 1, 2])
        return dist.get_process_group_ranks(group)

    assert meshsim.run(body, 3) == [[0, 1, 2]] * 3


def test_get_waits_for_a_later_rank() -> None:
    def body() -> bytes:
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            return store.get("answer")  # rank 1 has not run yet: this must yield, not block
        store.set("answer", "42")
        store.add("count", 5)
        return store.get("count")

    assert meshsim.run(body, 2) == [b"42", b"5"]


def test_a_key_nobody_sets_is_a_deadlock() -> None:
    def body() -> None:
        dist.distributed_c10d._get_default_store().wait(["never"])

    with pytest.raises(meshsim.DeadlockError) as info:
        meshsim.run(body, 2, timeout=30)
    assert not info.value.timed_out
    assert "rank 0: waiting in store.wait for key(s) ['default_pg/0//never'] at test_store.py:" in str(
        info.value
    )
