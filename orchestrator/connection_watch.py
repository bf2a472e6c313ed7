"""ConnectionWatch: whether a client's socket has a daemon at its other end.

ZMQ hides connections: a REQ or DEALER socket queues what it sends until a peer is there,
and says nothing when its peer goes. The daemon answers a connection (its ROUTER knows a
client by it), so a request whose connection closed can never be answered, not even by the
same daemon over the next connection; and a request sent where no daemon listens waits for
one. The watch reads the socket's monitor so that the clients can say either at once,
instead of waiting out the request's deadline in silence.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from orchestrator.deadlines import checked_s, poll_ms

# How long a client waits for a connection to take before it says no daemon is there: as
# long as the `triptych` commands' own check.
NO_DAEMON_S = 3.0

# A connection counts once ZMQ's handshake is done: a port that accepts TCP and speaks
# something else (or a stopped process's) never gets that far. That something accepted
# one at all (EVENT_CONNECTED) tells such a port from an empty one.
_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def silence_causes(endpoint: str) -> str:
    """What silence at ``endpoint`` may mean, said after it. ZMQ resolves and connects in
    the background and says neither that a host name is unknown nor that a route is
    missing: to a TCP endpoint all look alike."""
    return " (nothing listens there, or its host is unreachable or unknown)" if endpoint.startswith("tcp://") else ""


def closed_why(endpoint: str) -> str:
    return (f"the connection to the daemon at {endpoint} closed while the request waited: the daemon answers on "
            "the connection a request came by")


class ConnectionWatch:
    """The monitor of one client socket, and what its events say: connected or not since
    when, and how many connections have closed."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.monitor = sock.get_monitor_socket(_EVENTS)  # of the socket's own kind (asyncio or not)
        self.connected = False
        self.accepted = False  # whether anything there ever took a connection, handshake or not
        self.closes = 0  # connections lost so far: a request sent before one closed is lost with it
        self._since = time.monotonic()  # when it last connected or lost its connection

    def heard(self, frames: list[bytes]) -> None:
        """Take in one monitor message."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.accepted = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
            self.connected, self._since = True, time.monotonic()
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            # (A connection that closes before its handshake was never a daemon's: the wait
            # for one goes on, its clock not restarted.) Whatever accepts one next is news.
            self.connected, self.accepted, self._since = False, False, time.monotonic()
            self.closes += 1

    def read(self) -> None:
        """Take in every monitor message waiting (a blocking socket's monitor)."""
        while self.monitor.poll(0):
            self.heard(self.monitor.recv_multipart())

    async def read_async(self) -> None:
        """Take in every monitor message waiting (an asyncio socket's monitor)."""
        while await self.monitor.poll(0):
            self.heard(await self.monitor.recv_multipart())

    def wait_connected(self, timeout_s: float) -> bool:
        """Whether a daemon takes the connection within ``timeout_s`` (a blocking socket's monitor)."""
        deadline = time.monotonic() + timeout_s
        while not self.connected and (left_s := deadline - time.monotonic()) > 0:
            if self.monitor.poll(max(1, round(left_s * 1000))):
                self.heard(self.monitor.recv_multipart())
        return self.connected

    def no_daemon_at(self, sent_at: float) -> float | None:
        """When a request sent at ``sent_at`` has waited ``NO_DAEMON_S`` with no daemon
        connected (monotonic); None while one is."""
        return None if self.connected else max(self._since, sent_at) + NO_DAEMON_S

    def problem(self, sent_at: float, closes: int, endpoint: str) -> str | None:
        """Why a request sent at ``sent_at``, when ``closes`` connections had closed, can get
        no answer; None while it still can."""
        return closed_why(endpoint) if self.closes > closes else self.no_daemon(sent_at, endpoint)

    def no_daemon(self, sent_at: float, endpoint: str) -> str | None:
        """Why a request sent at ``sent_at`` waits for nothing: no daemon took a connection
        for ``NO_DAEMON_S``; None while one has or may yet."""
        due = self.no_daemon_at(sent_at)
        if due is not None and time.monotonic() >= due:
            return self.why_none(endpoint, NO_DAEMON_S)
        return None

    def why_none(self, endpoint: str, waited_s: float) -> str:
        """Why no daemon is connected after ``waited_s``: nothing listens, or something
        listens and does not speak (a stopped or stuck daemon, another kind of server)."""
        if self.accepted:
            return (f"no daemon answers at {endpoint}: something there took the connection but did not complete "
                    f"ZMQ's handshake within {waited_s:g}s (a stopped or stuck daemon, or not a ZMQ socket)")
        return (f"no daemon at {endpoint}: nothing there took a connection within {waited_s:g}s"
                f"{silence_causes(endpoint)}")

    def close(self) -> None:
        """Stop watching (again: nothing)."""
        if not self.monitor.closed:
            if not self._sock.closed:
                self._sock.disable_monitor()
            self.monitor.close(linger=0)


def watched_req(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, ConnectionWatch]:
    """A REQ socket connected to ``endpoint``, and its watch; on failure neither is left open."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        watch = ConnectionWatch(sock)
        try:
            sock.connect(endpoint)
        except BaseException:
            watch.close()
            raise
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, watch


def exchange(sock: zmq.Socket, watch: ConnectionWatch, parts: list[bytes], timeout_s: float, endpoint: str,
             what: str = "") -> list[bytes]:
    """Send ``parts`` on the REQ socket ``sock`` and take its reply's frames; ``TimeoutError``
    past ``timeout_s``, ``ConnectionError`` as soon as no reply can come (``watch``)."""
    sent_at = time.monotonic()
    deadline = sent_at + checked_s(timeout_s)
    watch.read()
    closes = watch.closes
    sock.send_multipart(parts)
    if not _wait_for_reply(sock, watch, sent_at, deadline, closes, endpoint):
        raise TimeoutError(f"no reply from {endpoint}{what} within {timeout_s:.1f}s")
    return sock.recv_multipart()


def _wait_for_reply(sock: zmq.Socket, watch: ConnectionWatch, sent_at: float, deadline: float, closes: int,
                    endpoint: str) -> bool:
    """Wait for the reply until ``deadline``; ``ConnectionError`` as soon as none can come."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.monitor, zmq.POLLIN)
    while True:
        watch.read()
        if sock.poll(0):
            return True  # it came before the connection closed (a daemon that answered, then stopped)
        if (problem := watch.problem(sent_at, closes, endpoint)) is not None:
            raise ConnectionError(problem)
        now = time.monotonic()
        if now >= deadline:
            return False
        until = min(deadline, watch.no_daemon_at(sent_at) or deadline)
        if sock in dict(poller.poll(poll_ms(max(until - now, 0.001)))):
            return True
