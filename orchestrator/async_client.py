"""``AsyncClient``: many requests in flight on one DEALER, answered in any order."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import math
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog
import zmq
import zmq.asyncio

from orchestrator.abandoned_ids import AbandonedIds
from orchestrator.client_wire import (
    CANCEL_SEND_S,
    GRACE_S,
    CancelTokens,
    Generation,
    Lost,
    Reply,
    Unreadable,
    cancel_body,
    cancel_found,
    daemon_endpoint,
    read_reply,
    submit_body,
    wait_s,
)
from orchestrator.connection_watch import ConnectionWatch, closed_why
from orchestrator.deadlines import checked_s
from orchestrator.rejection import answer_as
from transfer.protocol import Cancelled, GenParams, Progress, Rejected

log = structlog.get_logger()

# What hears a request's progress: a function, or a coroutine function (awaited, say to
# stream the progress to a web client).
OnProgress = Callable[[Progress], None | Awaitable[None]]

# Progress messages waiting for a slow ``on_progress``; past it, the newest ones are dropped
# (progress is advisory). The answer never waits behind them (``_Pending.answer``).
PROGRESS_BACKLOG = 16
# pyzmq hands over a message already queued without suspending the reader: it lets the
# loop run at least once every this many replies, or a steady stream of them (many requests
# in flight, their progress) would hold the loop, and the waiting submits and every other
# task on it would not run until the stream paused.
REPLIES_PER_TURN = 16
# How often an AsyncClient with no daemon connected looks for requests that waited NO_DAEMON_S.
WATCH_S = 0.25


class _AbandonableContext(zmq.asyncio.Context):
    """The context of a client never closed (opened in a startup hook whose shutdown hook
    never ran, say) is collected with its sockets, in an order of the collector's choosing:
    pyzmq's own finalizer then finds no socket left to close and waits in ``term()`` for
    ever for those not collected yet, freezing the process at a random collection. This one
    ends on a thread of its own, done once the sockets' own finalizers have closed them, and
    warns as pyzmq's does."""

    def __del__(self) -> None:
        if self.closed or sys.is_finalizing():
            return  # (no new thread at the interpreter's end, whose exit closes everything)
        threading.Thread(target=zmq.asyncio.Context.__del__, args=(self,), name="triptych-client-abandoned",
                         daemon=True).start()


async def _cancel_at_daemon(sock: zmq.asyncio.Socket, request_ids: list[str], tokens: CancelTokens) -> int:
    """Send a ``Cancel`` for each of ``request_ids`` given up on, whatever cancels the caller,
    within ``CANCEL_SEND_S``; how many left. Nothing awaits the answers."""
    sent = 0
    with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_SEND_S):
        for rid in request_ids:
            try:
                await sock.send_multipart([b"", tokens.cancel_frame(rid)])
            except asyncio.CancelledError:
                # Closing the client closes the socket, which cancels a send still waiting:
                # the end of these Cancels, not a cancellation of the caller's task.
                if not sock.closed:
                    raise
                break
            sent += 1
    return sent


def _dealer_reply(parts: list[bytes], endpoint: str) -> Reply:
    """The reply a DEALER received: the empty delimiter, then what ``read_reply`` reads;
    ``ValueError`` as it raises."""
    if parts[:1] != [b""]:
        raise ValueError(f"{endpoint} is not a Triptych client socket: its answer is unreadable (a reply without "
                         "the empty delimiter frame first)")
    return read_reply(parts[1:], endpoint)


@dataclass(slots=True)
class _Pending:
    """One ``submit`` under way, from its start to its end, answered or not."""

    progress: anyio.abc.ObjectSendStream[Progress] | None  # while it waits: its Progress, in order
    answer: Generation | Rejected | Lost | Unreadable | None = None  # taken ahead of any progress queued
    sent_at: float | None = None  # once its send began (it may still wait in ZMQ's queue): when
    generation: int = 0  # and on which socket (``AsyncClient._generation``)
    sending: anyio.CancelScope | None = None  # while its send waits
    sent: bool = False  # once ZMQ took it

    @property
    def waiting(self) -> bool:
        return self.progress is not None


def _drop(future: asyncio.Future[list[bytes]]) -> None:
    """Stop waiting on ``future``; an error it already holds is taken, not logged as lost."""
    if future.done() and not future.cancelled():
        future.exception()
    future.cancel()


class AsyncClient:
    """DEALER client: any number of requests in flight, answered in any order. A request whose
    ``submit`` is cancelled (the caller gave up), or still waits when the client is closed,
    is cancelled at the daemon too. ``submit``'s ``on_progress`` (a function or a coroutine
    function) gets the request's ``Progress`` messages, called (and awaited) in the task
    awaiting ``submit``; if it raises, the request is cancelled at the daemon and ``submit``
    raises that. Once the answer is in, progress still queued is skipped: a slow listener
    delays the answer by at most the call under way, and a deadline that runs out in it
    after the answer came returns the answer.

    Use as ``async with AsyncClient(endpoint) as client: await client.submit(...)``, opened
    and closed in one task: its reader runs in an anyio task group, which belongs to the
    task that opened it (in a web app, open it in the lifespan context, not in separate
    startup and shutdown hooks), and serves that task's event loop only (one per thread
    that runs a loop), an asyncio one (not trio). A closed client cannot be opened again,
    nor used (make a new one); closing it again does nothing.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = daemon_endpoint(endpoint)
        self._tokens = CancelTokens()
        self._ctx: zmq.asyncio.Context | None = None  # from opening to closing
        self._sock: zmq.asyncio.Socket | None = None
        self._watch: ConnectionWatch | None = None
        # Submits under way, by id. A send may wait: a DEALER queues SNDHWM messages (1,000)
        # for a daemon that is not there, and past that a send waits; a request failed
        # meanwhile, or a client closed, stops it.
        self._pending: dict[str, _Pending] = {}
        # The socket's number: a new one replaces it when its connection closes (_replace_socket).
        self._generation = 0
        self._abandoned = AbandonedIds()  # the ids of requests given up on, while an answer may come
        self._tg: anyio.abc.TaskGroup | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cancelling: set[zmq.asyncio.Socket] = set()  # cancel()'s own sockets, while in use

    async def __aenter__(self) -> AsyncClient:
        if self._ctx is not None:
            raise RuntimeError("this AsyncClient was opened before: make a new one")
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, under anyio or not
            raise RuntimeError("AsyncClient runs on asyncio (its sockets are pyzmq's asyncio ones): under anyio, "
                               "run the asyncio backend") from None
        self._ctx = _AbandonableContext()
        try:
            self._sock, self._watch = self._connect()  # a malformed endpoint raises here
            self._tg = anyio.create_task_group()
            await self._tg.__aenter__()
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._tg.start_soon(self._read)
        self._tg.start_soon(self._watch_connection)
        return self

    def _connect(self) -> tuple[zmq.asyncio.Socket, ConnectionWatch]:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        watch = ConnectionWatch(sock)
        try:
            sock.connect(self.endpoint)
        except BaseException:
            watch.close()
            sock.close(linger=0)
            raise
        return sock, watch

    async def __aexit__(self, *exc: object) -> None:
        if self._sock is None:
            return  # never opened, or closed already: nothing to close (as Client.close again)
        assert self._tg is not None and self._ctx is not None
        self._tg.cancel_scope.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            # The owner task's own cancellation (Ctrl-C under asyncio.run, a failing sibling)
            # surfaces above, once its reader has ended: the client still closes, or its
            # waiting submits would hang to their deadlines, unread, and its sockets leak.
            await self._close()

    async def _close(self) -> None:
        assert self._ctx is not None and self._sock is not None and self._watch is not None
        self._watch.close()
        sock, self._sock = self._sock, None
        for pending in self._pending.values():
            if pending.sending is not None:
                pending.sending.cancel()
        # A request still waiting would be answered to nobody: cancel it at the daemon too
        # (one whose send is still waiting was never sent: it has nothing to cancel).
        waiting = {rid: pending for rid, pending in self._pending.items() if pending.waiting}
        await _cancel_at_daemon(sock, [rid for rid, pending in waiting.items() if pending.sending is None],
                                self._tokens)
        for pending in waiting.values():
            assert pending.progress is not None
            pending.progress.close()  # a submit still waiting raises ConnectionError now, not at its deadline
        # The Cancels (these, and those of requests given up on) get CANCEL_SEND_S to leave,
        # on a thread of its own: the context's end waits for them while the daemon is
        # unreachable, and this loop must not. A cancel() under way fails at once.
        sock.close(linger=round(CANCEL_SEND_S * 1000))
        for side in self._cancelling:
            side.close(linger=0)
        threading.Thread(target=self._ctx.term, name="triptych-client-close", daemon=True).start()

    def _open(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            if self._ctx is not None:  # opened once, so closed since
                raise RuntimeError("this AsyncClient was closed: make a new one")
            raise RuntimeError("use the client inside `async with AsyncClient(endpoint) as client:`")
        if asyncio.get_running_loop() is not self._loop:
            # Its reader runs on that loop: answers would never reach a wait on another.
            raise RuntimeError("an AsyncClient serves the event loop (thread) that opened it: open one per loop")
        return self._sock

    async def _read(self) -> None:
        for read in itertools.count(1):
            if read % REPLIES_PER_TURN == 0:
                await anyio.lowlevel.checkpoint()
            sock, generation = self._sock, self._generation
            assert sock is not None
            try:
                parts = await sock.recv_multipart()
            except asyncio.CancelledError:
                if sock.closed and sock is not self._sock:
                    continue  # replaced (its close cancels this receive): read the new one
                raise
            try:
                reply = _dealer_reply(parts, self.endpoint)
            except ValueError as exc:
                if not self._fail_connection(generation, Unreadable(str(exc))):
                    # Nobody waits to be told: a trace of it for whoever reads the logs.
                    log.warning("client.unreadable_reply", endpoint=self.endpoint, error=str(exc))
                continue
            if isinstance(reply, Rejected) and not reply.request_id:
                self._fail_connection(generation, reply)
                continue
            if isinstance(reply, Progress):
                pending = self._pending.get(reply.request_id)
                waiter = pending.progress if pending is not None else None
                if waiter is not None and waiter.statistics().current_buffer_used < PROGRESS_BACKLOG:
                    # Its submit may have given up, its listener gone, while the Cancel leaves.
                    with contextlib.suppress(anyio.BrokenResourceError):
                        waiter.send_nowait(reply)
                continue
            if isinstance(reply, Cancelled):
                # The ack of an abandoned request's Cancel (cancel() reads its own).
                self._abandoned.cancel_answered(reply.request_id, found=reply.found)
                continue
            rid = reply.result.request_id if isinstance(reply, Generation) else reply.request_id
            if not self._abandoned.drop(rid):  # else the end of a request given up on
                self._answer(rid, reply)

    def _fail_connection(self, generation: int, answer: Rejected | Unreadable) -> int:
        """End the wait of every request sent on socket ``generation`` with ``answer``. An
        answer that names no request (unreadable, or a Rejected with no id: the daemon's
        control or worker socket answers every request so) says the peer is no client
        socket, or one that cannot read what this client sends: none of them can get an
        answer, and each would otherwise wait out its deadline in silence. How many there were."""
        waiting = self._sent_on(lambda sent_on: sent_on == generation)
        for rid in waiting:
            self._answer(rid, answer)
        return len(waiting)

    def _sent_on(self, generation_is: Callable[[int], bool]) -> list[str]:
        """The requests whose send began on a socket whose number passes ``generation_is``."""
        return [rid for rid, pending in self._pending.items()
                if pending.sent_at is not None and generation_is(pending.generation)]

    def _answer(self, rid: str, answer: Generation | Rejected | Lost | Unreadable) -> None:
        """End ``rid``'s wait with ``answer``, if it waits."""
        pending = self._pending.get(rid)
        if pending is not None and pending.progress is not None:
            pending.answer = answer
            pending.progress.close()  # wakes a wait on an empty queue
            pending.progress = None
            if pending.sending is not None:
                pending.sending.cancel()

    async def _watch_connection(self) -> None:
        """Fail the waiting requests that can get no answer, at once: when their connection
        closes, or when no daemon has taken one for ``NO_DAEMON_S``."""
        while True:
            watch = self._watch
            assert watch is not None
            # Unconnected, it looks again every WATCH_S: a request sent since may come due.
            with anyio.move_on_after(math.inf if watch.connected else WATCH_S):
                watch.heard(await watch.monitor.recv_multipart())
                if watch.connected:
                    self._abandoned.count_holds_from(time.monotonic())
            if watch.closes:
                await self._read_what_came()
                await self._replace_socket()
                continue
            lost = {rid: why for rid, pending in self._pending.items() if pending.sent_at is not None
                    and (why := watch.no_daemon(pending.sent_at, self.endpoint)) is not None}
            if lost:
                await self._read_what_came()
                for rid, why in lost.items():
                    self._answer(rid, Lost(why))

    async def _replace_socket(self) -> None:
        """The connection closed. The daemon answers a request only on the connection it came
        by, and ZMQ would hand what this socket still queues (a Submit sent as it closed) to
        the next connection: a new socket starts clean. Nothing sent on the old one can get
        an answer now, so its requests fail and the ids given up on are free."""
        old, old_watch = self._sock, self._watch
        assert old is not None and old_watch is not None
        with contextlib.suppress(zmq.ZMQError):
            old.disconnect(self.endpoint)  # no reconnecting: its queue goes (LINGER 0)
        self._sock, self._watch = self._connect()
        self._generation += 1
        for rid in self._sent_on(lambda generation: generation < self._generation):
            self._answer(rid, Lost(closed_why(self.endpoint)))
        self._abandoned.clear()
        try:
            await anyio.lowlevel.checkpoint()  # the sends those losses stopped end before the socket does
        finally:  # the client closing meanwhile included
            old_watch.close()
            old.close(linger=0)

    async def _read_what_came(self) -> None:
        """Let the reader take the replies that came before a connection closed (a daemon
        that answered, then stopped): they are answers, not losses."""
        assert self._sock is not None
        with anyio.move_on_after(1.0):
            while True:
                # Time for the reader: a reply ZMQ has handed to its pending receive is no
                # longer on the socket, but not yet an answer either. (``get``, not
                # ``getsockopt``: pyzmq's asyncio socket must see the edge it consumes.)
                await anyio.sleep(0.01)
                if not self._sock.get(zmq.EVENTS) & zmq.POLLIN:
                    return

    async def _request(self, rid: str, body: bytes, wait_s: float,
                       on_progress: OnProgress | None = None) -> Generation | Rejected | Unreadable:
        sock = self._open()
        if rid in self._pending or self._abandoned.held(rid, time.monotonic()):
            raise ValueError(f"request id {rid!r} is in use on this client (in flight, or given up and not ended)")
        self._abandoned.drop(rid)  # held long enough: no answer can still come
        tx, rx = anyio.create_memory_object_stream[Progress](PROGRESS_BACKLOG)
        pending = self._pending[rid] = _Pending(tx)
        try:
            with rx:
                try:
                    with anyio.fail_after(wait_s):
                        await self._send(pending, sock, body)
                        answer = await self._answer_to(pending, rx, on_progress)
                except TimeoutError:
                    # The deadline ran out in a slow on_progress after the answer came: it stands.
                    if (answer := pending.answer) is None:
                        raise
            if isinstance(answer, Lost):
                raise ConnectionError(answer.why)
            return answer
        except anyio.EndOfStream:
            raise ConnectionError(f"the client of {self.endpoint} was closed while {rid!r} waited") from None
        except BaseException as exc:
            await self._give_up(rid, pending, sock, wait_s)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no reply from {self.endpoint} for {rid!r} within {wait_s:.1f}s (its deadline "
                                   f"and {GRACE_S:g} s of grace)") from None
            raise
        finally:
            del self._pending[rid]
            if pending.progress is not None:
                pending.progress.close()

    async def _send(self, pending: _Pending, sock: zmq.asyncio.Socket, body: bytes) -> None:
        """Send ``pending``'s Submit, ``body``, on ``sock``, setting ``pending.sent``. The wait
        for ZMQ to take it ends early if the request ends meanwhile."""
        pending.sent_at, pending.generation = time.monotonic(), self._generation
        queued = sock.send_multipart([b"", body])
        sending = pending.sending = anyio.CancelScope()
        try:
            with sending:
                await queued
        finally:
            pending.sending = None
            # From the send itself, not from the await's return: a cancellation can land
            # after ZMQ took the message.
            pending.sent = queued.done() and not queued.cancelled() and queued.exception() is None

    async def _give_up(self, rid: str, pending: _Pending, sock: zmq.asyncio.Socket, wait_s: float) -> None:
        """The caller gave up on the request (cancelled, its on_progress raised, or the wait
        ran out): so should the daemon, rather than keep GPUs busy on work nobody awaits. Its
        answers, the ack included, are dropped when they come. (One never sent has nothing
        to cancel and no answer to come; one whose end came, while its on_progress still
        ran, has ended at the daemon: its id is free at once. A closed socket's client is
        gone, and the daemon's deadline ends the request.) One sent on a socket since
        replaced can get no answer, and needs no Cancel: a daemon that lives on ends it when
        its answer finds the connection gone (a Cancel by the new connection would also
        refuse a retry under its id, as a Cancel that overtook its Submit)."""
        assert self._watch is not None
        if (pending.sent and not isinstance(pending.answer, (Generation, Rejected))
                and pending.generation == self._generation):
            # Queued: no daemon has taken a connection yet, so its Submit waits for one.
            self._abandoned.abandon(rid, wait_s, time.monotonic(), queued=not self._watch.connected)
            if not sock.closed:
                # Counted before it leaves (its answer can come before this task runs
                # again), and uncounted if it does not: none will answer it.
                self._abandoned.count_cancel(rid)
                if not await _cancel_at_daemon(sock, [rid], self._tokens):
                    self._abandoned.uncount_cancel(rid)

    @staticmethod
    async def _answer_to(pending: _Pending, rx: anyio.abc.ObjectReceiveStream[Progress],
                         on_progress: OnProgress | None) -> Generation | Rejected | Lost | Unreadable:
        """Hand ``pending``'s progress to ``on_progress``, in order, until its answer is in; the
        answer does not wait for progress still queued. ``EndOfStream``: the client closed."""
        while (answer := pending.answer) is None:
            try:
                progress = await rx.receive()
            except anyio.EndOfStream:
                if pending.answer is not None:
                    continue
                raise
            if on_progress is not None and inspect.isawaitable(heard := on_progress(progress)):
                await heard
        return answer

    async def submit(self, params: GenParams, *, request_id: str = "", timeout_s: float | None = None,
                     priority: int = 0, on_progress: OnProgress | None = None) -> Generation:
        """Generate; raises ``Rejection``, ``TimeoutError`` (the wait ran out: the request is
        cancelled at the daemon), ``ValueError`` for an answer no client socket gives (every
        request waiting on that connection fails with it) or for an id in use on this client (its submit
        runs, or it was given up on and an answer may still come: until its end comes, its
        latest Cancel finds nothing or its connection closes (the client then starts a new
        socket, which nothing sent on the old one reaches), else for its wait once more;
        one sent where no daemon listened waits in ZMQ's queue for the next daemon), or
        ``ConnectionError`` if the client is closed while the request waits or no answer can
        come (no daemon took a connection within 3 s: the request is cancelled at the daemon
        should it get there; or the connection closed: a daemon that lives on ends it when
        its answer finds the connection gone)."""
        if on_progress is not None and not callable(on_progress):
            # Here, not as the first Progress comes: by then the request runs, for nobody.
            raise TypeError(f"on_progress must be a function or a coroutine function, not "
                            f"{type(on_progress).__name__}")
        # The client picks the id so it can match the answer among many in flight.
        rid = request_id or uuid.uuid4().hex
        body = submit_body(params, rid, timeout_s, priority, self._tokens, progress=on_progress is not None)
        answer = await self._request(rid, body, wait_s(timeout_s), on_progress)
        if isinstance(answer, Unreadable):
            # Returned, not raised in _request: nothing runs there, so no Cancel goes after it.
            raise ValueError(answer.why)
        return answer_as(Generation, answer, self.endpoint)

    async def cancel(self, request_id: str, *, timeout_s: float = 10.0) -> bool:
        """Cancel ``request_id`` at the daemon, submitted by this client (or by one that set no
        cancel token); whether it was still there to cancel. Raises ``Rejection(invalid)``,
        unsent, for an id no request can have (not a str, empty, past 128 characters), as
        ``submit`` does; ``ValueError`` or ``TypeError`` for a ``timeout_s`` that is no
        positive number of seconds; ``PermissionError`` for a request another client
        submitted, ``TimeoutError`` if the daemon does not answer within ``timeout_s``, or
        ``ConnectionError`` if no answer can come (no daemon took a connection within 3 s,
        or it closed) or the client is closed meanwhile."""
        # The Cancelled ack and the request's own Rejected share the id; acks go by a
        # separate DEALER so the two answers cannot be confused.
        checked_s(timeout_s)
        body = cancel_body(request_id, self._tokens)
        self._open()
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        self._cancelling.add(sock)
        watch: ConnectionWatch | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            watch = ConnectionWatch(sock)
            sock.connect(self.endpoint)
            sent_at = time.monotonic()
            await sock.send_multipart([b"", body])
            parts = await self._ack(sock, watch, request_id, sent_at, timeout_s)
        except asyncio.CancelledError:
            # Closing the client closes this socket, which cancels the wait on it: that is
            # no cancellation of the caller's task, and must not read as one.
            task = asyncio.current_task()
            if sock.closed and task is not None and not task.cancelling():
                raise ConnectionError(f"the client of {self.endpoint} was closed while cancelling {request_id!r}") \
                    from None
            raise
        finally:
            self._cancelling.discard(sock)
            if watch is not None:
                watch.close()
            sock.close(linger=0)
        return cancel_found(answer_as(Cancelled, _dealer_reply(parts, self.endpoint), self.endpoint))

    async def _ack(self, sock: zmq.asyncio.Socket, watch: ConnectionWatch, request_id: str, sent_at: float,
                   timeout_s: float) -> list[bytes]:
        """The answer to the Cancel of ``request_id`` sent on ``sock`` at ``sent_at``:
        ``ConnectionError`` as soon as ``watch`` says none can come, as for a submit, rather
        than a silent wait for a daemon that is not there; ``TimeoutError`` past ``timeout_s``."""
        deadline = sent_at + timeout_s
        ack = asyncio.ensure_future(sock.recv_multipart())
        news = asyncio.ensure_future(watch.monitor.recv_multipart())
        try:
            while not ack.done():
                if news.done():
                    watch.heard(news.result())
                    news = asyncio.ensure_future(watch.monitor.recv_multipart())
                if (problem := watch.problem(sent_at, 0, self.endpoint)) is not None:
                    raise ConnectionError(problem)
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"no reply from {self.endpoint} to the Cancel of {request_id!r} within "
                                       f"{timeout_s:.1f}s")
                until = min(deadline, watch.no_daemon_at(sent_at) or deadline)
                await asyncio.wait({ack, news}, timeout=until - now, return_when=asyncio.FIRST_COMPLETED)
            return ack.result()
        finally:
            _drop(ack)
            _drop(news)
