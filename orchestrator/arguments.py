"""argparse types for the command lines' numbers and endpoints: a bad one is a usage error
naming it, not a traceback from deep inside a run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from orchestrator.endpoints import dial_problem
from transfer.protocol import MAX_LABEL


def positive_seconds(text: str) -> float:
    """A finite number of seconds above zero (a negative wait never ends)."""
    return _positive(text, "a positive number of seconds")


def positive_rate(text: str) -> float:
    """A finite number of events a second above zero."""
    return _positive(text, "a positive number a second")


def _positive(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def number(text: str) -> float:
    """A number: not "nan", which ``float`` reads too (and a bound then refuses as if it were
    out of range)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    return value


def at_least(least: int) -> Callable[[str], int]:
    """An integer of at least ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected at least {least}, got {value}")
        return value

    return parse


def worker_name(text: str) -> str:
    """A worker's name as a Register carries it: 1 to 512 characters (else the daemon refused
    the registration, naming a wire field)."""
    if not 1 <= len(text) <= MAX_LABEL:
        raise argparse.ArgumentTypeError(f"expected 1 to {MAX_LABEL} characters, got {len(text)}")
    return text


def connect_endpoint(endpoint: str) -> str:
    """An endpoint a command can connect to: tcp://host:port or ipc://path, no ``*``; empty
    (the config's endpoint, as when none is given)."""
    if endpoint and (problem := dial_problem(endpoint)) is not None:
        raise argparse.ArgumentTypeError(f"{endpoint} is {problem}")
    return endpoint
