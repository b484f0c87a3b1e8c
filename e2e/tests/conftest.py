"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """kubernetes_asyncio and grpc.aio are asyncio-only."""
    return "asyncio"
