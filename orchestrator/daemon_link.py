"""A worker's connections to the daemon's worker socket (protocol.md §3.2).

The main connection carries the registration, every report and the heartbeats. A
decoder's outputs, which may be hundreds of megabytes, travel on a second connection, one
per registration, whose routing id is the registration's key: ZMQ sends a connection's
messages in order, so on the main one the heartbeats would wait behind an output crossing
a slow link, and the daemon would take the decoder for dead.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import zmq
import zmq.asyncio

from orchestrator.connection_watch import ConnectionWatch
from transfer.protocol import Heartbeat, Leaving, encode
from transfer.reports import Message

LEAVING_LINGER_MS = 250  # a stopping worker waits at most this long for Leaving to go out (ms)


class DaemonLink:
    """Owns the worker's ZMQ context and its DEALERs to ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.asyncio.Context()
        self.main = self._dealer()
        self.outputs: zmq.asyncio.Socket | None = None  # a decoder's, once registered
        self._outputs_watch: ConnectionWatch | None = None  # its connection's comings and goings

    def _dealer(self, routing_id: bytes | None = None) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        return sock

    def connect(self) -> None:
        self.main.connect(self.endpoint)

    def open_outputs(self, key: bytes) -> zmq.asyncio.Socket:
        """The output connection of the registration ``key`` names."""
        assert self.outputs is None, "the last registration's output connection is still open"
        self.outputs = self._dealer(key)
        # Watched from the start, to know at a stop whether the connection is still there.
        self._outputs_watch = ConnectionWatch(self.outputs)
        self.outputs.connect(self.endpoint)
        return self.outputs

    def close_outputs(self) -> None:
        """End the output connection of a registration the daemon forgot, dropping the
        outputs still queued there: they are about requests it no longer knows. Until the
        next one opens, Leaving goes on the main connection (no output can precede it)."""
        if self.outputs is not None:
            assert self._outputs_watch is not None
            self._outputs_watch.close()
            self.outputs.close(linger=0)
            self.outputs, self._outputs_watch = None, None

    def send_now(self, reports: Sequence[Message], outputs: Sequence[Message], *, leaving: bool) -> bool:
        """Queue ``reports`` on the main connection, ``outputs`` on the output one, then
        ``Leaving`` if ``leaving``, without waiting (this may run while cancelled, or on
        the way to an exit). Leaving follows the outputs on their connection: said on the
        main one, it could overtake an output still crossing, and the daemon, told nothing
        more comes, would start that request again. Return whether all was queued."""
        last = self.outputs or self.main
        sends: list[tuple[zmq.asyncio.Socket, Message]] = [(self.main, m) for m in reports]
        sends += [(last, m) for m in outputs]
        if leaving:
            sends.append((last, [encode(Leaving())]))
        try:
            for sock, message in sends:
                zmq.Socket.shadow(sock.underlying).send_multipart(message, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False  # no room to queue them: the daemon notices the silence instead
        return True

    async def hand_over(self, outputs: Sequence[Message], *, heartbeat_s: float, within_s: float) -> str | None:
        """Queue ``outputs`` and ``Leaving`` on the output connection, then wait until the
        daemon answers the Leaving there: it has then read every output before it. The
        main connection heartbeats meanwhile, as the outputs may take a while to cross and
        silence would get this worker evicted first (and its outputs dropped). None once
        answered, else why not: no answer ``within_s``, or none can come (the connection
        closed, and ZMQ dropped what was queued on it with it, or no daemon took one for
        NO_DAEMON_S: a dead daemon's decoder waited the whole ``within_s`` to stop)."""
        assert self.outputs is not None and self._outputs_watch is not None
        watch, started = self._outputs_watch, time.monotonic()
        if not self.send_now([], outputs, leaving=True):
            return "no room to queue them"
        beat = encode(Heartbeat())
        main = zmq.Socket.shadow(self.main.underlying)
        with anyio.move_on_after(within_s):
            while True:
                try:
                    main.send(beat, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # no room: the beats before it still wait to leave
                if await self.outputs.poll(int(heartbeat_s * 1000)):
                    return None
                await watch.read_async()
                if watch.closes and not watch.connected:  # gone, not back (a daemon that died)
                    return f"its output connection to {self.endpoint} closed"
                if (none := watch.no_daemon(started, self.endpoint)) is not None:
                    return none
        return f"no answer within {within_s:g}s"

    def close(self, linger_ms: int) -> None:
        """Close every socket of the context, ``linger_ms`` for what is queued to go out,
        and end the context (returns once all is out or the linger is over)."""
        self.ctx.destroy(linger=linger_ms)
