"""``meshsim run``: torchrun's command on simulated ranks, driven as a user types it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshsim._cli import main

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import meshsim

dist.init_process_group()  # env://, as torchrun scripts call it
rank = dist.get_rank()
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
keys += ("TORCHELASTIC_RUN_ID",)
print("STATE " + json.dumps([rank, [os.environ.get(k) for k in keys], sys.argv[1:], __name__]))
for step in range(3):
    with meshsim.region("step"):
        t = torch.ones(4) * rank
        dist.all_reduce(t)
        if step == 0:
            dist.broadcast(t, 0)
if rank == 1 and "--exit" in sys.argv:
    sys.exit(int(sys.argv[-1]))
if rank == 1 and "--raise" in sys.argv:
    raise RuntimeError("boom on rank 1")
if not (rank == 1 and "--skip" in sys.argv):
    dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _states(out: str) -> dict[int, list[object]]:
    """Each rank's STATE line (its rank prefix checked)."""
    states = {}
    for line in out.splitlines():
        head, _, rest = line.partition(":STATE ")
        if rest:
            state = json.loads(rest)
            assert head == f"[rank{state[0]}]"
            states[state[0]] = state[1:]
    return states


@pytest.mark.parametrize("backend", ["sim", "gloo"])
def test_each_rank_has_its_environment_argv_and_main(
    script: str, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--nproc-per-node", "2", "--backend", backend, script, "--lr", "3"])
    out = capsys.readouterr().out
    assert status == 0, out
    states = _states(out)
    assert sorted(states) == [0, 1]
    for rank, (env, argv, name) in states.items():
        assert env[:6] == [str(rank), str(rank), "0", str(rank), "2", "2"]
        assert env[6]  # a run id, as torchrun's agent sets
        assert (argv, name) == (["--lr", "3"], "__main__")
    assert f"meshsim run: {script} on 2 simulated ranks ({backend}): every rank finished" in out
    assert "RANK" not in os.environ and sys.argv[0] != script  # the process is as it was


def test_nnodes_lays_ranks_out_on_nodes(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--nnodes", "2", "--nproc_per_node=2", "--standalone", script]) == 0
    states = _states(capsys.readouterr().out)
    local_and_node = {rank: (env[1], env[2], env[4], env[5]) for rank, (env, _, _) in states.items()}
    assert local_and_node == {
        0: ("0", "0", "4", "2"),
        1: ("1", "0", "4", "2"),
        2: ("0", "1", "4", "2"),
        3: ("1", "1", "4", "2"),
    }


def test_a_module_runs_with_m(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "trainer_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)  # python -m finds modules in the working folder first
    assert main(["run", "--nproc-per-node", "2", "-m", "trainer_pkg", "--x"]) == 0
    out = capsys.readouterr().out
    assert [argv for _, argv, _ in _states(out).values()] == [["--x"], ["--x"]]


def test_the_summary_shows_each_step_and_its_estimate(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["run", "--nproc-per-node", "2", "--cost", "dgx-h100", "--local-ranks-filter", "0", script]) == 0
    )
    out = capsys.readouterr().out
    assert "[rank1]" not in out and "[rank0]:STATE" in out  # the filter
    assert main(["run", "--nproc-per-node", "2", "--local-ranks-filter", "1", "--ledger=-", script]) == 0
    tables = capsys.readouterr().out
    assert "--- rank 1's ledger" in tables and "--- rank 0's ledger" not in tables
    # a bare --ledger before the script: the tables, and the script still runs with its arguments
    filtered = ["run", "--nproc-per-node", "2", "--local-ranks-filter", "1"]
    assert main([*filtered, "--ledger", script, "--x.py"]) == 0
    bare = capsys.readouterr().out
    assert "--- rank 1's ledger" in bare and [argv for _, argv, _ in _states(bare).values()] == [["--x.py"]]
    summary = out[out.index("meshsim run:") :].splitlines()
    assert summary[1] == '  region "step": 3 times'
    assert summary[2].startswith(
        "    #1: 2 collectives (all_reduce 1, broadcast 1), 16 B received on rank 0; estimated "
    )
    assert summary[2].endswith(" on dgx-h100 (critical path over 2 ranks)")
    assert summary[3].startswith(
        "    #2-#3: 1 collective (all_reduce 1), 16 B received on rank 0, each time; estimated "
    )
    assert summary[4].startswith(
        "  whole run: 5 collectives (all_reduce 3, barrier 1, broadcast 1), 48 B received"
    )


@pytest.mark.allow_redundant  # the script's calls, found by its own world (this test's finding too)
def test_redundant_reports_wasted_calls(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--nproc-per-node", "2", "--redundant", script]) == 0
    out = capsys.readouterr().out
    assert "  3 of rank 0's collectives told no rank anything new; the first:" in out
    assert "#1 broadcast at train.py:16 in <module>: every rank already held the root's 16 bytes" in out
    assert main(["run", "--nproc-per-node", "2", script]) == 0
    assert "told no rank anything new" not in capsys.readouterr().out  # not looked for by default


def test_the_ledger_file_has_every_rank_and_region(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger, trace = tmp_path / "ledger.json", tmp_path / "trace.json"
    command = [
        "run",
        "--nproc-per-node",
        "2",
        "--ledger",
        str(ledger),
        "--trace",
        str(trace),
        "--cost",
        "pcie",
    ]
    assert main([*command, script]) == 0
    document = json.loads(ledger.read_text())
    assert document["world_size"] == 2
    for rank, entry in enumerate(document["ranks"]):
        calls = entry["calls"]
        assert entry["rank"] == rank
        assert [(c["op"], c["region"]) for c in calls] == [
            ("all_reduce", "step#1"),
            ("broadcast", "step#1"),
            ("all_reduce", "step#2"),
            ("all_reduce", "step#3"),
            ("barrier", None),
        ]
        assert calls[0]["group"] == [0, 1] and calls[0]["dtype"] == "float32" and calls[0]["bytes_in"] == 16
        assert calls[0]["site"].startswith("train.py:")
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("ph") == "X"} >= {"all_reduce", "broadcast", "barrier"}
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert "estimated GPU clock, pcie" in processes  # --cost adds the GPU clock
    out = capsys.readouterr().out
    assert f"every rank's ledger written to {ledger}" in out and f"trace written to {trace}" in out


def _failure(script: str, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["run", "--nproc-per-node", "2", "--timeout", "20", script, *args])
    return status, capsys.readouterr().err


def test_a_rank_that_raises_fails_the_run_naming_it(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _failure(script, "--raise", capsys=capsys)
    assert status == 1
    assert "train.py failed on simulated ranks:\nrank 1 of 2 raised; its traceback:" in err
    assert "RuntimeError: boom on rank 1" in err and 'train.py", line ' in err


def test_on_gloo_a_rank_that_raises_fails_the_run_naming_it(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["run", "--nproc-per-node", "2", "--backend", "gloo", "--timeout", "5", script, "--raise"])
    err = capsys.readouterr().err
    assert status == 1
    assert "train.py failed on simulated ranks:\nrank 1 of 2 raised; its traceback:" in err
    assert "RuntimeError: boom on rank 1" in err


def test_a_rank_that_exits_non_zero_is_the_runs_status(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _failure(script, "--exit", "3", capsys=capsys)
    assert status == 3
    assert "rank 1 of 2 raised" in err and "SystemExit: 3" in err


def test_exit_zero_is_success(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _failure(script, "--exit", "0", capsys=capsys)  # rank 1 leaves before the barrier
    assert status == 1  # rank 0 then waits for it alone: reported, not hung
    assert "rank 1: finished" in err


def test_a_skipped_collective_names_the_rank_and_the_line(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _failure(script, "--skip", capsys=capsys)
    assert status == 1
    line = SCRIPT.splitlines().index("    dist.barrier()") + 1
    assert f"rank 0: waiting in barrier(), call #4 of group [0, 1] at train.py:{line} in <module>" in err
    assert "rank 1: finished" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be a positive integer, got '0'"),
        (["--nproc-per-node", "abc", "x.py"], "--nproc-per-node must be a positive integer, got 'abc'"),
        (["no_such_script.py"], "cannot run script 'no_such_script.py': no such file"),
        (["-m", "no_such_module_anywhere"], "cannot run module 'no_such_module_anywhere': no module"),
        (["--cost", "dgx-z", "x.py"], "--cost: unknown topology 'dgx-z'; known topologies: "),
        (["--rdzv-backend", "c10d", "x.py"], "torchrun's --rdzv-backend is not supported by meshsim run: "),
        (["--node_rank", "1", "x.py"], "torchrun's --node-rank is not supported by meshsim run: "),
        (["--nnodes", "1:2", "x.py"], "--nnodes '1:2': elastic ranges are not supported"),
        (["--local-ranks-filter", "5", "x.py"], "--local-ranks-filter: ranks [5] are not in a world of 1"),
        (["--backend", "gloo", "--trace", "t.json", "x.py"], "--trace draws simulated ranks"),
        (["--cuda", "foo", "x.py"], "cuda must be 'cpu' (CUDA emulated on the CPU), 'cuda:N'"),
    ],
    ids=[
        "zero",
        "abc",
        "script",
        "module",
        "topology",
        "rdzv",
        "node-rank",
        "elastic",
        "filter",
        "trace",
        "cuda",
    ],
)
def test_bad_input_is_refused_before_any_rank_starts(
    args: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('ran')\n")
    assert main(["run", *args]) == 2
    assert f"meshsim run: error: {message}" in capsys.readouterr().err


def test_the_command_line_entry_points(script: str) -> None:
    """``python -m meshsim run`` in a process of its own, as a user types it (and the console script)."""
    command = [sys.executable, "-m", "meshsim", "run", "--nproc-per-node", "2", script]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert sorted(_states(result.stdout)) == [0, 1]
    console = Path(sys.executable).with_name("meshsim")
    assert console.exists(), "pip install puts a meshsim command beside python"
    help_text = subprocess.run([str(console), "run", "--help"], capture_output=True, text=True, timeout=120)
    for option in ("--nproc-per-node", "--nnodes", "--cost", "--ledger", "--trace", "--local-ranks-filter"):
        assert option in help_text.stdout
