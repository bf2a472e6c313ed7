from collections.abc import Iterator

import pytest
import zmq.asyncio


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    """The kind of context the daemon hands its actors (orchestrator/daemon.py)."""
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)
