"""The shell commands of README.md and docs/, each either run by a test or marked why not.

A shell block (a fence of `sh`, `bash`, `shell` or `console`) is preceded, on the line
before its fence, by one marker:

- ``<!-- doc-test: run -->``: `e2e/tests/test_doc_commands.py` runs it against the local
  cluster, with the blocks before it in the same file, in order, in one folder;
- ``<!-- doc-test: kind -->``: the same test runs it against the kind cluster of `make
  e2e-kind` (with the file's other kind blocks, in order, from the checkout), so the
  kind walk-through in docs/install.md is what that run did;
- ``<!-- doc-test: not runnable: <reason> -->``: the reason it cannot run there (a
  placeholder such as ``<node>``, a device plugin or a GPU node the local cluster lacks).

Only fences at the start of a line count, as in the docs (no indented or tilde fences),
so a line scan is enough and no Markdown parser is needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SHELL_LANGUAGES = frozenset({"sh", "bash", "shell", "console"})
RUN = "run"
MARKER = re.compile(
    r"<!-- doc-test: (?:(?P<run>run)|(?P<kind>kind)|not runnable: (?P<reason>\S.*?)) -->"
)
_FENCE = re.compile(r"```(?P<lang>[A-Za-z]*)\s*$")


@dataclass(frozen=True)
class ShellBlock:
    path: Path
    line: int
    """1-based line of the opening fence, for messages."""
    code: str
    runs: bool
    """Run against the local cluster."""
    on_kind: bool
    """Run against the kind cluster instead."""
    reason: str
    """Why it does not run ("" when it runs, or when unmarked)."""
    marked: bool

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def doc_files(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def shell_blocks(path: Path) -> list[ShellBlock]:
    """The shell blocks of one Markdown file, in order, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[ShellBlock] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), len(lines))
        if fence["lang"] in SHELL_LANGUAGES:
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            blocks.append(
                ShellBlock(
                    path=path,
                    line=i + 1,
                    code="\n".join(lines[i + 1 : end]) + "\n",
                    runs=bool(marker and marker["run"]),
                    on_kind=bool(marker and marker["kind"]),
                    reason=(marker["reason"] or "") if marker else "",
                    marked=marker is not None,
                )
            )
        i = end + 1
    return blocks
