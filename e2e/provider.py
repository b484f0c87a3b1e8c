"""Which cluster the end-to-end suite runs on: the local harness (control plane, fake
nodes and the real node) or kind (`make e2e-kind`, GPUDRA_CLUSTER_PROVIDER=kind), and
the mark a test that needs the local harness carries, with the reason it gives on kind
(the README's kind section lists them)."""

from __future__ import annotations

import os

import pytest


def on_kind() -> bool:
    return os.environ.get("GPUDRA_CLUSTER_PROVIDER") == "kind"


def local_only(reason: str) -> pytest.MarkDecorator:
    """Skips the test on kind, saying why it needs the local harness."""
    return pytest.mark.skipif(on_kind(), reason=reason)
