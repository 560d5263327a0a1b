"""What meshsim must report when one rank of a generated program deviates (issue 5).

:func:`predict` says what ``meshsim.run`` must raise for a :class:`~programs.Fault`,
from a small model of the rendezvous that any correct checker implements: calls meet
at (group, sequence number), sends are buffered, the n-th receive from a rank matches
its n-th send. Programs never branch on data, so what completes does not depend on
scheduling, and the model's verdict is the only correct one. The model never looks at
meshsim's code. A fault whose effect a correct checker need not see (a skipped receive
nobody waits for), or whose report would depend on scheduling, makes ``predict`` return
None, and :func:`draw_fault` never produces it. :func:`check_error` compares an error
with the prediction.

Non-goals: modelling meshsim's tie-breaking. Where meshsim has to pick a rank to blame
without a majority (2-member groups), the checks only require the faulty rank to appear
in the error.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from calls import CallSpec, rank_calls
from programs import (
    DTYPES,
    FAULT_KINDS,
    OBJECT_KINDS,
    REDUCING,
    REGROUPABLE,
    ROOTED,
    Fault,
    InjectedFault,
    Program,
    Source,
    Step,
    choose,
    draw_program,
    ops_for,
)
from runs import SITES

import meshsim

# -- what meshsim must report -------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """One way a CollectiveMismatchError may correctly come out.

    Attributes:
        group, seq: the slot (seq is -1 for a send/recv that do not fit).
        blame: ``("exact", ranks)``: ``.ranks`` must equal ranks; ``("within", ranks)``:
            ``.ranks`` must include the faulty rank and lie within ranks; ``("calls", ())``:
            the faulty rank must be in ``.calls`` (no majority to blame by).
        rows: (rank, call site) for every rank that reached the call.
        p2p: a send and a recv that do not fit, rather than a collective.
    """

    group: tuple[int, ...]
    seq: int
    blame: tuple[str, tuple[int, ...]]
    rows: tuple[tuple[int, str], ...]
    p2p: bool = False


@dataclass(frozen=True)
class Expected:
    """What ``meshsim.run`` must raise for a faulty program.

    Attributes:
        error: the class (RankError, CollectiveMismatchError or DeadlockError).
        rank: the faulty rank.
        timed_out: DeadlockError only: whether it must come from the timeout.
        mismatches: CollectiveMismatchError: any one of these is correct.
        rows: DeadlockError (not timed out): a regex every rank's state row must match.
        culprits: DeadlockError (not timed out): the exact ``.ranks``.
    """

    error: type[meshsim.MeshError]
    rank: int
    timed_out: bool = False
    mismatches: tuple[Mismatch, ...] = ()
    rows: tuple[tuple[int, str], ...] = ()
    culprits: tuple[int, ...] = ()

    def __str__(self) -> str:
        what = self.error.__name__ + (" (timeout)" if self.timed_out else "")
        return f"{what} naming rank {self.rank}"


class _Uncertain(Exception):
    """The model cannot promise one report (meshsim may correctly report it otherwise)."""


@dataclass
class _Model:
    """Which calls meet, given every rank's call list; the first certain report, if any.

    A rank runs until it issues a collective (it then waits in the slot (group, seq)) or
    waits for a receive. A slot completes when every member has arrived with the same
    key. Sends are buffered; the n-th receive from a rank matches its n-th send. Since
    programs never branch on data, what completes does not depend on scheduling.
    """

    calls: list[list[CallSpec | str]]
    pos: list[int] = field(default_factory=list)
    state: list[str] = field(default_factory=list)  # run, slot, recv, done, busy, stopped
    seqs: dict[tuple[int, tuple[Any, ...]], int] = field(default_factory=dict)
    slots: dict[tuple[tuple[Any, ...], int], dict[int, CallSpec]] = field(default_factory=dict)
    where: dict[int, tuple[tuple[Any, ...], int]] = field(default_factory=dict)
    sent: dict[tuple[Any, ...], list[CallSpec]] = field(default_factory=dict)
    taken: dict[tuple[Any, ...], int] = field(default_factory=dict)
    events: list[tuple[Any, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.calls)
        self.pos, self.state = [0] * n, ["run"] * n

    def run(self) -> None:
        progress = True
        while progress:
            for rank in range(len(self.calls)):
                self._advance(rank)
            progress = self._complete_slots() | self._match_recvs()

    def _advance(self, rank: int) -> None:
        calls = self.calls[rank]
        while self.state[rank] == "run":
            if self.pos[rank] >= len(calls):
                self.state[rank] = "done"
                return
            call = calls[self.pos[rank]]
            if isinstance(call, str):
                self.state[rank] = "busy" if call == "sleep" else "done"
            elif call.direction == "send":
                self.sent.setdefault((call.inst, rank, call.peer), []).append(call)
                self.pos[rank] += 1
            elif call.direction == "recv":
                self.state[rank] = "recv"
            else:
                self._arrive(rank, call)

    def _arrive(self, rank: int, call: CallSpec) -> None:
        seq = self.seqs.get((rank, call.inst), 0)
        self.seqs[(rank, call.inst)] = seq + 1
        self.slots.setdefault((call.inst, seq), {})[rank] = call
        self.where[rank] = (call.inst, seq)
        self.state[rank] = "slot"

    def _complete_slots(self) -> bool:
        progress = False
        for slot, arrived in list(self.slots.items()):
            members = next(iter(arrived.values())).members
            if len(arrived) < len(members):
                continue
            del self.slots[slot]
            if len({c.key for c in arrived.values()}) > 1:
                self.events.append(("slot", slot, arrived))
                for rank in arrived:
                    self.state[rank] = "stopped"
                continue
            for rank in arrived:
                self.pos[rank] += 1
                self.state[rank] = "run"
            progress = True
        return progress

    def _match_recvs(self) -> bool:
        progress = False
        for rank, state in enumerate(self.state):
            if state != "recv":
                continue
            recv = self.calls[rank][self.pos[rank]]
            assert isinstance(recv, CallSpec)
            queue = (recv.inst, recv.peer, rank)
            sent, taken = self.sent.get(queue, []), self.taken.get(queue, 0)
            if taken >= len(sent):
                continue
            self.taken[queue] = taken + 1
            progress = True
            if sent[taken].key != recv.key:
                self.events.append(("p2p", sent[taken], recv))
                self.state[rank] = "stopped"
                continue
            self.pos[rank] += 1
            self.state[rank] = "run"
        return progress


def predict(program: Program, fault: Fault) -> Expected | None:
    """What meshsim must raise when ``fault`` is injected; None if no report is certain."""
    if fault.kind == "raise":
        return Expected(meshsim.RankError, fault.rank)
    calls = [_sends_first(rank_calls(program, r, fault)) for r in range(program.world_size)]
    model = _Model(calls)
    model.run()
    try:
        if model.events:
            return _expect_mismatch(program, fault, model)
        return _expect_stall(program, fault, model)
    except _Uncertain:
        return None


def _sends_first(calls: list[CallSpec | str]) -> list[CallSpec | str]:
    """Within each point-to-point step, sends before receives: every style posts its
    sends before it waits for its first receive (the ledger's order differs by style)."""

    def step_of(call: CallSpec | str) -> object:
        return call.step if isinstance(call, CallSpec) and call.direction else object()

    out: list[CallSpec | str] = []
    for _, run in itertools.groupby(calls, key=step_of):
        out += sorted(run, key=lambda c: 0 if isinstance(c, CallSpec) and c.direction == "send" else 1)
    return out


def _expect_mismatch(program: Program, fault: Fault, model: _Model) -> Expected:
    options = []
    for event in model.events:
        if event[0] == "p2p":
            sent, recv = event[1], event[2]
            src, dst = recv.peer, sent.peer
            rows = ((src, sent.site), (dst, recv.site))
            options.append(Mismatch(sent.members, -1, ("exact", (src, dst)), rows, p2p=True))
        else:
            options.append(_slot_mismatch(program, fault, event[1], event[2], full=True))
    return Expected(meshsim.CollectiveMismatchError, fault.rank, mismatches=tuple(options))


def _slot_mismatch(
    program: Program, fault: Fault, slot: tuple[Any, int], arrived: dict[int, CallSpec], *, full: bool
) -> Mismatch:
    f = fault.rank
    if f not in arrived:
        raise _Uncertain()
    members, seq = arrived[f].members, slot[1]
    rows = tuple(sorted((r, c.site) for r, c in arrived.items()))
    others = [c for r, c in arrived.items() if r != f]
    if any(c.sig != arrived[f].sig for c in others):
        if len({c.sig for c in others}) > 1:
            raise _Uncertain()
        blame = ("exact", (f,)) if len(others) >= 2 else ("calls", ())
        return Mismatch(members, seq, blame, rows)
    if not full or not _designed_compat(fault, arrived[f]):
        raise _Uncertain()  # the calls differ only where meshsim may find they still fit
    return Mismatch(members, seq, _compat_blame(program, fault, members), rows)


def _designed_compat(fault: Fault, call: CallSpec) -> bool:
    return fault.kind in ("shape", "split") and call.step == fault.step


def _compat_blame(program: Program, fault: Fault, members: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """Whom a "do not fit together" error must blame for a shape or split fault.

    A split fault moves one row (element) of the faulty rank's sends from receiver a to
    receiver b: a and b each get a wrong amount from it, so it is in every problem and
    most blamed; but where a or b is itself (it then also expects the new amount from
    itself), one problem remains and the other receiver is as much to blame. A shape
    fault changes everything the faulty rank sends and expects: with 3+ ranks it is in
    most problems. Except: a non-root's shape in gather/scatter conflicts only with the
    root, and either may be the wrong one.
    """
    assert fault.replacement is not None
    f, n, kind = fault.rank, len(members), fault.replacement.kind
    if fault.kind == "split":
        me = members.index(f)
        old, new = program.steps[fault.step].splits[me], fault.replacement.splits[me]
        moved = [members[d] for d, (x, y) in enumerate(zip(old, new)) if x != y]
        if f not in moved:
            return ("exact", (f,))
        return ("within", (f, *moved))
    if kind in ("gather", "scatter") and members.index(f) != fault.replacement.root:
        return ("within", (f, members[fault.replacement.root]))
    return ("exact", (f,)) if n >= 3 else ("calls", ())


def _expect_stall(program: Program, fault: Fault, model: _Model) -> Expected | None:
    stuck = [r for r, s in enumerate(model.state) if s in ("slot", "recv")]
    if not stuck:
        return None  # nobody waits for the faulty rank: nothing to observe
    if fault.kind == "sleep":
        return Expected(meshsim.DeadlockError, fault.rank, timed_out=True)
    flagged = [
        (slot, arrived) for slot, arrived in model.slots.items() if len({c.sig for c in arrived.values()}) > 1
    ]
    if flagged:
        options = tuple(_slot_mismatch(program, fault, s, a, full=False) for s, a in flagged)
        return Expected(meshsim.CollectiveMismatchError, fault.rank, mismatches=options)
    rows, culprits = _deadlock_rows(model)
    if fault.rank not in culprits:
        raise _Uncertain()
    return Expected(meshsim.DeadlockError, fault.rank, rows=rows, culprits=culprits)


def _deadlock_rows(model: _Model) -> tuple[tuple[tuple[int, str], ...], tuple[int, ...]]:
    rows, culprits = [], set()
    for rank, state in enumerate(model.state):
        if state == "done":
            rows.append((rank, re.escape("finished: its function returned") + "$"))
            continue
        call = model.calls[rank][model.pos[rank]]
        assert isinstance(call, CallSpec)
        if state == "recv":
            culprits.add(call.peer)
            text = rf"waiting in recv\(.*\) from rank {call.peer} \(tag 0\) at {re.escape(call.site)}"
            rows.append((rank, text + r"(; unmatched messages to it: .*)?$"))
            continue
        slot = model.where[rank]
        missing = [r for r in call.members if r not in model.slots[slot]]
        culprits.update(missing)
        plural = "s" if len(missing) > 1 else ""
        text = (
            rf"waiting in .*, call #{slot[1]} of group {re.escape(str(list(call.members)))} "
            rf"at {re.escape(call.site)}; waiting for rank{plural} {', '.join(map(str, missing))}$"
        )
        rows.append((rank, text))
    return tuple(rows), tuple(sorted(culprits))


def check_error(error: BaseException, expected: Expected) -> list[str]:
    """How ``error`` falls short of ``expected`` (empty: it is exactly right)."""
    if type(error) is not expected.error:
        return [f"raised {type(error).__name__}, expected {expected}: {error}"]
    if isinstance(error, meshsim.RankError):
        return _check_rank_error(error, expected)
    if isinstance(error, meshsim.DeadlockError):
        return _check_deadlock(error, expected)
    assert isinstance(error, meshsim.CollectiveMismatchError)
    failures = [_check_mismatch(error, m) for m in expected.mismatches]
    if all(failures):
        return [f"none of the correct reports matches: {failures}"]
    return []


def _check_rank_error(error: meshsim.RankError, expected: Expected) -> list[str]:
    problems = []
    if error.rank != expected.rank:
        problems.append(f"RankError names rank {error.rank}, expected {expected.rank}")
    if not isinstance(error.__cause__, InjectedFault):
        problems.append(f"__cause__ is {error.__cause__!r}, expected the injected fault")
    line = SITES["raise"].split(":")[1].split(" ")[0]
    if f'runs.py", line {line}, in _raise_fault' not in str(error):
        problems.append("the traceback does not show the raising line")
    return problems


def _check_deadlock(error: meshsim.DeadlockError, expected: Expected) -> list[str]:
    message = str(error)
    if error.timed_out != expected.timed_out:
        return [f"timed_out={error.timed_out}, expected {expected.timed_out}: {message}"]
    if expected.timed_out:
        f = expected.rank
        problems = [] if error.ranks == (f,) else [f"timeout names busy ranks {error.ranks}, expected ({f},)"]
        if f"  rank {f}: running its own code\n" not in message or "in _sleep_fault" not in message:
            problems.append(f"the timeout does not show rank {f} running in _sleep_fault: {message}")
        return problems
    problems = (
        [] if error.ranks == expected.culprits else [f"ranks {error.ranks}, expected {expected.culprits}"]
    )
    for rank, pattern in expected.rows:
        if not re.search(rf"^  rank {rank}: {pattern}", message, re.MULTILINE):
            problems.append(f"no row for rank {rank} matching {pattern!r}")
    return problems + ([message] if problems else [])


def _check_mismatch(error: meshsim.CollectiveMismatchError, want: Mismatch) -> str:
    message = str(error)
    how, ranks = want.blame
    if tuple(error.group) != want.group or (not want.p2p and error.seq != want.seq):
        return f"slot {error.group}#{error.seq}, expected {want.group}#{want.seq}"
    if how == "exact" and tuple(error.ranks) != ranks:
        return f"blames {error.ranks}, expected {ranks}"
    if how == "within" and not (ranks[0] in error.ranks and set(error.ranks) <= set(ranks)):
        return f"blames {error.ranks}, expected rank {ranks[0]} within {ranks}"
    for rank, site in want.rows:
        if rank not in error.calls:
            return f"rank {rank} missing from .calls {error.calls}"
        if not re.search(rf"^  rank {rank}: .*  at {re.escape(site)}", message, re.MULTILINE):
            return f"no row for rank {rank} at {site}"
    return ""


def draw_fault(
    src: Source,
    program: Program,
    *,
    kinds: Sequence[str] = FAULT_KINDS,
    tries: int = 3,
    places: int = 12,
    gloo: bool = False,
) -> tuple[Fault, Expected]:
    """A fault meshsim must report, with the report.

    Picks a kind, then looks for a rank and step where a fault of that kind must be
    observed (``places`` tries); ``tries`` kinds at most, then a ``raise`` (always
    observable). Picking the kind first keeps the kinds evenly represented.
    """
    for _ in range(tries):
        kind = choose(src, kinds)
        for _ in range(places):
            rank = src.integer(0, program.world_size - 1)
            index = src.integer(0, len(program.steps) - 1)
            fault = build_fault(src, program, kind, rank, index)
            if fault is None:
                continue
            expected = predict(program, fault)
            if expected is not None:
                return fault, expected
    fault = Fault("raise", src.integer(0, program.world_size - 1), src.integer(0, len(program.steps) - 1))
    return fault, Expected(meshsim.RankError, fault.rank)


def build_fault(src: Source, program: Program, kind: str, rank: int, index: int) -> Fault | None:
    """The fault ``kind`` on ``rank`` at step ``index``, or None where it does not apply."""
    step = program.steps[index]
    if kind in ("raise", "return", "skip", "sleep"):
        return Fault(kind, rank, index)
    if kind == "swap":
        return Fault(kind, rank, index) if index + 1 < len(program.steps) else None
    members = program.members(step.group, rank)
    if members is None:
        return None
    builder = _REPLACEMENTS[kind]
    instead = builder(src, program, step, members, rank)
    return Fault(kind, rank, index, instead) if instead is not None else None


Replacement = Callable[[Source, Program, Step, tuple[int, ...], int], Step | None]


def _other_dtype(
    src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int
) -> Step | None:
    if step.kind in ("barrier", *OBJECT_KINDS):
        return None
    options = [d for d in DTYPES if d != step.dtype and (step.op is None or step.op in ops_for(d))]
    return replace(step, dtype=choose(src, options))


def _other_shape(
    src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int
) -> Step | None:
    if step.kind in ("barrier", *OBJECT_KINDS):
        return None
    if step.kind in ("all_gather", "reduce_scatter"):
        return replace(step, sizes=tuple(s + 1 for s in step.sizes))
    if step.kind == "all_to_all":
        return replace(step, splits=tuple(tuple(s + 1 for s in row) for row in step.splits))
    if step.kind == "all_to_all_single":
        return replace(step, shape=(step.shape[0] + 1,) if step.shape else (2,))
    return replace(step, shape=(step.shape[0] + 1, *step.shape[1:]))


def _other_op(src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int) -> Step | None:
    if step.kind not in REDUCING:
        return None
    options = [op for op in ops_for(step.dtype) if op != step.op]
    if step.style == "funcol":
        options = [op for op in options if op != "PREMUL_SUM"]
    return replace(step, op=choose(src, options))


def _other_root(
    src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int
) -> Step | None:
    if step.kind not in ROOTED or len(members) < 2:
        return None
    return replace(step, root=choose(src, [r for r in range(len(members)) if r != step.root]))


def _other_group(
    src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int
) -> Step | None:
    if step.kind not in REGROUPABLE:
        return None
    options = [ref for ref in program.refs() if ref != step.group and program.members(ref, rank) is not None]
    if not options:
        return None
    ref = choose(src, options)
    size = len(program.subgroups(ref)[0])
    return replace(step, group=ref, root=step.root if step.root < size else 0)


def _other_split(
    src: Source, program: Program, step: Step, members: tuple[int, ...], rank: int
) -> Step | None:
    if step.kind not in ("all_to_all_single", "all_to_all") or len(members) < 2:
        return None
    me = members.index(rank)
    row = list(step.splits[me])
    sources = [d for d, s in enumerate(row) if s > 0]
    if not sources:
        return None
    a = choose(src, sources)
    b = choose(src, [d for d in range(len(row)) if d != a])
    row[a] -= 1
    row[b] += 1
    splits = tuple(tuple(row) if i == me else r for i, r in enumerate(step.splits))
    return replace(step, splits=splits)


_REPLACEMENTS: dict[str, Replacement] = {
    "dtype": _other_dtype,
    "shape": _other_shape,
    "op": _other_op,
    "root": _other_root,
    "group": _other_group,
    "split": _other_split,
}


@dataclass(frozen=True)
class Case:
    """One generated case: a program, an optional fault and what meshsim must report."""

    program: Program
    fault: Fault | None = None
    expected: Expected | None = None
    serialize: bool = True

    def __str__(self) -> str:
        fault = f"\nfault: {self.fault}\nexpected: {self.expected}" if self.fault else ""
        return f"{self.program}\nserialize={self.serialize}{fault}"


def draw_case(
    src: Source,
    *,
    kinds: Sequence[str] = (),
    gloo: bool = False,
    max_world: int = 8,
    max_steps: int = 8,
) -> Case:
    """A program and, when fault ``kinds`` are given, a fault of one of them that meshsim must report.

    Keyword args:
        kinds: the fault kinds to choose from; none: a correct program (1+ ranks), else 2+ ranks.
        gloo: only what ProcessGroupGloo supports.
    """
    program = draw_program(
        src,
        gloo=gloo,
        min_world=2 if kinds else 1,
        max_world=max_world,
        max_steps=max_steps,
    )
    serialize = bool(src.integer(0, 3)) or gloo  # mostly the default, sometimes free-running
    if not kinds:
        return Case(program, serialize=serialize)
    fault, expected = draw_fault(src, program, kinds=kinds, gloo=gloo)
    return Case(program, fault, expected, serialize)
