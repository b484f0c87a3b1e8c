"""docs/install.md's admission configuration for client certificates ("Who may call the
webhook") is the one the end-to-end harness gives its API server (`admission_files`),
which e2e/tests/test_webhook_client_auth.py shows a real API server presents to the
chart's webhook. Were the doc's files or its user name to drift from the harness's,
what the doc tells an admin would no longer be what was run."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster.harness import ADMISSION_CLIENT_CN, AdmissionClient, admission_files

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "docs" / "install.md"


def example() -> list[dict[str, Any]]:
    """The doc's two files: the AdmissionConfiguration and its kubeConfigFile."""
    blocks = re.findall(r"```yaml\n(.*?)```", INSTALL.read_text(), re.DOTALL)
    (block,) = [b for b in blocks if "kind: AdmissionConfiguration" in b]
    return list(yaml.safe_load_all(block))


def test_the_doc_shows_the_files_the_harness_writes() -> None:
    """For the release `gpudra` in the namespace `gpudra` on the chart's default port:
    the same plugins reading the same kubeconfig, whose one user is named for the
    webhook's Service host and port."""
    config, kubeconfig = example()
    (user,) = kubeconfig["users"]
    values = yaml.safe_load((REPO / "charts" / "gpudra" / "values.yaml").read_text())
    client = AdmissionClient(
        port=values["webhook"]["port"],
        ca=Path("ca.crt"),
        cert=Path(user["user"]["client-certificate"]),
        key=Path(user["user"]["client-key"]),
    )
    kubeconfig_file = Path(config["plugins"][0]["configuration"]["kubeConfigFile"])
    assert (config, kubeconfig) == admission_files(client, kubeconfig_file)
    assert user["name"] == "gpudra-webhook.gpudra.svc:8443"


def test_the_doc_names_the_harness_certificate_in_allowed_names() -> None:
    text = " ".join(INSTALL.read_text().split())
    assert f"webhook.clientAuth.allowedNames={{{ADMISSION_CLIENT_CN}}}" in text
