"""Shared by every unit test: the process's logging as it was before the test.

`gpudra.cli.main.main` run in-process (the CLI tests, the chart's migration tests)
configures logging for the whole process (`gpudra.cli.logs.setup`): one handler on the
stderr of that moment, which under pytest is the test's capture, closed after it when
the test took `capsys`. Left in place, every later record of the run went to that
closed stream and printed a "Logging error" traceback instead (the e2e tests' node
agents log on every health event)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def restored_logging() -> Iterator[None]:
    """The root logger's handlers and level, and the switches `logs.setup` turns off,
    put back after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    switches = (
        logging._srcfile,
        logging.logThreads,
        logging.logProcesses,
        logging.logMultiprocessing,
    )
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    (
        logging._srcfile,
        logging.logThreads,
        logging.logProcesses,
        logging.logMultiprocessing,
    ) = switches


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder with a short path, for a kubelet root: the plugin's sockets under
    pytest's `tmp_path` can pass the 107-byte unix socket limit, which the agent refuses
    at its start."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="gd"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
