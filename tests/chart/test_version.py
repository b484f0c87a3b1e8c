"""One version names this tree everywhere: pyproject.toml's (the wheel, `make image`'s tag
and archive), the chart's version and appVersion (the default image tag and the
`app.kubernetes.io/version` label the chart reads back on upgrade), and the names in
docs/install.md. It is the release this tree becomes, so it is above the previous
release's: a chart still naming that release would run its image, whose agent refuses
the newer chart's flags, and could not tell that release's agents from its own."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from packaging.version import Version

from e2e.image import build
from e2e.pins import TOOL_VERSIONS, pinned
from e2e.tools import helm as h

REPO = Path(__file__).resolve().parents[2]
CHART = yaml.safe_load((h.CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((h.CHART / "values.yaml").read_text())
VERSION = build.project_version()


def test_the_chart_and_the_project_have_one_version() -> None:
    assert CHART["version"] == CHART["appVersion"] == VERSION


def test_the_version_is_above_the_previous_release() -> None:
    """Raised right after a release is cut: when versions.env moves to a new release,
    this tree moves on to the next one."""
    previous = pinned("GPUDRA_PREVIOUS_RELEASE", TOOL_VERSIONS).removeprefix("v")
    assert Version(VERSION) > Version(previous)


def test_the_previous_release_is_the_version_its_chart_names(
    previous_release_file: Callable[[str], str],
) -> None:
    """The pin's tag is that commit's chart version: what its objects' labels say."""
    old = yaml.safe_load(previous_release_file("charts/gpudra/Chart.yaml"))
    tag = pinned("GPUDRA_PREVIOUS_RELEASE", TOOL_VERSIONS)
    assert f"v{old['version']}" == f"v{old['appVersion']}" == tag


def test_every_image_the_chart_renders_is_the_one_make_image_tags(helm: Path) -> None:
    """With image.tag unset (the default), the agent, the webhook, the MPS daemon pods'
    template and the admission policy that checks those pods' image all name the image
    `make image` builds from pyproject.toml's version, and every object carries that
    version in its label."""
    assert VALUES["image"]["tag"] == ""
    rendered = h.run(helm, "template", "gpudra", str(h.CHART), "--namespace", "gpudra")
    images = re.findall(re.escape(VALUES["image"]["repository"]) + r":[^\s'\"\\]+", rendered)
    assert images
    assert set(images) == {f"{VALUES['image']['repository']}:{VERSION}"}
    objects: list[dict[str, Any]] = [d for d in yaml.safe_load_all(rendered) if d]
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/version") == VERSION, obj["metadata"]["name"]
    (daemonset,) = [o for o in objects if o["kind"] == "DaemonSet"]
    assert daemonset["metadata"]["name"] == "gpudra-node"  # what validate.yaml looks up


def test_an_image_tag_set_overrides_the_version_but_not_the_label(helm: Path) -> None:
    objects = h.template(helm, {"image": {"tag": "custom"}})
    ds = h.find(objects, "DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"{VALUES['image']['repository']}:custom"
    assert ds["metadata"]["labels"]["app.kubernetes.io/version"] == VERSION


def test_the_install_guide_names_this_version() -> None:
    """docs/install.md's kind section loads what `make image` writes:
    dist/gpudra-<version>.oci.tar, named ghcr.io/gpudra/gpudra:<version> (a version
    written out, not the placeholder)."""
    text = (REPO / "docs" / "install.md").read_text()
    archives = re.findall(r"dist/gpudra-([0-9][^\s/`]*)\.oci\.tar", text)
    tags = re.findall(re.escape(VALUES["image"]["repository"]) + r":([0-9][^\s`'\"]*)", text)
    assert archives and tags
    assert set(archives) == set(tags) == {VERSION}
