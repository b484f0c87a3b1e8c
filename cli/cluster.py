"""The cluster a command reads: its `--kubeconfig` flag and its API client.

Every command that talks to the API server finds it the same way (`kubeconfig_source`
says in what order), and a command run by hand says in one line why there is no cluster
and what to give instead, rather than end in a traceback.
"""

from __future__ import annotations

import argparse

from gpudra.common.kube import Kube, KubeConfigError

__all__ = ["KUBECONFIG_HELP", "add_kubeconfig", "connect"]

KUBECONFIG_HELP = (
    "kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else the pod's service account)"
)


def add_kubeconfig(p: argparse.ArgumentParser) -> None:
    """The `--kubeconfig` flag, the same for every command."""
    p.add_argument("--kubeconfig", default=None, help=KUBECONFIG_HELP)


async def connect(kubeconfig: str | None, *, command: str, otherwise: str) -> Kube:
    """The cluster's API client; one line naming the fix (`otherwise`) when there is none."""
    try:
        return await Kube.connect(kubeconfig)
    except (KubeConfigError, OSError) as e:
        raise SystemExit(
            f"gpudra {command}: no cluster to read ({e}); give --kubeconfig, or {otherwise}"
        ) from None
