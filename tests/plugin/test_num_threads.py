"""``MESHSIM_NUM_THREADS``: the intra-op threads of every rank the plugin and ``meshsim.testing`` simulate."""

from __future__ import annotations

import pytest

PROGRAM = """
import os
import unittest

import pytest
import torch

from meshsim.testing import DTensorTestBase, with_comms


@pytest.mark.world(2)
def test_a_rank_has_the_threads_asked_for():
    assert torch.get_num_threads() == int(os.environ["EXPECTED"])


@pytest.mark.multigpu_static
def test_a_rank_of_the_static_suite_too():
    assert torch.get_num_threads() == int(os.environ["EXPECTED"])


class Bases(DTensorTestBase):
    @property
    def world_size(self):
        return 2

    @with_comms
    def test_a_rank_of_meshsim_testing_too(self):
        assert torch.get_num_threads() == int(os.environ["EXPECTED"])
"""


# Two inner sessions a case: ./dev test checks the default, the slow tier the values.
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "1"),
        pytest.param("2", "2", marks=pytest.mark.slow),
        pytest.param("auto", "cpus", marks=pytest.mark.slow),
    ],
)
def test_the_variable_sets_every_simulated_ranks_threads(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str
) -> None:
    import os

    pytester.makepyfile(test_program=PROGRAM)
    if value is None:
        monkeypatch.delenv("MESHSIM_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("MESHSIM_NUM_THREADS", value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setenv("EXPECTED", str(cpus) if expected == "cpus" else expected)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
    static = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--multigpu-static", "--world-size=2", "-k", "static_suite"
    )
    static.assert_outcomes(passed=1, deselected=2)


def test_a_bad_value_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(test_program=PROGRAM)
    monkeypatch.setenv("MESHSIM_NUM_THREADS", "many")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stderr.fnmatch_lines(["*MESHSIM_NUM_THREADS must be a positive int or 'auto', got 'many'*"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
