"""torch.compile works on every backend, and a compiled function's collectives reach the ledger.

On gloo, spawned and torchrun ranks the ledger is fed by a dispatch mode; dynamo
refuses to compile under a mode that does not step aside while it traces. The same
test runs on sim, gloo and spawned ranks here, and under torchrun in CI.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from meshsim import Ledger

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# Inductor compiles C++ (half a minute from a cold cache on 2 cores): the slow tier.
COMPILERS = ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


def double_then_sum(x: torch.Tensor) -> torch.Tensor:
    return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1


def _compiled_collective(compiler: str, rank: int, ledger: Ledger) -> None:
    compiled = torch.compile(double_then_sum, backend=compiler, fullgraph=True)
    out = compiled(torch.ones(4) * (rank + 1))
    assert out.tolist() == [7.0] * 4  # 2 * (1 + 2) + 1 on 2 ranks
    assert ledger.project("op", "api", "group", "bytes_in", "reduce_op") == [
        ("all_reduce", "all_reduce", (0, 1), 16, "SUM")
    ]


@pytest.mark.world(2)
@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_collectives_on_simulated_ranks(compiler: str, rank: int, ledger: Ledger) -> None:
    _compiled_collective(compiler, rank, ledger)


@pytest.mark.world(2, backend="gloo")
@pytest.mark.parametrize("compiler", COMPILERS)
def test_compiled_collectives_on_gloo_ranks(compiler: str, rank: int, ledger: Ledger) -> None:
    _compiled_collective(compiler, rank, ledger)


@pytest.mark.slow  # a process per rank, each importing torch and compiling
@pytest.mark.world(2, backend="spawn")
def test_compiled_collectives_on_spawned_ranks(rank: int, ledger: Ledger) -> None:
    _compiled_collective("aot_eager", rank, ledger)


@pytest.mark.world(2, backend="gloo")
def test_compiling_a_plain_function_on_a_gloo_rank(rank: int) -> None:
    # the recorder is entered for the rank's life: fullgraph would raise if dynamo skipped
    compiled = torch.compile(lambda x: x.sin() + 1, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(torch.zeros(3)), torch.ones(3))
