from __future__ import annotations

from gpudra.common.errors import exception_text


def test_an_exception_reads_as_its_type_and_message_or_its_type_alone() -> None:
    assert exception_text(OSError("disk full")) == "OSError: disk full"
    assert exception_text(TimeoutError()) == "TimeoutError"
