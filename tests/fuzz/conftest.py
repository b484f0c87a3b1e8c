"""Fuzzing support: the hypothesis profiles and a real webhook server over HTTPS.

Profiles: ``fixed`` (the default, run by ``make test``) derandomizes hypothesis, so every
run tries the same bounded set of cases; ``long`` (``GPUDRA_FUZZ_PROFILE=long``, run by
``make fuzz`` through ``bench/fuzz.py``) draws fresh random cases, many more of them.
``GPUDRA_FUZZ_EXAMPLES`` overrides the number of cases per test of either profile.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal
from gpudra.webhook.certs import ensure_pki, service_dns_names
from gpudra.webhook.server import ServerConfig, WebhookServer
from hypothesis import HealthCheck, settings

from tests.fuzz.wire import FUZZ_LIMITS, ErrorLog, Webhook

_QUIET = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much)
settings.register_profile(
    "fixed",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("GPUDRA_FUZZ_EXAMPLES", "30")),
    suppress_health_check=_QUIET,
    print_blob=True,
)
settings.register_profile(
    "long",
    database=None,
    deadline=None,
    max_examples=int(os.environ.get("GPUDRA_FUZZ_EXAMPLES", "2000")),
    suppress_health_check=_QUIET,
    print_blob=True,
)
settings.load_profile(os.environ.get("GPUDRA_FUZZ_PROFILE", "fixed"))


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webhook]:
    """One real webhook server for the module, on its own event loop in a thread, so
    hypothesis drives it from plain blocking tests with a hang guard on every read."""
    pki_dir = tmp_path_factory.mktemp("pki")
    pki, _ = ensure_pki(pki_dir, service_dns_names("gpudra-webhook", "gpudra"))
    templates: list[tuple[str, int, bool]] = []

    async def ensure(namespace: str, made: Sequence[Mapping[str, Any]], dry_run: bool) -> None:
        templates.append((namespace, len(made), dry_run))

    config = ServerConfig(
        cert_file=pki_dir / "tls.crt",
        key_file=pki_dir / "tls.key",
        host="127.0.0.1",
        port=0,
        **FUZZ_LIMITS,
    )
    server = WebhookServer(config, ensure)
    errors = ErrorLog()
    root = logging.getLogger()
    root.addHandler(errors)
    try:
        with start_blocking_portal("asyncio") as portal:
            future, port = portal.start_task(server.serve)
            hook = Webhook(server, port, pki.ca_bundle, errors, templates)
            yield hook
            future.cancel()
    finally:
        root.removeHandler(errors)
    assert errors.take() == []


@pytest.fixture(scope="module")
def state_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")
