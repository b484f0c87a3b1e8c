"""Shared by the driver tests: async tests run under anyio on the asyncio backend."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
