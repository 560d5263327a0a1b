"""Ranks behave like separate processes: each has its own RNG stream."""

from __future__ import annotations

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
    assert results[0] == torch.nn.functional.dropout(
        (torch.manual_seed(0), torch.ones(16))[1], p=0.5
    ).tolist()
    assert results[0] != results[1]
