"""A long-running process's start-up heap, kept out of the garbage collector's full
passes.

CPython's full collection walks every object the collector tracks. Most of those in
the node agent are made once, at start: its modules (the API client, gRPC, pydantic,
the generated protobuf classes), the inventory and the kubelet plugin, about 70,000
objects. Walking them takes 20 to 40 ms on a small node, on the event loop's thread,
and the agent serves nothing meanwhile: measured under `make bench-prepare`, a full
collection came every 1,300 to 1,600 prepares and took 19 to 43 ms, and every prepare
in flight during one took 31 to 37 ms instead of 7. `gc.freeze()` moves those objects
to a permanent generation that collections skip; a full collection then took 0.3 to
0.5 ms.

The price: a frozen object that later becomes garbage inside a reference cycle is
never freed (objects without cycles still go when their last reference does). What is
frozen is what start-up built and keeps for the process's life, so that is bounded
by the start-up heap, once.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, so that start-up's garbage is freed rather than kept, then freeze
    every object the collector now tracks; returns how many are frozen.

    Call it once the process has built what it keeps (for the agent: once it is
    ready), from the process's entry point: it changes the whole interpreter's
    collector, which a library has no business doing.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
