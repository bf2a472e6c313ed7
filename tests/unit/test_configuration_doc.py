"""docs/configuration.md lists every config key with its true default."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import msgspec

from orchestrator.config import Config
from transfer.protocol import ROLES

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z_<>.]+)` \| (.+?) \| .+ \|$", re.MULTILINE)


def literal(value: Any) -> str:
    """``value`` as the doc writes a default: a TOML literal in backticks."""
    match value:
        case None:
            return "unset"
        case bool():
            return f"`{str(value).lower()}`"
        case _:
            return f"`{toml(value)}`"


def toml(value: Any) -> str:
    match value:
        case str():
            return json.dumps(value)
        case list() | tuple():
            return "[" + ", ".join(toml(v) for v in value) + "]"
        case dict():
            return "{ " + ", ".join(f"{k} = {toml(v)}" for k, v in value.items()) + " }"
        case _:
            return str(value)


def defaults(section: msgspec.Struct, prefix: str) -> dict[str, Any]:
    """Every leaf key under ``section`` by its dotted name, with its default."""
    found: dict[str, Any] = {}
    for field in msgspec.structs.fields(section):
        value = getattr(section, field.name)
        if isinstance(value, msgspec.Struct):
            found |= defaults(value, f"{prefix}{field.name}.")
        else:
            found[prefix + field.name] = value
    return found


def documented_defaults() -> dict[str, str]:
    """Every key the doc has a row for, the row's default as written; the roles' tables as one
    ``workers.<role>`` key whose default is each role's, joined by `` / `` where they differ."""
    config = Config()
    expected = {key: literal(value) for key, value in defaults(config, "").items()
                if not key.startswith("workers.")}
    by_role = [defaults(config.workers.for_role(role), "workers.<role>.") for role in ROLES]
    for key in by_role[0]:
        per_role = [literal(role_defaults[key]) for role_defaults in by_role]
        expected[key] = per_role[0] if len(set(per_role)) == 1 else " / ".join(per_role)
    return expected


def test_every_key_is_documented_with_its_default() -> None:
    found = ROW.findall(DOC.read_text())
    rows = dict(found)
    assert len(rows) == len(found), "a key has two rows"
    assert rows == documented_defaults()
