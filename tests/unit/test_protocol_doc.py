"""docs/protocol.md names every message and struct of transfer/protocol.py, and each of their fields."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import msgspec
import pytest

import transfer.protocol as protocol

DOC = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
# A private struct is no message: a view the code reads one with (a peer's version, say).
STRUCTS = [cls for name, cls in inspect.getmembers(protocol, inspect.isclass)
           if issubclass(cls, msgspec.Struct) and cls.__module__ == protocol.__name__ and not name.startswith("_")]


@pytest.mark.parametrize("cls", STRUCTS, ids=lambda cls: cls.__name__)
def test_every_struct_and_field_is_documented(cls: type[msgspec.Struct]) -> None:
    assert f"`{cls.__name__}`" in DOC
    undocumented = [f for f in cls.__struct_fields__ if not re.search(rf"`{f}(`|:| =)", DOC)]
    assert not undocumented, f"{cls.__name__}: {undocumented}"
