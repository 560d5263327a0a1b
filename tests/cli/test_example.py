"""The training example: ``meshsim run`` trains it to the one-process run's losses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshsim._cli import main

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train_llama.py")


def _losses(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+ loss_full (\S+)", text)]


@pytest.fixture(scope="module")
def alone() -> list[float]:
    """The one-process run's losses (no parallelism)."""
    command = [sys.executable, EXAMPLE, "--steps", "2", "--print-full"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
    losses = _losses(result.stdout)
    assert len(losses) == 2
    return losses


@pytest.mark.parametrize(
    ("ranks", "layout"),
    [
        pytest.param(4, [], id="tp2-dp2"),
        pytest.param(8, ["--pp", "2"], id="pp2-dp2-tp2", marks=pytest.mark.slow),
    ],
)
def test_simulated_ranks_train_to_the_same_losses(
    alone: list[float], ranks: int, layout: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["run", f"--nproc-per-node={ranks}", "--cost", "dgx-h100", EXAMPLE, "--steps", "2"]
    assert main([*command, "--print-full", *layout]) == 0
    out = capsys.readouterr().out
    assert _losses(out) == pytest.approx(alone, rel=1e-5)
    assert '  region "step": 2 times' in out  # the example marks its steps
    assert "estimated" in out and "not priced" not in out  # pipelining's batched p2p too
