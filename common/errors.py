"""How an exception reads in a log field or an error message."""

from __future__ import annotations

__all__ = ["exception_text"]


def exception_text(exc: BaseException) -> str:
    """The exception's type and message ("OSError: ..."), or its type alone when it has
    no message: many of asyncio's and ssl's carry none, and an empty field says
    nothing."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
