"""The event loop gpudra's long-running processes run on: anyio's asyncio backend on
uvloop's loop.

uvloop's loop and its TLS transport are compiled, where asyncio's are Python. Measured
side by side, the same code costs less CPU on it where it talks over TLS: the webhook
about a tenth less per admission; simulated node agents starting against the API
server (discovery, their connections, list, watch and slice writes) about 15% less
(`docs/performance.md`); an agent's CPU is taken from the workloads on its node.
gRPC's asyncio server, anyio's worker threads and signal handling run on it unchanged.

One place, so that the webhook, the node agent and the benchmarks that stand in for
them all run on the same loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, TypeVarTuple

import anyio

__all__ = ["run_event_loop"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def run_event_loop(main: Callable[[*Ts], Awaitable[T]], *args: *Ts) -> T:
    """`anyio.run(main, *args)` on uvloop's loop."""
    return anyio.run(main, *args, backend_options={"use_uvloop": True})
