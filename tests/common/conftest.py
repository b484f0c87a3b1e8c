"""The shared plumbing runs on anyio's asyncio backend, like every component using it."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
