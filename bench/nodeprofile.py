"""Run a Python module (`gpudra node`) with a CPU profile of its event-loop thread that
the benchmark switches on and off.

    python -m bench.nodeprofile --out FILE -- -m gpudra.cli node ...

SIGUSR1 starts a cProfile of the main thread, SIGUSR2 stops it and writes it to FILE
(whole, by rename, so a reader never sees half of it). The bench sends them around its
measured cycles, so process start, recovery and warm-up stay out of the profile.

The profile keeps cProfile's own clock, the wall clock: a thread-CPU clock costs a
system call per event and made the node three times slower under it, which distorts
more than it tells. Time the loop spends waiting in epoll for the next call is
therefore in the profile; the bench reports it apart from the functions. What the other
threads burn (worker threads writing files, gRPC's core threads) is not in it; the
bench reads that per thread from /proc.
"""

from __future__ import annotations

import argparse
import cProfile
import runpy
import signal
import sys
from pathlib import Path
from types import FrameType


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.nodeprofile")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if len(command) < 2 or command[0] != "-m":
        parser.error("give the module to run after --: -- -m MODULE [ARGS...]")
    profiler = cProfile.Profile()

    def start(_signum: int, _frame: FrameType | None) -> None:
        profiler.enable()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        profiler.disable()
        temp = args.out.with_name(f".{args.out.name}.tmp")
        profiler.dump_stats(str(temp))
        temp.replace(args.out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [command[1], *command[2:]]
    runpy.run_module(command[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
