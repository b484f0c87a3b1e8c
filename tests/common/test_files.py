"""Writes that must not stop half way: `write_all`."""

from __future__ import annotations

import os
import threading
import time

from gpudra.common.files import write_all


def test_a_full_non_blocking_pipe_is_waited_on_not_left_with_half_a_line() -> None:
    # A log line longer than the pipe has room for, on a descriptor another process made
    # non-blocking: the rest goes once the reader makes room, and nothing is lost.
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        room = 65536
        try:
            room = os.write(write_end, b"x" * room)
        except BlockingIOError:
            room = 0
        line = b'{"msg":"claim prepared","pad":"' + b"y" * 10000 + b'"}\n'
        received: list[bytes] = []

        def reader() -> None:
            time.sleep(0.2)  # the writer finds the pipe full first
            wanted = room + len(line)
            while sum(map(len, received)) < wanted:
                received.append(os.read(read_end, 4096))

        thread = threading.Thread(target=reader)
        thread.start()
        write_all(write_end, line)
        thread.join(10)
        assert not thread.is_alive()
        data = b"".join(received)
        assert data == b"x" * room + line
    finally:
        os.close(read_end)
        os.close(write_end)
