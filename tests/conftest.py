import pytest
import structlog


@pytest.fixture(autouse=True)
def logs():
    with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured:
        yield captured
