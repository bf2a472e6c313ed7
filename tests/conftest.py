from collections.abc import Awaitable

import pytest
import structlog

from orchestrator.client import Generation, Rejection
from transfer.protocol import Rejected


@pytest.fixture(autouse=True)
def logs():
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured:
        yield captured


async def outcome_of(submitted: Awaitable[Generation]) -> Generation | Rejected:
    """What a submit came to: its Generation, or the Rejected the daemon (or the client) ended it with."""
    try:
        return await submitted
    except Rejection as exc:
        return exc.rejected
