"""docs/kueue.md shows the manifests the Kueue tests apply: each YAML block introduced
by a `demo/kueue/<file>.yaml` reference is that file, word for word, so the page cannot
drift from what was tested."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "kueue.md"
SHOWN = re.compile(r"\(`(demo/kueue/[0-9a-z-]+\.yaml)`\)[^`]*?```yaml\n(.*?)```", re.DOTALL)


def test_every_manifest_shown_is_the_tested_file() -> None:
    shown = SHOWN.findall(PAGE.read_text())
    assert len(shown) >= 5, "docs/kueue.md no longer shows the demo/kueue manifests"
    for path, text in shown:
        assert text == (REPO / path).read_text(), f"docs/kueue.md differs from {path}"


def test_every_manifest_file_is_shown() -> None:
    shown = {path for path, _text in SHOWN.findall(PAGE.read_text())}
    files = {str(p.relative_to(REPO)) for p in (REPO / "demo" / "kueue").glob("*.yaml")}
    assert files == shown
