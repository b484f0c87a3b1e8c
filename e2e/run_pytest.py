"""Runs pytest and treats "no tests collected" (exit 5) as a failure with a clear line.

A green run that executed nothing would hide a broken test layout.
"""

from __future__ import annotations

import sys

import pytest


def main(argv: list[str]) -> int:
    code = int(pytest.main(argv))
    if code == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("run_pytest: no tests were collected; check testpaths and markers", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
