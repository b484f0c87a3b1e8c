"""Every shell command in README.md and docs/ is run by a test or says why it cannot be
(e2e/doc_commands.py); the run ones run in e2e/tests/test_doc_commands.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e2e.doc_commands import ShellBlock, doc_files, shell_blocks

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER = re.compile(r"<[a-z-]+>")


def every_block() -> list[ShellBlock]:
    return [b for f in doc_files(REPO) for b in shell_blocks(f)]


@pytest.mark.parametrize("block", every_block(), ids=lambda b: b.where)
def test_every_shell_block_runs_or_says_why_not(block: ShellBlock) -> None:
    assert block.marked, (
        f"{block.where}: mark the block <!-- doc-test: run --> (run against the local "
        "cluster), <!-- doc-test: kind --> (run against the kind cluster) or "
        "<!-- doc-test: not runnable: <reason> -->"
    )
    if block.runs or block.on_kind:
        assert not PLACEHOLDER.search(block.code), f"{block.where}: a run block has a placeholder"


def test_some_blocks_run() -> None:
    assert [b.where for b in every_block() if b.runs]


def test_markers_and_fences_are_read_as_written(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n\n<!-- doc-test: run -->\n```sh\necho one\necho two\n```\n\n"
        "```yaml\na: 1\n```\n"
        "<!-- doc-test: not runnable: needs a GPU -->\n```console\n$ x\n```\n"
        "```bash\nunmarked\n```\n"
        "<!-- doc-test: kind -->\n```sh\nkind load\n```\n"
    )
    blocks = shell_blocks(doc)
    assert [(b.line, b.code, b.runs, b.on_kind, b.reason, b.marked) for b in blocks] == [
        (4, "echo one\necho two\n", True, False, "", True),
        (13, "$ x\n", False, False, "needs a GPU", True),
        (16, "unmarked\n", False, False, "", False),
        (20, "kind load\n", False, True, "", True),
    ]
