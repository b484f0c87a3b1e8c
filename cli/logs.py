"""Structured (JSON lines) logging for every component.

One line per event with stable keys, so node agents and the webhook can be
searched with ordinary log tooling; extra context goes in `extra={"fields": {...}}`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from gpudra.api import jsonbytes


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line.

    The node agent logs each prepare and unprepare, from the thread that answers the
    kubelet, so a line's cost is on every claim's path: the encoding is the project's
    one codec (orjson, with `str` for values JSON has no type for), and the timestamp's
    date and time of day are formatted once per second, not once per line."""

    def __init__(self) -> None:
        super().__init__()
        self._second: tuple[int, str] = (-1, "")

    def _stamp(self, created: float) -> str:
        second = int(created)
        cached = self._second
        if cached[0] != second:
            cached = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
            self._second = cached
        return cached[1]

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": f"{self._stamp(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return jsonbytes.dumps(entry, default=str).decode()


def setup(level: str = "info") -> None:
    """JSON lines on stderr at `level`, for the whole process.

    A line carries no source file, thread or process: the logging HOWTO's switches for
    those are turned off, so no record pays for looking them up (a tenth of a line's
    cost, on every claim's path)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
