"""structlog's configuration (the only place it is made), and the throttle for warnings a peer can provoke."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass

import msgspec
import structlog

_json = msgspec.json.Encoder()


def _dumps(event_dict: dict, **_: object) -> bytes:
    # JSONRenderer passes default=...; msgspec's encoder takes no such argument.
    return _json.encode(event_dict)


def configure_logging(level: str = "info", *, json: bool | None = None, **context: str) -> None:
    """JSON lines on stderr (or a console renderer on a terminal); ``context`` on every line."""
    if json is None:
        json = not sys.stderr.isatty()
    shared: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors = shared + [
            # Tracebacks as data, without each frame's locals (configs, buffers: huge lines).
            structlog.processors.ExceptionRenderer(structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
            structlog.processors.JSONRenderer(serializer=_dumps),
        ]
        factory: structlog.typing.WrappedLogger = structlog.BytesLoggerFactory(sys.stderr.buffer)
    else:
        # Plain tracebacks: the default (rich's) prints every frame's locals, the config
        # and its token among them.
        processors = shared + [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),  # none in a file
                                                             exception_formatter=structlog.dev.plain_traceback)]
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)


@dataclass(slots=True)
class _Window:
    start: float
    lines: int = 0
    left_out: int = 0


class Throttled:
    """Warnings a peer can cause at will (junk on a socket, a wrong token), at most ``burst``
    lines per event per ``window_s``; the first line of a later window says how many the
    previous ones left out (``left_out``). Without it a flood of one-byte messages writes
    a hundred times its size to the log, and the loop spends its time writing it."""

    def __init__(self, logger: structlog.typing.FilteringBoundLogger, *, burst: int = 10,
                 window_s: float = 10.0) -> None:
        self._logger = logger
        self._burst = burst
        self._window_s = window_s
        self._windows: dict[str, _Window] = {}

    def warning(self, event: str, **fields: object) -> None:
        now = time.monotonic()
        window = self._windows.get(event)
        if window is None:
            window = self._windows[event] = _Window(now)
        elif now - window.start >= self._window_s:
            window.start, window.lines = now, 0
        if window.lines >= self._burst:
            window.left_out += 1
            return
        window.lines += 1
        if window.left_out:
            fields["left_out"], window.left_out = window.left_out, 0
        self._logger.warning(event, **fields)
