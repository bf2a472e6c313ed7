"""Clients: ``Client`` (REQ, blocking) and ``AsyncClient`` (DEALER, many requests in flight,
in ``orchestrator.async_client``). ``Control``, for the control socket, is in
``orchestrator.control_client``.

Every wait has a deadline. A request that fails raises ``Rejection`` carrying the typed
``Rejected`` (reason code and message); one that gets no answer in time raises
``TimeoutError`` naming the endpoint.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import zmq

from orchestrator.async_client import AsyncClient
from orchestrator.client_wire import (
    CANCEL_SEND_S,
    CancelTokens,
    Generation,
    Reply,
    cancel_found,
    daemon_endpoint,
    read_reply,
    submit_body,
    wait_s,
)
from orchestrator.connection_watch import ConnectionWatch
from orchestrator.deadlines import checked_s, poll_ms
from orchestrator.rejection import Rejection, answer_as
from transfer.protocol import Cancelled, GenParams

__all__ = ["AsyncClient", "Client", "Generation", "Rejection", "Reply"]


class Client:
    """Blocking client on a REQ socket: one request at a time."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None) -> None:
        self.endpoint = daemon_endpoint(endpoint)
        self._ctx = ctx or zmq.Context.instance()
        self._tokens = CancelTokens()
        self._sock, self._watch = self._connect()

    def _connect(self) -> tuple[zmq.Socket, ConnectionWatch]:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            watch = ConnectionWatch(sock)
            try:
                sock.connect(self.endpoint)
            except BaseException:
                watch.close()
                raise
        except BaseException:
            sock.close(linger=0)
            raise
        return sock, watch

    def submit(self, params: GenParams, *, request_id: str = "", timeout_s: float | None = None,
               priority: int = 0) -> Generation:
        """Generate, waiting for the answer up to ``timeout_s`` (the request's deadline at the
        daemon, 120 s by default) and a grace of 5 s. Raises ``Rejection`` (the daemon refused
        or failed it, or would have: a bad field, ``timeout_s`` included, is refused unsent;
        see ``.reason``), ``TimeoutError`` (no answer in time) or ``ConnectionError`` (no
        answer can come: no daemon took a connection within 3 s, or the connection the
        request went by closed). A wait that ends without an answer, or is interrupted
        (Ctrl-C), cancels the request at the daemon, taking up to 1 s more; the client stays
        usable after any of them."""
        rid = request_id or uuid.uuid4().hex  # known here, so an interrupted wait can cancel it
        body = submit_body(params, rid, timeout_s, priority, self._tokens)
        try:
            reply = self._request([body], wait_s(timeout_s))
        except BaseException:
            # Nobody will take the answer. Even past the request's deadline the daemon may
            # not have ended it: a stalled daemon reads a submit late, its deadline counting
            # from then.
            # PermissionError: the id runs for another client by now, so nothing of ours is left there.
            with contextlib.suppress(TimeoutError, ConnectionError, ValueError, zmq.ZMQError, Rejection, PermissionError):
                self.cancel(rid, timeout_s=CANCEL_SEND_S)
            raise
        generation = answer_as(Generation, reply, self.endpoint)
        if generation.result.request_id != rid:
            raise ValueError(f"{self.endpoint} answered request {rid!r} with the Result of "
                             f"{generation.result.request_id!r}")
        return generation

    def cancel(self, request_id: str, *, timeout_s: float = 10.0) -> bool:
        """Cancel ``request_id``, submitted by this client (or by one that set no cancel
        token); whether it was still there to cancel. Raises ``PermissionError`` for a
        request another client submitted."""
        return cancel_found(answer_as(Cancelled, self._request([self._tokens.cancel_frame(request_id)], timeout_s),
                                self.endpoint))

    def _request(self, parts: list[bytes], timeout_s: float) -> Reply:
        sent_at = time.monotonic()
        deadline = sent_at + checked_s(timeout_s)
        self._watch.read()
        closes = self._watch.closes
        try:
            # All of it inside: a Ctrl-C can land just after the message left (or before
            # its reply was taken), and the REQ socket then waits for that reply; only a
            # new socket takes the next request.
            self._sock.send_multipart(parts)
            if not self._wait(sent_at, deadline, closes):
                raise TimeoutError(f"no reply from {self.endpoint} within {timeout_s:.1f}s")
            frames = self._sock.recv_multipart()
        except BaseException:
            self._reset()
            raise
        return read_reply(frames, self.endpoint)

    def _wait(self, sent_at: float, deadline: float, closes: int) -> bool:
        """Wait for the reply until ``deadline``; ``ConnectionError`` as soon as none can come."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._watch.monitor, zmq.POLLIN)
        while True:
            self._watch.read()
            if self._sock.poll(0):
                return True  # it came before the connection closed (a daemon that answered, then stopped)
            if (problem := self._watch.problem(sent_at, closes, self.endpoint)) is not None:
                raise ConnectionError(problem)
            now = time.monotonic()
            if now >= deadline:
                return False
            until = min(deadline, self._watch.no_daemon_at(sent_at) or deadline)
            if self._sock in dict(poller.poll(poll_ms(max(until - now, 0.001)))):
                return True

    def _reset(self) -> None:
        """A REQ socket that missed its reply (a timeout, an interrupted wait) cannot send
        again: start a fresh one."""
        self.close()
        self._sock, self._watch = self._connect()

    def close(self) -> None:
        self._watch.close()
        self._sock.close(linger=0)  # (again: nothing)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
