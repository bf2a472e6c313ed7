"""Clients: ``Client`` (REQ, blocking) and ``AsyncClient`` (DEALER, many requests in flight,
in ``orchestrator.async_client``). ``Control``, for the control socket, is in
``orchestrator.control_client``.

Every wait has a deadline. A request that fails raises ``Rejection`` carrying the typed
``Rejected`` (reason code and message); one that gets no answer in time raises
``TimeoutError`` naming the endpoint.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

import zmq

from orchestrator.async_client import AsyncClient
from orchestrator.client_wire import (
    CANCEL_SEND_S,
    CancelTokens,
    Generation,
    Reply,
    blocking_context,
    cancel_body,
    cancel_found,
    daemon_endpoint,
    read_reply,
    submit_body,
    wait_s,
)
from orchestrator.connection_watch import ConnectionWatch, exchange, watched_req
from orchestrator.deadlines import checked_s
from orchestrator.rejection import Rejection, answer_as
from transfer.protocol import Cancelled, GenParams

__all__ = ["AsyncClient", "Client", "Generation", "Rejection", "Reply"]


class Client:
    """Blocking client on a REQ socket: one request at a time. Calls from several threads
    are serialised (each waits its turn, then its own timeout), ``close`` included: it waits
    for the call in flight. ``cancel`` goes by a socket of its own, so another thread can
    cancel the request a ``submit`` waits on."""

    def __init__(self, endpoint: str, *, ctx: zmq.Context | None = None) -> None:
        self.endpoint = daemon_endpoint(endpoint)
        self._ctx = blocking_context(ctx)
        self._tokens = CancelTokens()
        # A REQ socket must alternate send and receive; a second thread's send in between
        # breaks its state machine (and a thread's reset or close would close it under the
        # other: a ZMQ socket is used by one thread at a time).
        self._lock = threading.Lock()
        self._sock, self._watch = self._connect()
        self._closed = False

    def _connect(self) -> tuple[zmq.Socket, ConnectionWatch]:
        return watched_req(self._ctx, self.endpoint)

    def submit(self, params: GenParams, *, request_id: str = "", timeout_s: float | None = None,
               priority: int = 0) -> Generation:
        """Generate, waiting for the answer up to ``timeout_s`` (the request's deadline at the
        daemon, 120 s by default) and a grace of 5 s. Raises ``Rejection`` (the daemon refused
        or failed it, or would have: a bad field, ``timeout_s`` included, is refused unsent;
        see ``.reason``), ``TimeoutError`` (no answer in time), ``ConnectionError`` (no
        answer can come: no daemon took a connection within 3 s, or the connection the
        request went by closed) or ``ValueError`` (what answered is no client socket: the
        daemon's worker socket says so). A wait that ends without an answer, or is interrupted
        (Ctrl-C), cancels the request at the daemon, taking up to 1 s more; the client stays
        usable after any of them."""
        self._check_open()
        rid = request_id or uuid.uuid4().hex  # known here, so an interrupted wait can cancel it
        body = submit_body(params, rid, timeout_s, priority, self._tokens)
        try:
            reply = self._request([body], wait_s(timeout_s))
        except BaseException:
            # Nobody will take the answer. Even past the request's deadline the daemon may
            # not have ended it: a stalled daemon reads a submit late, its deadline counting
            # from then.
            # PermissionError: the id runs for another client by now, so nothing of ours is left there.
            with contextlib.suppress(TimeoutError, ConnectionError, ValueError, zmq.ZMQError, Rejection,
                                     PermissionError):
                self._cancel(self._tokens.cancel_frame(rid), rid, CANCEL_SEND_S)
            raise
        generation = answer_as(Generation, reply, self.endpoint)
        if generation.result.request_id != rid:
            raise ValueError(f"{self.endpoint} answered request {rid!r} with the Result of "
                             f"{generation.result.request_id!r}")
        return generation

    def cancel(self, request_id: str, *, timeout_s: float = 10.0) -> bool:
        """Cancel ``request_id``, submitted by this client (or by one that set no cancel
        token); whether it was still there to cancel. Safe from another thread while the
        request's ``submit`` waits (which then raises ``Rejection(cancelled)``). Raises
        ``Rejection(invalid)``, unsent, for an id no request can have (not a str, empty, past
        128 characters), as ``submit`` does; ``ValueError`` or ``TypeError`` for a
        ``timeout_s`` that is no positive number of seconds; ``PermissionError`` for a
        request another client submitted, ``TimeoutError`` if the daemon does not answer
        within ``timeout_s``, ``ConnectionError`` as ``submit``."""
        self._check_open()
        checked_s(timeout_s)
        return self._cancel(cancel_body(request_id, self._tokens), request_id, timeout_s)

    def _cancel(self, body: bytes, request_id: str, timeout_s: float) -> bool:
        """Send the Cancel ``body`` of ``request_id`` and read its answer, the client open or
        not: a submit's own Cancel comes after its wait, when another thread's ``close`` may
        have closed it, and the request must not run on at the daemon for nobody."""
        # A one-shot socket: the client's own may be waiting for a submit's answer, and the
        # daemon answers a Cancel on the connection it came by. Its token proves it ours.
        sock, watch = self._connect()
        try:
            frames = exchange(sock, watch, [body], timeout_s, self.endpoint, f" to the Cancel of {request_id!r}")
        finally:
            watch.close()
            sock.close(linger=0)
        return cancel_found(answer_as(Cancelled, read_reply(frames, self.endpoint), self.endpoint))

    def _request(self, parts: list[bytes], timeout_s: float) -> Reply:
        with self._lock:
            self._check_open()  # (closed by another thread meanwhile: no new socket for it)
            try:
                # All of it inside: a Ctrl-C can land just after the message left (or before
                # its reply was taken), and the REQ socket then waits for that reply; only a
                # new socket takes the next request.
                frames = exchange(self._sock, self._watch, parts, timeout_s, self.endpoint)
            except BaseException:
                self._reset()
                raise
        return read_reply(frames, self.endpoint)

    def _reset(self) -> None:
        """A REQ socket that missed its reply (a timeout, an interrupted wait) cannot send
        again: start a fresh one."""
        self._close_socket()
        self._sock, self._watch = self._connect()

    def close(self) -> None:
        """Close the socket once no call is in flight (a ``submit`` another thread waits on
        ends first, with its answer or its timeout)."""
        with self._lock:
            self._closed = True
            self._close_socket()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Client was closed: make a new one")

    def _close_socket(self) -> None:
        self._watch.close()
        self._sock.close(linger=0)  # (again: nothing)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

