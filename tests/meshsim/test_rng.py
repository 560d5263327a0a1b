"""Ranks behave like separate processes: each has its own RNG stream."""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist

import meshsim


def draws(seed: int, n: int) -> list[list[float]]:
    torch.manual_seed(seed)
    return [torch.randn(3).tolist() for _ in range(n)]


def test_seeding_one_rank_never_changes_anothers_draws() -> None:
    def body() -> list[list[float]]:
        torch.manual_seed(100 + dist.get_rank())
        out = []
        for _ in range(5):
            out.append(torch.randn(3).tolist())
            dist.barrier()  # every other rank runs (and draws) in between
        return out

    results = meshsim.run(body, 4)
    for rank, got in enumerate(results):
        assert got == draws(100 + rank, 5)


def test_unseeded_ranks_start_from_the_callers_state_like_forked_processes() -> None:
    torch.manual_seed(7)
    expected = torch.randn(4).tolist()
    torch.manual_seed(7)
    before = torch.get_rng_state()

    def body() -> list[float]:
        dist.barrier()
        return torch.randn(4).tolist()

    assert meshsim.run(body, 3) == [expected] * 3
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched


def test_runs_are_reproducible() -> None:
    def body() -> list[float]:
        torch.manual_seed(dist.get_rank())
        x = torch.randn(4)
        dist.all_reduce(x)
        return (x + torch.rand(4)).tolist()

    assert meshsim.run(body, 4) == meshsim.run(body, 4)


def test_dropout_under_replicated_params_differs_per_rank_as_in_processes() -> None:
    def body() -> list[float]:
        torch.manual_seed(dist.get_rank())
        dropped = torch.nn.functional.dropout(torch.ones(16), p=0.5)
        dist.barrier()
        return dropped.tolist()

    results = meshsim.run(body, 2)
    assert (
        results[0] == torch.nn.functional.dropout((torch.manual_seed(0), torch.ones(16))[1], p=0.5).tolist()
    )
    assert results[0] != results[1]


def test_python_random_and_numpy_are_per_rank_too() -> None:
    import random

    import numpy as np

    def body() -> tuple[list[float], list[float]]:
        rank = dist.get_rank()
        random.seed(rank)
        np.random.seed(rank)
        py, npy = [], []
        for _ in range(3):
            py.append(random.random())
            npy.append(float(np.random.rand()))
            dist.barrier()
        return py, npy

    before_py, before_np = random.getstate(), np.random.get_state()
    results = meshsim.run(body, 3)
    for rank, (py, npy) in enumerate(results):
        ref_py, ref_np = random.Random(rank), np.random.RandomState(rank)
        assert py == [ref_py.random() for _ in range(3)]
        assert npy == [float(ref_np.rand()) for _ in range(3)]
    assert random.getstate() == before_py
    after_np = np.random.get_state()
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(before_np, after_np)
    )


def test_unseeded_python_random_starts_from_the_callers_state() -> None:
    import random

    random.seed(11)
    expected = random.random()
    random.seed(11)

    def body() -> float:
        dist.barrier()
        return random.random()

    assert meshsim.run(body, 2) == [expected, expected]
    assert random.random() == expected  # the caller's generator did not move


def test_a_function_rebound_between_worlds_is_left_unrouted_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meshsim.run(lambda: random.random(), 2)  # the routes are built and cached
    calls: list[str] = []
    original = random.uniform

    def uniform(a: float, b: float) -> float:  # rebound by the test, as a monkeypatch would
        calls.append(threading.current_thread().name)
        return original(a, b)

    monkeypatch.setattr(random, "uniform", uniform)
    meshsim.run(lambda: random.uniform(0, 1), 2)
    assert random.uniform is uniform  # put back as it was found, not as it was cached
    # not a method of random's generator, so it is the user's own function: left unrouted
    assert sorted(calls) == ["meshsim-rank-0", "meshsim-rank-1"]
    assert random.random == random._inst.random  # type: ignore[attr-defined]  # the rest: restored
