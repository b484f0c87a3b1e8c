"""``--cert-source=ca``: the serving certificate renewed from a CA someone else keeps.

Why: with ``webhook.tls.source=helm`` the chart makes the CA and publishes its
``caBundle``, but a serving certificate the chart signed would expire a year later with
nobody to renew it, and every GPU pod and claim would then be denied (``failurePolicy:
Fail``). The chart keeps the CA key in its Secret; each webhook replica signs its own
serving certificate from it into a private directory and renews it with a third of its
life left. The running server picks the new files up (`ReloadingTLSContext`): no restart,
and the ``caBundle`` never changes, so no admission meets an unknown certificate. A CA
the chart replaces (it keeps the old one in the bundle meanwhile) is followed at the
next check.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.abc import TaskStatus
from gpudra.webhook.certs import (
    LOOPBACK_IPS,
    SERVING_VALIDITY,
    CertKeyPair,
    ensure_serving_from_ca,
)

__all__ = ["ServingRenewal"]

logger = logging.getLogger(__name__)


class ServingRenewal:
    """Keeps ``tls.crt``/``tls.key`` in `cert_dir` signed by the CA in `ca_dir`."""

    def __init__(
        self,
        ca_dir: Path,
        cert_dir: Path,
        dns_names: Sequence[str],
        *,
        ip_addresses: Sequence[str] = LOOPBACK_IPS,
        check_interval_s: float = 3600.0,
        validity: dt.timedelta = SERVING_VALIDITY,
    ) -> None:
        self._ca_dir = ca_dir
        self._cert_dir = cert_dir
        self._dns_names = tuple(dns_names)
        self._ip_addresses = tuple(ip_addresses)
        self._check_interval_s = check_interval_s
        self._validity = validity

    def renew(self) -> tuple[CertKeyPair, bool]:
        """One check (blocking file and key work): (serving pair, whether it was renewed)."""
        serving, changed = ensure_serving_from_ca(
            self._ca_dir,
            self._cert_dir,
            self._dns_names,
            ip_addresses=self._ip_addresses,
            validity=self._validity,
        )
        if changed:
            logger.info(
                "serving certificate issued from the chart's CA",
                extra={"fields": {"not_after": serving.not_after.isoformat()}},
            )
        return serving, changed

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Check now, then every `check_interval_s`, until cancelled. A failed check
        (the Secret volume mid-update, a broken CA) keeps the current certificate."""
        await anyio.to_thread.run_sync(self.renew)
        task_status.started()
        while True:
            await anyio.sleep(self._check_interval_s)
            try:
                await anyio.to_thread.run_sync(self.renew)
            except (OSError, ValueError) as exc:
                logger.error(
                    "serving certificate renewal failed; serving the current one",
                    extra={"fields": {"ca_dir": str(self._ca_dir), "error": str(exc)}},
                )
