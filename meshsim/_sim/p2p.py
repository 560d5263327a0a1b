"""Point to point: sends are buffered, receives wait, messages are matched in order per (src, dst, tag).

A send copies its tensors into a :class:`Message` and returns at once, as gloo's
does; a receive posts a :class:`PostedRecv` and returns a pending Work
(:class:`meshsim._sim.work.ReceiveWork`) whose ``wait()`` blocks cooperatively, so
``batch_isend_irecv`` and receive-before-send patterns work. Each group's
messages meet in its :class:`Mailbox`; a message that does not fit its receive
(dtype, element count) fails that receive with a table naming both ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshsim._base.errors import CollectiveMismatchError
from meshsim._base.waits import Blocking, Waitable
from meshsim._record import ledger as _ledger
from meshsim._record.ledger import Collective
from meshsim._sim.collectives import descs, dtype_of, nbytes, write

__all__ = ["Endpoint", "Mailbox", "Message", "PostedRecv"]

Tensor = torch.Tensor


@dataclass(eq=False)
class Message:
    """A buffered send: copies of the tensors, and where they were sent from."""

    src: int  # group ranks
    dst: int
    tag: int
    tensors: list[Any]
    text: str
    site: str


class PostedRecv(Waitable):
    """A receive waiting for its message."""

    def __init__(
        self,
        mailbox: Mailbox,
        dst: int,
        src: int | None,
        tag: int,
        tensors: list[Any],
        text: str,
        site: str,
        deliver: Callable[[Message, PostedRecv], str | None],
    ) -> None:
        super().__init__()
        self.mailbox = mailbox
        self.dst = dst
        self.src = src
        self.tag = tag
        self.tensors = tensors
        self.text = text
        self.site = site
        self.deliver = deliver
        self.source: int | None = None  # the group rank the message came from

    def matches(self, message: Message) -> bool:
        return (
            message.dst == self.dst
            and message.tag == self.tag
            and (self.src is None or message.src == self.src)
        )

    def describe(self, rank: int) -> str:
        ranks = self.mailbox.ranks
        queued = [m for m in self.mailbox.queued if m.dst == self.dst]
        note = ""
        if queued:
            parts = [f"from rank {ranks[m.src]} with tag {m.tag} ({m.text} at {m.site})" for m in queued]
            note = "; unmatched messages to it: " + ", ".join(parts)
        return f"waiting in {self.text} at {self.site}{note}"

    def missing(self) -> tuple[int, ...]:
        ranks = self.mailbox.ranks
        if self.src is not None:
            return (ranks[self.src],)
        return tuple(r for i, r in enumerate(ranks) if i != self.dst)


class Mailbox:
    """The point-to-point messages of one group, matched in order per (src, dst, tag)."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks  # the group's global ranks
        self.queued: list[Message] = []
        self.posted: list[PostedRecv] = []

    def send(self, message: Message, scheduler: Blocking) -> None:
        """Deliver ``message`` to a waiting receive, or queue it. Call with the lock held."""
        for recv in self.posted:
            if recv.matches(message):
                self.posted.remove(recv)
                self._deliver(message, recv, scheduler)
                return
        self.queued.append(message)

    def post(self, recv: PostedRecv, scheduler: Blocking) -> None:
        """Match ``recv`` with a queued message, or leave it waiting. Call with the lock held."""
        for message in self.queued:
            if recv.matches(message):
                self.queued.remove(message)
                self._deliver(message, recv, scheduler)
                return
        self.posted.append(recv)

    def _deliver(self, message: Message, recv: PostedRecv, scheduler: Blocking) -> None:
        recv.source = message.src
        problem = recv.deliver(message, recv)
        if problem is not None:
            ranks = self.ranks
            src, dst = ranks[message.src], ranks[recv.dst]
            text = (
                f"send and recv do not fit together in group {list(self.ranks)}: {problem}\n"
                f"  rank {src}: {message.text}  at {message.site}\n"
                f"  rank {dst}: {recv.text}  at {recv.site}\n"
                "A recv must receive the dtype and number of elements that the matching send sent."
            )
            recv.error = CollectiveMismatchError(
                text,
                group=ranks,
                ranks=(src, dst),
                calls={src: message.text, dst: recv.text},
            )
        scheduler.wake(recv)


class Endpoint:
    """One rank's end of a group's point-to-point traffic: its sends, receives and their ledger entries.

    Args:
        mailbox: the group's mailbox.
        ranks: the group's global ranks.
        group_rank: the caller's rank in the group.
        scheduler: the world's scheduler (sends and receives take its lock).
    """

    def __init__(
        self, mailbox: Mailbox, ranks: tuple[int, ...], group_rank: int, scheduler: Blocking
    ) -> None:
        self.mailbox = mailbox
        self.ranks = ranks
        self.group_rank = group_rank
        self.scheduler = scheduler
        self.seq: dict[tuple[str, int], int] = {}  # messages so far, per direction and peer
        self.seq_base: dict[tuple[str, int], int] = {}  # what ledgers count from

    def send(self, tensors: list[Tensor], dst: int, tag: int, where: tuple[str, str | None]) -> None:
        """Buffer copies of ``tensors`` for group rank ``dst``; returns at once.

        ``where``: the user's line and the library line that made the call (see
        :func:`meshsim._record.sites.where_of`).
        """
        self._record("send", dst, tensors, where)
        site = where[0]
        text = f"send({descs(tensors)}, dst={self.ranks[dst]}, tag={tag})"
        with torch.no_grad():
            copies = [t.detach().clone() for t in tensors]
        message = Message(self.group_rank, dst, tag, copies, text, site)
        with self.scheduler:
            self.scheduler.raise_if_aborted()
            self.mailbox.send(message, self.scheduler)

    def receive(
        self, tensors: list[Tensor], src: int | None, tag: int, where: tuple[str, str | None]
    ) -> PostedRecv:
        """Post a receive into ``tensors`` from group rank ``src`` (None: any); returns it."""
        self._record("recv", src, tensors, where)
        site = where[0]
        who = "any rank" if src is None else f"rank {self.ranks[src]}"
        text = f"recv({descs(tensors)}) from {who} (tag {tag})"
        recv = PostedRecv(self.mailbox, self.group_rank, src, tag, tensors, text, site, deliver)
        with self.scheduler:
            self.scheduler.raise_if_aborted()
            self.mailbox.post(recv, self.scheduler)
        return recv

    def restart_numbering(self) -> None:
        self.seq_base = dict(self.seq)

    def _record(
        self, op: str, peer: int | None, tensors: list[Tensor], where: tuple[str, str | None]
    ) -> None:
        key = (op, -1 if peer is None else peer)
        seq = self.seq.get(key, 0)
        self.seq[key] = seq + 1
        if _ledger.is_recording():
            seq -= self.seq_base.get(key, 0)
            n = nbytes(tensors)
            sent, received = (n, 0) if op == "send" else (0, n)
            peer_rank = None if peer is None else self.ranks[peer]
            entry = Collective(
                op,
                op,
                self.ranks,
                dtype_of(tensors),
                sent,
                received,
                None,
                seq,
                where[0],
                peer_rank,
                via=where[1],
            )
            _ledger.append(entry)


@torch.no_grad()
def deliver(message: Message, recv: PostedRecv) -> str | None:
    """Copy a message into its receive (as a process group writes it), or say why they do not fit."""
    if len(message.tensors) != len(recv.tensors):
        return f"{len(message.tensors)} tensors sent, {len(recv.tensors)} expected"
    for sent, into in zip(message.tensors, recv.tensors):
        if sent.dtype != into.dtype or sent.numel() != into.numel():
            return f"sent {_desc(sent)}, receiving into {_desc(into)}"
    for sent, into in zip(message.tensors, recv.tensors):
        write(into.detach(), sent.reshape(into.shape))
    return None


def _desc(t: Tensor) -> str:
    return descs([t])
