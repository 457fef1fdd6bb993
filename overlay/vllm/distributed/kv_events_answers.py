# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The replay socket's answers, sent at the pace each client reads them.

The replay socket (a ZMQ ROUTER) faces clients that nobody authenticates:
a client may ask and never read. ZMQ would queue a whole answer (a replay of
``buffer_steps`` batches, a snapshot of a million keys) in the engine's
process for such a client, and drop what passes the socket's high-water
mark without a word. Here each answer is sent a message at a time while the
client's queue has room (``ROUTER_MANDATORY`` with a small send high-water
mark): at most ``HWM`` messages wait in the engine for one client, and a
client that reads nothing for ``STALL_S`` is cut off with an end that says
why. Every request gets exactly one end, to its own client.

A cut-off client that stays connected still holds what was queued for it,
and clients are not counted: what all of them together may hold unread is
bounded by ``HELD_MAX_BYTES``. Each connection counts the last ``HWM`` + 1
messages sent to it (its queue and the one ZMQ is writing to the kernel)
until it is seen closed; at the bound, answers wait and new ones are
refused. A connection is known by its file descriptor (ZMQ's ``SRCFD`` of
a request) and that socket's inode: once the descriptor is closed or holds
another socket, the connection is gone. That is checked every ``SWEEP_S``,
not told by a socket monitor, whose events can arrive after the requests
of the connection they describe.

This file imports only the standard library and pyzmq (the consumer's wheel
and the record process stay free of vLLM and torch).
"""

import errno
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import zmq

# The frames after a client's id: (b"", topic, seq, payload) for a batch,
# (b"", b"", END_SEQ, reply) for an end.
Frames = tuple[bytes, ...]

# A request's quoted bytes in an error reply or a log line, at most.
QUOTE_BYTES = 200


def quote(value: object) -> str:
    """A client's request, or a value from one, as errors and logs show it:
    at most QUOTE_BYTES characters of its repr."""
    if isinstance(value, list) and all(isinstance(f, bytes) for f in value):
        value = [frame[:QUOTE_BYTES] for frame in value[:4]]
    elif isinstance(value, bytes):
        value = value[: QUOTE_BYTES + 1]
    shown = repr(value)
    return shown if len(shown) <= QUOTE_BYTES else shown[: QUOTE_BYTES - 3] + "..."


@dataclass
class _Answer:
    client_id: bytes
    # Batches known so far; ``more`` yields the rest lazily (a replay's
    # buffer), the record process adds a snapshot's with ``add``.
    queued: deque[Frames]
    more: Iterator[Frames] | None
    # The end, once known: a snapshot's comes from the record process.
    end: Frames | None
    # The record's request id, for a snapshot; None for anything else.
    request_id: int | None
    progress_at: float
    cut_off: bool = False
    # Sends tried in the current pump.
    tries: int = field(default=0)


class ReplayAnswers:
    """Every answer under way on one ROUTER socket, sent by ``pump`` a few
    messages per call between live batches."""

    # Messages that may wait in the engine for one client (the socket's
    # SNDHWM); with the record's window, what one slow reader can hold.
    HWM = 8
    # A client that has read nothing for this long is cut off; its end
    # then waits for room for up to END_WAIT_S more, and is dropped.
    STALL_S = 10.0
    END_WAIT_S = 60.0
    # Sends tried per pump, whether the client had room or not: a live
    # batch waits at most for these, however many answers are under way.
    SEND_PER_PUMP = 16
    # What every client together may hold unread (counted as above); past
    # it only ends are sent, which are small and at most HWM a client.
    HELD_MAX_BYTES = 64 * 2**20
    # How often the connections counted are checked for closed ones.
    SWEEP_S = 1.0

    def __init__(
        self,
        socket: zmq.Socket,
        end: Callable[[dict], Frames],
        on_sent: Callable[[int], None],
        on_dropped: Callable[[int], None],
    ) -> None:
        """``end`` makes the end frames of a reply map; ``on_sent`` is told
        of each snapshot batch passed on, ``on_dropped`` of each snapshot
        whose client is gone or cut off (request id)."""
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.setsockopt(zmq.SNDHWM, self.HWM)
        self._socket = socket
        self._end = end
        self._on_sent = on_sent
        self._on_dropped = on_dropped
        self._answers: deque[_Answer] = deque()
        # Per client, the sizes of the last HWM + 1 messages sent to it, and
        # its connection, (file descriptor, inode), while it is open.
        self._held: dict[bytes, deque[int]] = {}
        self._held_bytes = 0
        # Whether a message was held back by HELD_MAX_BYTES since a
        # connection was last let go: new answers wait for that.
        self._held_back = False
        self._connection: dict[bytes, tuple[int, int]] = {}
        self._swept_at = time.monotonic()

    def __len__(self) -> int:
        return len(self._answers)

    def pending(self, client_id: bytes) -> int:
        """Answers under way to ``client_id``, ends alone included."""
        return sum(a.client_id == client_id for a in self._answers)

    def busy(self, max_answers: int) -> str | None:
        """Why a new answer with batches (a replay, a snapshot) must be
        refused: ``max_answers`` of them under way, or clients holding
        HELD_MAX_BYTES unread; None if it may start."""
        carrying = sum(
            a.more is not None or bool(a.queued) or a.request_id is not None
            for a in self._answers
        )
        if carrying >= max_answers:
            return f"busy: {max_answers} answers are under way"
        if self._held_back:
            return (
                f"busy: clients have not read {self._held_bytes / 2**20:.0f} MiB "
                f"of answers (at most {self.HELD_MAX_BYTES / 2**20:.0f} MiB)"
            )
        return None

    def receive(self) -> list[bytes]:
        """The next request's frames, the client's id first, read one at a
        time: past the fourth they are dropped as they are read, so a
        request of many frames is never held whole."""
        self._sweep()
        first = self._socket.recv(copy=False)
        frames = [first.bytes]
        while self._socket.getsockopt(zmq.RCVMORE):
            frame = self._socket.recv()
            if len(frames) < 4:
                frames.append(frame)
        try:
            fd = first.get(zmq.SRCFD)
        except zmq.ZMQError:  # inproc: no descriptor, and it is not counted
            fd = -1
        if (connection := _connection(fd)) is not None:
            self._connection[frames[0]] = connection
        return frames

    def start(
        self,
        client_id: bytes,
        batches: Iterator[Frames] | None = None,
        end: Frames | None = None,
        request_id: int | None = None,
    ) -> None:
        """Answer ``client_id`` with ``batches`` then ``end`` (for a snapshot,
        ``request_id`` and no end: the record sends both later)."""
        self._answers.append(
            _Answer(client_id, deque(), batches, end, request_id, time.monotonic())
        )

    def reply(self, client_id: bytes, reply: dict) -> None:
        """An answer that is only an end carrying ``reply``."""
        self.start(client_id, end=self._end(reply))

    def add(self, request_id: int, frames: Frames) -> None:
        """A snapshot batch from the record (dropped if its answer is)."""
        if (answer := self._find(request_id)) is not None:
            answer.queued.append(frames)
            answer.progress_at = time.monotonic()

    def finish(self, request_id: int, reply: dict) -> None:
        """A snapshot's end: the record's, or a refusal of a snapshot it will
        not finish (what it sent stays queued); once per answer."""
        if (answer := self._find(request_id)) is not None and answer.end is None:
            answer.end = self._end(reply)
            answer.request_id = None

    def owed_by_record(self, overdue_s: float = 0.0) -> list[int]:
        """The request ids of snapshots whose end the record owes; with
        ``overdue_s``, only those waiting on it (nothing left to send) that
        have had nothing from it nor sent anything for that long."""
        now = time.monotonic()
        return [
            a.request_id
            for a in self._answers
            if a.request_id is not None
            and (not overdue_s or (not a.queued and now - a.progress_at > overdue_s))
        ]

    def _find(self, request_id: int) -> _Answer | None:
        for answer in self._answers:
            if answer.request_id == request_id:
                return answer
        return None

    def pump(self) -> bool:
        """Send what each client has room for, in turn, trying up to
        SEND_PER_PUMP sends; True if that ran out while clients took what
        was sent (more may go now). A client with no room never makes this
        True: the publisher would spin on it."""
        self._sweep()
        budget = self.SEND_PER_PUMP
        now = time.monotonic()
        sent = False
        for _ in range(len(self._answers)):
            answer = self._answers.popleft()
            keep = self._send(answer, now, budget)
            budget -= answer.tries
            answer.tries = 0
            sent |= answer.progress_at == now
            if keep:
                self._answers.append(answer)
            if budget <= 0:
                return sent
        return False

    def _send(self, answer: _Answer, now: float, budget: int) -> bool:
        """Send ``answer``'s next messages while its client has room; False
        once it is done or dropped."""
        while answer.tries < budget:
            frames = self._next(answer)
            if frames is None:
                return True  # waiting for the record
            answer.tries += 1
            size = sum(map(len, frames))
            if (
                frames is not answer.end
                and self._held_bytes + size > self.HELD_MAX_BYTES
            ):
                self._held_back = True
                return self._stalled(answer, now)
            try:
                self._socket.send_multipart((answer.client_id, *frames), zmq.NOBLOCK)
            except zmq.Again:
                return self._stalled(answer, now)
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self._drop(answer)  # the client is gone
                return False
            answer.progress_at = now
            self._count(answer.client_id, size)
            if frames is answer.end:
                return False
            if answer.queued:
                answer.queued.popleft()
            if answer.request_id is not None:
                self._on_sent(answer.request_id)
        return True

    def _next(self, answer: _Answer) -> Frames | None:
        if not answer.queued and answer.more is not None:
            frames = next(answer.more, None)
            if frames is None:
                answer.more = None
            else:
                answer.queued.append(frames)
        if answer.queued:
            return answer.queued[0]
        return answer.end

    def _stalled(self, answer: _Answer, now: float) -> bool:
        """The client's queue is full: cut it off after STALL_S, and give up
        its end after END_WAIT_S more."""
        idle = now - answer.progress_at
        if answer.cut_off:
            return idle < self.END_WAIT_S
        if idle < self.STALL_S:
            return True
        self._drop(answer)
        answer.cut_off = True
        answer.queued.clear()
        answer.more = None
        answer.end = self._end(
            {
                "status": "refused",
                "reason": f"cut off: the client read nothing for {self.STALL_S:g} s",
            }
        )
        return True

    def _count(self, client_id: bytes, size: int) -> None:
        if client_id not in self._connection:
            return  # its connection closed since: ZMQ drops what was sent
        held = self._held.setdefault(client_id, deque())
        if len(held) > self.HWM:
            self._held_bytes -= held.popleft()
        held.append(size)
        self._held_bytes += size

    def _sweep(self) -> None:
        """Every SWEEP_S, let go of the counts of closed connections."""
        now = time.monotonic()
        if now - self._swept_at < self.SWEEP_S:
            return
        self._swept_at = now
        for client_id, (fd, inode) in list(self._connection.items()):
            if _connection(fd) != (fd, inode):
                del self._connection[client_id]
                if held := self._held.pop(client_id, None):
                    self._held_bytes -= sum(held)
                    self._held_back = False

    def _drop(self, answer: _Answer) -> None:
        if answer.request_id is not None:
            self._on_dropped(answer.request_id)
            answer.request_id = None


def _connection(fd: int) -> tuple[int, int] | None:
    """The connection on file descriptor ``fd`` now: the descriptor and its
    socket's inode (another socket on a reused descriptor has another);
    None if it is closed."""
    try:
        return fd, os.fstat(fd).st_ino
    except OSError:
        return None
