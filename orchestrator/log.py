"""The only place structlog is configured."""

from __future__ import annotations

import logging
import sys

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
        processors = shared + [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
        factory = structlog.PrintLoggerFactory(sys.stderr)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**context)
