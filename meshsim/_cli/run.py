"""``meshsim run``: torchrun's command on simulated ranks.

``meshsim run --nproc-per-node=8 train.py ARGS`` runs ``train.py`` as torchrun would
start it on 8 processes, on 8 simulated ranks of one world instead: each rank runs
the script as ``__main__`` with its own globals, ``sys.argv`` and torchrun's
environment (:mod:`meshsim._modes.script`). It ends with a summary of the collectives
(per :func:`meshsim.region`, so a script that marks its steps shows one step), their
estimated GPU time with ``--cost``, and, when a rank fails, the per-rank report the
test plugin prints, with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["add_parser", "run_command"]

# torchrun's options that mean nothing for ranks simulated in one process: why, and what to do
_UNSUPPORTED = {
    "--node-rank": "every node is simulated in this process: give --nnodes alone",
    "--rdzv-backend": "simulated ranks need no rendezvous: drop it",
    "--rdzv-endpoint": "simulated ranks need no rendezvous: drop it",
    "--rdzv-id": "simulated ranks need no rendezvous: drop it",
    "--rdzv-conf": "simulated ranks need no rendezvous: drop it",
    "--max-restarts": "a failed simulated job is reported, not restarted: drop it (or give 0)",
    "--monitor-interval": "there are no worker processes to monitor: drop it",
    "--start-method": "ranks are threads, not processes: drop it",
    "--role": "all ranks have one role: drop it",
    "--log-dir": "ranks write to this terminal: use --local-ranks-filter to choose whose lines show",
    "--redirects": "ranks write to this terminal: use --local-ranks-filter to choose whose lines show",
    "--no-python": "meshsim runs Python scripts and modules only",
    "--local-addr": "simulated ranks need no network: drop it",
}
# accepted with these values, which are the only ones that mean something here
_HARMLESS = {"--max-restarts": "0", "--node-rank": "0"}


def add_parser(sub: Any) -> None:
    """The ``run`` command's options (torchrun's names where they mean the same)."""
    parser = sub.add_parser(
        "run",
        help="run a torchrun script on simulated ranks",
        description="Run a script (or -m MODULE) as torchrun would, on simulated ranks of one process. "
        "Each rank runs it as __main__ with its own globals, sys.argv and torchrun's environment "
        "(RANK, LOCAL_RANK, WORLD_SIZE, ...); init_process_group() with any backend, init_device_mesh "
        "and os.environ['LOCAL_RANK'] work as under torchrun.",
        usage="meshsim run [options] SCRIPT [args ...]  |  meshsim run [options] -m MODULE [args ...]",
    )
    torchrun = parser.add_argument_group("torchrun's options")
    torchrun.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        default="1",
        metavar="N",
        help="ranks per node (default 1)",
    )
    torchrun.add_argument(
        "--nnodes",
        default="1",
        metavar="N",
        help="simulated nodes (default 1): LOCAL_RANK, GROUP_RANK and LOCAL_WORLD_SIZE as torchrun sets "
        "them for N nodes; the world has N x nproc-per-node ranks",
    )
    torchrun.add_argument("--standalone", action="store_true", help="accepted (every run is standalone)")
    torchrun.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run SCRIPT as a module, as python -m does (torchrun's -m)",
    )
    torchrun.add_argument("--run-path", "--run_path", action="store_true", help="accepted (the default)")
    torchrun.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        default=None,
        metavar="RANKS",
        help="show only these ranks' output (comma-separated global ranks, e.g. 0 or 0,3)",
    )
    torchrun.add_argument(
        "--tee", "-t", default=None, metavar="N", help="accepted: every rank's output shows, prefixed"
    )
    torchrun.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="MASTER_ADDR ranks see")
    torchrun.add_argument("--master-port", "--master_port", default="29500", help="MASTER_PORT ranks see")
    for flag in _UNSUPPORTED:  # known, so that each gets its own message (see _checked)
        underscored = "--" + flag[2:].replace("-", "_")
        torchrun.add_argument(flag, underscored, default=None, help=argparse.SUPPRESS)
    own = parser.add_argument_group("meshsim's options")
    own.add_argument(
        "--backend",
        choices=("sim", "gloo"),
        default="sim",
        help="sim: in-memory, checked ranks (default); gloo: real ProcessGroupGloo ranks",
    )
    own.add_argument(
        "--cuda",
        default=None,
        metavar="cpu|cuda:N",
        help="emulate CUDA: cpu (code written for GPUs runs on the CPU) or cuda:N (one real GPU)",
    )
    own.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="seconds the world may make no progress before it is reported (default 300)",
    )
    own.add_argument(
        "--num-threads",
        default="1",
        metavar="N|auto",
        help="intra-op threads per rank (default 1; auto: one per CPU)",
    )
    own.add_argument(
        "--ledger",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="every rank's ledger: its table on stdout, or as JSON in FILE",
    )
    own.add_argument(
        "--cost",
        default=None,
        metavar="TOPOLOGY",
        help="estimate the collectives' GPU time on a topology (e.g. dgx-h100): the critical "
        "path across ranks, per region",
    )
    own.add_argument(
        "--trace", default=None, metavar="FILE", help="write the run as a Chrome trace (Perfetto); sim only"
    )
    own.add_argument(
        "--redundant",
        action="store_true",
        help="look for wasted collectives (calls that told no rank anything new)",
    )
    own.add_argument(
        "--no-rank-prefix",
        dest="prefix",
        action="store_false",
        help="do not prefix each output line with its rank ([rank3]:)",
    )
    parser.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, the module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    parser.set_defaults(command=run_command)


def bare_ledger(argv: list[str]) -> list[str]:
    """``--ledger train.py ...``: tables on stdout, then the script (argparse took the script as FILE).

    The first ``.py`` argument is the script; right after a bare ``--ledger`` it gets the
    value ``-`` (stdout) put before it. A ledger file is JSON: ``--ledger out.json train.py``
    keeps its meaning, and the script's own arguments are never looked at.
    """
    for at, token in enumerate(argv):
        if token.endswith(".py"):
            if argv[at - 1] == "--ledger":
                return [*argv[:at], "-", *argv[at:]]
            break
    return list(argv)


class UsageError(ValueError):
    """A bad option value: reported before any rank starts."""


def _positive(text: str, option: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{option} must be a positive integer, got {text!r}")
    return value


def _checked(args: argparse.Namespace) -> tuple[int, int, frozenset[int] | None, int | str]:
    """The options that must be right before any rank starts: sizes, filters, threads, topology."""
    for flag, why in _UNSUPPORTED.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value != _HARMLESS.get(flag):
            raise UsageError(f"torchrun's {flag} is not supported by meshsim run: {why}")
    if ":" in args.nnodes:
        raise UsageError(
            f"--nnodes {args.nnodes!r}: elastic ranges are not supported; give a number of nodes"
        )
    nproc = _positive(args.nproc, "--nproc-per-node")
    nnodes = _positive(args.nnodes, "--nnodes")
    world_size = nproc * nnodes
    ranks = None
    if args.local_ranks_filter is not None:
        try:
            ranks = frozenset(int(r) for r in args.local_ranks_filter.split(","))
        except ValueError:
            raise UsageError(
                "--local-ranks-filter must be comma-separated ranks, e.g. 0,3; "
                f"got {args.local_ranks_filter!r}"
            ) from None
        outside = sorted(r for r in ranks if not 0 <= r < world_size)
        if outside:
            raise UsageError(f"--local-ranks-filter: ranks {outside} are not in a world of {world_size}")
    threads: int | str = args.num_threads
    if threads != "auto":
        threads = _positive(str(threads), "--num-threads")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
    if args.cost is not None:
        import meshsim

        try:
            meshsim.topology(args.cost)
        except ValueError as error:
            raise UsageError(f"--cost: {error}") from None
    if args.trace is not None and args.backend != "sim":
        raise UsageError("--trace draws simulated ranks: it needs --backend sim")
    return nproc, nnodes, ranks, threads


def _torchrun_environment(args: argparse.Namespace, nproc: int, nnodes: int) -> dict[str, str]:
    """What torchrun's agent sets for every worker besides the per-rank variables (the world sets those)."""
    env = {
        "WORLD_SIZE": str(nproc * nnodes),  # set again by a sim world; gloo ranks share these
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_WORLD_SIZE": str(nproc * nnodes),
        "MASTER_ADDR": args.master_addr,
        "MASTER_PORT": str(args.master_port),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex[:12],
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default for more than one process per node
    return env


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_command(args: argparse.Namespace) -> int:
    """Run the script on its simulated ranks and print the summary; returns the exit status."""
    import meshsim
    from meshsim._modes import script as _script

    try:
        nproc, nnodes, ranks, threads = _checked(args)
        target = _script.find_target(
            None if args.module else args.script, args.script if args.module else None, args.args
        )
    except (UsageError, ValueError) as error:
        print(f"meshsim run: error: {error}", file=sys.stderr)
        return 2
    except SyntaxError as error:
        print(f"meshsim run: error: {args.script} does not compile: {error}", file=sys.stderr)
        return 2
    world_size = nproc * nnodes
    try:
        with (
            _environment(_torchrun_environment(args, nproc, nnodes)),
            _script.script_process(target, threads_at_once=nproc if args.backend == "gloo" else None),
            _script.prefixed_output(prefix=args.prefix, ranks=ranks),
        ):
            results = meshsim.run(
                _script.run_target,
                world_size,
                args=(target,),
                backend=args.backend,
                timeout=args.timeout,
                num_threads=threads,
                redundant=args.redundant,
                trace=args.trace,
                cuda=args.cuda,
                nnodes=nnodes,
            )
    except (TypeError, ValueError) as error:  # the world's own check of an option (--cuda): before any rank
        print(f"meshsim run: error: {error}", file=sys.stderr)
        return 2
    except meshsim.MeshError as error:
        sys.stdout.flush()
        print(f"meshsim run: {target.name} failed on simulated ranks:\n{error}", file=sys.stderr)
        return _script.exit_status(error)
    sys.stdout.flush()
    print(summary(target.name, results, args.backend, args.cost))
    if args.ledger is not None:
        _write_ledgers(results, args.ledger, ranks)
    if args.trace is not None:
        if args.cost is not None:
            _add_gpu_clock(args.trace, results, args.cost)
        print(f"meshsim run: trace written to {args.trace}")
    return 0


# -- the summary --------------------------------------------------------------------


def summary(name: str, runs: Sequence[Any], backend: str, topology: str | None) -> str:
    """What ``meshsim run`` prints at the end of a run that passed: per region, then the whole run."""
    world = len(runs)
    lines = [f"meshsim run: {name} on {world} simulated ranks ({backend}): every rank finished"]
    regions: dict[str, int] = {}
    for region, _ in runs[0].regions:
        regions[region] = regions.get(region, 0) + 1
    for region, times in regions.items():
        lines += _region_lines(region, times, runs, topology)
    whole = [run.ledger for run in runs]
    lines.append(f"  whole run: {_calls(whole[0].calls)} on rank 0{_cost(whole, topology)}")
    wasted = [(i, c) for i, c in enumerate(whole[0].calls) if c.redundant]
    if wasted:  # --redundant
        lines.append(f"  {len(wasted)} of rank 0's collectives told no rank anything new; the first:")
        lines += [f"    #{i} {c.api} at {c.site}: {c.redundant}" for i, c in wasted[:3]]
    if not regions:
        lines.append(
            '  (mark a training step with `with meshsim.region("step"):` to see one step\'s collectives)'
        )
    return "\n".join(lines)


def _region_lines(region: str, times: int, runs: Sequence[Any], topology: str | None) -> list[str]:
    """The region's collectives and estimate, one line per run of times that repeat the one before."""
    per_rank = [[ledger for name, ledger in run.regions if name == region] for run in runs]
    lines = [f'  region "{region}": {times} time{"s" if times != 1 else ""}']
    previous: tuple[Any, ...] | None = None  # (shape, cost) of the line being extended
    first = 0
    for k in range(times):
        if any(k >= len(mine) for mine in per_rank):
            lines.append(f"    #{k + 1}: not every rank ended it")
            previous = None
            continue
        ledgers = [mine[k] for mine in per_rank]
        key = (tuple(_shape(c) for c in ledgers[0].calls), _cost(ledgers, topology))
        text = _calls(ledgers[0].calls)
        if key == previous:
            lines[-1] = f"    #{first + 1}-#{k + 1}: {text} on rank 0, each time{key[1]}"
            continue
        previous, first = key, k
        lines.append(f"    #{k + 1}: {text} on rank 0{key[1]}")
    return lines


def _shape(call: Any) -> tuple[Any, ...]:
    return (call.op, call.api, call.group, call.dtype, call.bytes_in, call.bytes_out, call.reduce_op)


def _calls(calls: Sequence[Any]) -> str:
    counts = Counter(c.op for c in calls)
    received = sum(c.bytes_out for c in calls)
    detail = ", ".join(f"{op} {n}" for op, n in sorted(counts.items()))
    noun = "collective" if len(calls) == 1 else "collectives"
    return f"{len(calls)} {noun} ({detail or 'none'}), {_human(received)} received"


def _cost(ledgers: Sequence[Any], topology: str | None) -> str:
    if topology is None:
        return ""
    import meshsim

    try:
        seconds = meshsim.critical_path(list(ledgers), topology).total
    except ValueError as error:  # ledgers the cost model cannot line up (batched p2p: a limit of it)
        return f"; not priced on {topology}: {str(error).splitlines()[0]}"
    estimate = meshsim.format_seconds(seconds)
    return f"; estimated {estimate} on {topology} (critical path over {len(ledgers)} ranks)"


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _add_gpu_clock(path: str, runs: Sequence[Any], topology: str) -> None:
    """Add every rank's calls on the estimated GPU clock to the trace, as a second process."""
    import meshsim
    from meshsim._observe.trace import gpu_clock_events

    with open(path, encoding="utf-8") as source:
        document = json.load(source)
    calls = [list(run.ledger.calls) for run in runs]
    document["traceEvents"] += gpu_clock_events(calls, meshsim.topology(topology))
    with open(path, "w", encoding="utf-8") as out:
        json.dump(document, out)


def _write_ledgers(runs: Sequence[Any], path: str, shown: frozenset[int] | None) -> None:
    """Every rank's ledger: tables on stdout (``-``; the ranks ``--local-ranks-filter`` shows), or
    JSON in ``path`` (every rank)."""
    if path == "-":
        for rank, run in enumerate(runs):
            if shown is None or rank in shown:
                print(f"--- rank {rank}'s ledger\n{run.ledger}")
        return
    regions: dict[int, str] = {}
    for run in runs:
        seen: Counter[str] = Counter()
        for name, ledger in run.regions:
            seen[name] += 1
            for call in ledger.calls:
                regions[id(call)] = f"{name}#{seen[name]}"
    document = {
        "world_size": len(runs),
        "ranks": [
            {"rank": rank, "calls": [_entry(call, regions.get(id(call))) for call in run.ledger.calls]}
            for rank, run in enumerate(runs)
        ],
    }
    with open(path, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=1)
    print(f"meshsim run: every rank's ledger written to {path}")


def _entry(call: Any, region: str | None) -> dict[str, Any]:
    return {
        "op": call.op,
        "api": call.api,
        "group": list(call.group),
        "dtype": str(call.dtype).removeprefix("torch.") if call.dtype is not None else None,
        "bytes_in": call.bytes_in,
        "bytes_out": call.bytes_out,
        "reduce_op": call.reduce_op,
        "seq": call.seq,
        "peer": call.peer,
        "site": call.site,
        "via": call.via,
        "redundant": call.redundant,
        "region": region,
    }
