"""The JSON lines every component logs."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path

import pytest
from gpudra.cli import logs

_TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def test_each_record_is_one_json_line_with_its_fields(capsys: pytest.CaptureFixture[str]) -> None:
    # `logs.setup` configures the whole process; tests/conftest.py puts it back.
    logs.setup("info")
    log = logging.getLogger("gpudra.test")
    log.debug("not at info")
    log.info("claim prepared", extra={"fields": {"claim": "ü-1", "root": Path("/var/run/cdi")}})
    try:
        raise ValueError("broken")
    except ValueError:
        log.exception("prepare failed")

    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert _TS.fullmatch(first.pop("ts"))
    assert first == {
        "level": "info",
        "logger": "gpudra.test",
        "msg": "claim prepared",
        "claim": "ü-1",
        "root": "/var/run/cdi",  # what JSON has no type for is written as its str()
    }
    assert second["level"] == "error" and "ValueError: broken" in second["exc"]


def test_every_line_carries_its_own_time_to_the_millisecond() -> None:
    formatter = logs.JsonFormatter()
    stamps = []
    for created in (1_700_000_000.25, 1_700_000_000.75, 1_700_000_001.5, 1_600_000_000.0):
        record = logging.LogRecord("gpudra.test", logging.INFO, "", 0, "m", None, None)
        record.created, record.msecs = created, (created % 1) * 1000
        stamps.append(json.loads(formatter.format(record))["ts"])
    assert stamps == [
        "2023-11-14T22:13:20.250Z",
        "2023-11-14T22:13:20.750Z",
        "2023-11-14T22:13:21.500Z",
        "2020-09-13T12:26:40.000Z",
    ]


def test_lines_go_whole_to_the_file_descriptor_from_every_thread(tmp_path: Path) -> None:
    # The node's handler writes bytes to stderr's descriptor, one write per line.
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        handler = logs.LineHandler(fd)
        log = logging.getLogger("gpudra.test.lines")
        log.addHandler(handler)
        log.propagate = False

        def lines(n: int) -> None:
            # Longer than a pipe writes whole: the handler's lock keeps them apart.
            for i in range(50):
                log.warning("line", extra={"fields": {"thread": n, "i": i, "pad": "x" * 5000}})

        try:
            threads = [threading.Thread(target=lines, args=(n,)) for n in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            log.removeHandler(handler)
            log.propagate = True
    finally:
        os.close(fd)
    entries = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert sorted((e["thread"], e["i"]) for e in entries) == [
        (n, i) for n in range(4) for i in range(50)
    ]
    assert all(e["msg"] == "line" and e["level"] == "warning" for e in entries)


def test_setup_writes_to_stderr_s_descriptor_when_it_has_one(
    capfd: pytest.CaptureFixture[str],
) -> None:
    logs.setup("info")
    assert isinstance(logging.getLogger().handlers[0], logs.LineHandler)
    logging.getLogger("gpudra.test").info("claim prepared", extra={"fields": {"claim": "c-1"}})
    entry = json.loads(capfd.readouterr().err)
    assert entry["msg"] == "claim prepared" and entry["claim"] == "c-1"
