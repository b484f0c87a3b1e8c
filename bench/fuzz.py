"""make fuzz: the property-based fuzz tests (tests/fuzz) with many fresh random cases.
Writes bench/results/fuzz.json.

`make test` runs the same tests with a fixed seed and a few dozen cases each; this runs
them under the ``long`` hypothesis profile (new random cases every run, ``--examples``
per test) and records, per target (the webhook's HTTP layer, its admission endpoints,
the opaque-config, quantity and checkpoint parsers, and recover()), how many cases ran
and which tests failed. The bar is no failure at all: no unhandled exception, no hang,
no HTTP 500. Tests marked xfail pin findings whose fix lives elsewhere; they are listed
as known, apart from the failures.

Cases are counted from hypothesis's observations of each test case (its documented
observability hook), so they include the explicit and the shrinking runs; a test
without @given counts as one case.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpudra.common.files import atomic_write

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "fuzz.json"
TESTS = ROOT / "tests" / "fuzz"


@dataclass
class _Test:
    cases: int = 0
    rejected: int = 0
    outcome: str = "not run"
    message: str = ""


@dataclass
class Recorder:
    """A pytest plugin: cases and outcome of every fuzz test."""

    tests: dict[str, _Test] = field(default_factory=dict)

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # Imported once pytest has set up assertion rewriting for hypothesis's plugin.
        from hypothesis.internal import observability  # noqa: PLC0415

        # Per-case line coverage is for other consumers of observations, and slow on 3.11.
        observability.OBSERVABILITY_COLLECT_COVERAGE = False

    def _test(self, nodeid: str) -> _Test:
        return self.tests.setdefault(nodeid, _Test())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        from hypothesis.internal.observability import (  # noqa: PLC0415 - after the profile
            add_observability_callback,
            remove_observability_callback,
        )

        test = self._test(item.nodeid)

        def observe(observation: Any) -> None:
            if observation.type != "test_case":
                return
            if observation.status == "gave_up":
                test.rejected += 1
            else:
                test.cases += 1

        add_observability_callback(observe)
        try:
            yield
        finally:
            remove_observability_callback(observe)
            if test.cases == 0:
                test.cases = 1  # a plain test: one case

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self._test(report.nodeid)
        if report.when == "call" or report.outcome != "passed":
            if hasattr(report, "wasxfail"):
                test.outcome = "xfailed (known)" if report.skipped else "xpassed"
                test.message = str(report.wasxfail)
            elif report.outcome == "failed":
                test.outcome = "failed"
                test.message = report.longreprtext.strip().splitlines()[-1][:300]
            elif test.outcome in ("not run", "passed"):
                test.outcome = report.outcome


def _target(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return module.removeprefix("test_").removesuffix(".py")


def summary(recorder: Recorder, examples: int, seconds: float) -> dict[str, Any]:
    targets: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, str]] = []
    known: list[dict[str, str]] = []
    for nodeid, test in sorted(recorder.tests.items()):
        target = targets.setdefault(
            _target(nodeid), {"cases": 0, "failures": 0, "known": 0, "tests": {}}
        )
        target["cases"] += test.cases
        name = nodeid.split("::", 1)[-1]
        target["tests"][name] = {"cases": test.cases, "outcome": test.outcome}
        if test.rejected:
            target["tests"][name]["rejected"] = test.rejected
        if test.outcome == "failed":
            target["failures"] += 1
            kind = "hang" if "Hang" in test.message else "failure"
            failures.append({"test": nodeid, "kind": kind, "message": test.message})
        elif test.outcome.startswith("xfailed"):
            target["known"] += 1
            known.append({"test": nodeid, "reason": test.message})
    totals = {
        "cases": sum(t["cases"] for t in targets.values()),
        "failures": len(failures),
        "hangs": sum(1 for f in failures if f["kind"] == "hang"),
        "known": len(known),
    }
    return {
        "profile": "long",
        "examples_per_test": examples,
        "duration_s": round(seconds, 1),
        "bar": "0 unhandled exceptions, 0 hangs, 0 HTTP 500 (any failure breaks it)",
        "met": not failures,
        "totals": totals,
        "targets": targets,
        "failures": failures,
        "known_findings": known,
        "python": platform.python_version(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--examples", type=int, default=2000, help="cases per test")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    # Read by tests/fuzz/conftest.py when it registers the profiles.
    os.environ["GPUDRA_FUZZ_PROFILE"] = "long"
    os.environ["GPUDRA_FUZZ_EXAMPLES"] = str(args.examples)
    # The parsers log every bad record they keep; the webhook tests collect errors
    # themselves. Nothing else needs the records, nor stderr full of them.
    logging.getLogger().addHandler(logging.NullHandler())
    recorder = Recorder()
    started = time.monotonic()
    code = pytest.main(
        [
            str(TESTS),
            "-q",
            "-p",
            "no:logging",
            "--timeout=1800",
            "-o",
            "console_output_style=classic",
        ],
        plugins=[recorder],
    )
    result = summary(recorder, args.examples, time.monotonic() - started)
    atomic_write(args.out, (json.dumps(result, indent=2) + "\n").encode())
    totals = result["totals"]
    print(
        f"fuzz: {totals['cases']} cases, {totals['failures']} failures, {totals['hangs']} "
        f"hangs, {totals['known']} known findings -> {args.out.relative_to(ROOT)}",
        file=sys.stderr,
    )
    return 0 if code in (pytest.ExitCode.OK,) and result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
