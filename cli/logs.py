"""Structured (JSON lines) logging for every component.

One line per event with stable keys, so node agents and the webhook can be
searched with ordinary log tooling; extra context goes in `extra={"fields": {...}}`.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from gpudra.api import jsonbytes
from gpudra.common.files import write_all


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
        return self.line(record)[:-1].decode()

    def line(self, record: logging.LogRecord) -> bytes:
        """The record's line as the bytes to write, its newline included: a handler
        that writes bytes encodes nothing twice."""
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
        return jsonbytes.dumps(entry, default=str) + b"\n"


class LineHandler(logging.Handler):
    """Each record's line, written with one write(2) to the file descriptor `fd`.

    A StreamHandler on sys.stderr decodes the formatter's bytes, has the text layer
    encode them again and flushes it, for every line: measured on the prepare path of
    a node, about half of what its two lines per claim cost. A line shorter than the
    pipe's atomic size (4 KiB) reaches a pipe whole even beside other writers; a longer
    one (a traceback) takes several writes, which the handler's lock keeps apart from
    logging's other lines, though not from what else writes to stderr directly
    (warnings, an uncaught thread exception) at that moment."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._lines = JsonFormatter()
        self.setFormatter(self._lines)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_all(self._fd, self._lines.line(record))
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def _handler(stream: TextIO) -> logging.Handler:
    """A LineHandler on `stream`'s file descriptor; a StreamHandler where it has none
    (a test's captured stderr)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # none, or closed
        handler: logging.Handler = logging.StreamHandler(stream)
        handler.setFormatter(JsonFormatter())
        return handler
    stream.flush()  # what it holds goes before the handler's first line
    return LineHandler(fd)


def setup(level: str = "info") -> None:
    """JSON lines on stderr at `level`, for the whole process.

    A line carries no source file, thread or process: the logging HOWTO's switches for
    those are turned off, so no record pays for looking them up (a tenth of a line's
    cost, on every claim's path)."""
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [_handler(sys.stderr)]
    root.setLevel(level.upper())
