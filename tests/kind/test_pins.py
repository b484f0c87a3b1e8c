"""The pins every Python caller reads (kind's node image and cluster, the bench peer)."""

from __future__ import annotations

import pytest

from e2e.pins import CLUSTER_VERSIONS, TOOL_VERSIONS, PinMissing, pinned


def test_pins_come_from_the_files_the_build_scripts_source() -> None:
    default = pinned("K8S_DEFAULT_MINOR", CLUSTER_VERSIONS)
    assert pinned(f"K8S_PIN_{default.replace('.', '_')}", CLUSTER_VERSIONS).startswith(
        f"v{default}."
    )
    assert pinned("KIND_VERSION", TOOL_VERSIONS).startswith("v")


def test_a_missing_pin_names_itself_and_its_file() -> None:
    with pytest.raises(PinMissing, match=r"^NOPE is not set in e2e/tools/versions\.env$"):
        pinned("NOPE", TOOL_VERSIONS)
