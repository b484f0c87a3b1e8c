"""`make test-versions`: the end-to-end suites that touch the API, on every pinned
Kubernetes version one after another, and a table of what passed, failed and skipped
(with the reason) on each.

Why a runner of its own: one `make test` runs one version (`K8S_VERSION`), and managed
clusters lag the newest release. Each version gets its own control plane (and real node,
where the machine can run one) in `.cluster-versions/`, started by the suites' own
`cluster` fixture and stopped after them, so a cluster of another version that is
already up is never reused. Features a version lacks are detected by the tests at run
time (`e2e/features.py`) and skip with that reason, which the table repeats.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from e2e.cluster.harness import BUILD_SCRIPT, REPO
from e2e.pins import CLUSTER_VERSIONS
from e2e.progress import BuildFailed, build_script, duration

STATE = REPO / ".cluster-versions"
# The suites that talk to the API server (and, on the real node, the kubelet).
SUITES = (
    "e2e/tests/test_inventory.py",
    "e2e/tests/test_webhook.py",
    "e2e/tests/test_tenants.py",
    "e2e/tests/test_realnode_gpus.py",
    "e2e/tests/test_chart.py",
)
PIN_LINE = re.compile(r"^K8S_PIN_1_(\d+)=(v1\.\d+\.\d+)\s*$")


@dataclass
class Row:
    """One version's outcome; `error` is set when its suites could not run at all."""

    version: str
    passed: int = 0
    failed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0
    error: str = ""


def pinned() -> dict[str, str]:
    """`1.NN` -> pinned patch, in version order, from the one file that pins them."""
    pins = {}
    for line in CLUSTER_VERSIONS.read_text().splitlines():
        if m := PIN_LINE.match(line):
            pins[f"1.{m.group(1)}"] = m.group(2)
    return dict(sorted(pins.items(), key=lambda kv: int(kv[0].split(".")[1])))


def chosen(raw: str, pins: dict[str, str]) -> list[str]:
    """The minors `--versions` names (all pinned ones when empty); an unknown one is
    refused with the list of supported ones."""
    if not raw.strip():
        return list(pins)
    wanted = [v.strip().removeprefix("v") for v in raw.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in pins]
    if unknown:
        raise SystemExit(
            f"test-versions: unknown version(s) {', '.join(unknown)} in VERSIONS: "
            f"supported are {', '.join(pins)}"
        )
    return wanted


def read_junit(path: Path, row: Row) -> None:
    """Counts each test case of a pytest JUnit report into `row`; a skip counts under
    its reason, an error (a failed fixture) as a failure."""
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            row.failed += 1
        elif "skipped" in outcome:
            skip = case.find("skipped")
            message = skip.get("message", "") if skip is not None else ""
            row.skipped[message.removeprefix("Skipped: ") or "no reason given"] += 1
        else:
            row.passed += 1


def table(rows: list[Row]) -> str:
    """The matrix as a Markdown table, each skip reason on a line of its own below."""
    lines = [
        "| version | passed | failed | skipped | time |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        skipped = sum(r.skipped.values())
        failed = f"{r.failed} ({r.error})" if r.error else str(r.failed)
        lines.append(f"| {r.version} | {r.passed} | {failed} | {skipped} | {duration(r.seconds)} |")
    for r in rows:
        for reason, n in sorted(r.skipped.items()):
            lines.append(f"- {r.version}: {n} skipped: {reason}")
    return "\n".join(lines)


def run_version(minor: str, pin: str, suites: list[str], pytest_args: list[str]) -> Row:
    row = Row(pin)
    env = {**os.environ, "K8S_VERSION": minor, "GPUDRA_CLUSTER_DIR": str(STATE / "cluster")}
    env.pop("GPUDRA_KEEP_CLUSTER", None)
    start = time.monotonic()
    try:
        build_script(BUILD_SCRIPT, prefix="build", what=f"building Kubernetes {pin}", env=env)
    except BuildFailed as e:
        row.error = f"build failed: {e}"
        row.failed = 1
        return row
    # A cluster an interrupted run left (of this or another version) goes first.
    subprocess.run(
        [sys.executable, "-m", "e2e.cluster", "down"],
        cwd=REPO,
        env=env,
        capture_output=True,
        check=False,
    )
    report = STATE / f"junit-{minor}.xml"
    report.unlink(missing_ok=True)
    print(f"test-versions: Kubernetes {pin}: {' '.join(suites)}", file=sys.stderr, flush=True)
    proc = subprocess.run(
        [sys.executable, "e2e/run_pytest.py", *pytest_args, f"--junitxml={report}", *suites],
        cwd=REPO,
        env=env,
        check=False,
    )
    row.seconds = time.monotonic() - start
    if report.is_file():
        read_junit(report, row)
    if proc.returncode not in (0, 1) and not row.failed:
        row.error = f"pytest exited {proc.returncode}"
        row.failed = 1
    return row


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.versions", description=__doc__)
    parser.add_argument(
        "--versions", default="", help="comma-separated minors (default: every pinned one)"
    )
    parser.add_argument(
        "--suites", default=",".join(SUITES), help="comma-separated test files or node ids"
    )
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    pins = pinned()
    suites = [s for s in args.suites.split(",") if s]
    STATE.mkdir(exist_ok=True)
    rows = [run_version(m, pins[m], suites, args.pytest_args) for m in chosen(args.versions, pins)]
    print(table(rows))
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
