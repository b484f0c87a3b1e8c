"""freeze_startup_heap: start-up's live objects leave the collector's passes, its
garbage is freed rather than kept."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from gpudra.common.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The test process's collector as it was: nothing frozen before or after."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _tracked(obj: object) -> bool:
    """Whether a full collection walks `obj` (frozen objects are not in any generation)."""
    return any(o is obj for o in gc.get_objects())


@pytest.mark.usefixtures("unfrozen")
def test_live_objects_are_frozen_and_cyclic_garbage_is_freed() -> None:
    kept = _Node()
    kept.other = kept  # a cycle: only the collector could ever free it
    garbage = _Node()
    garbage.other = garbage
    gone = weakref.ref(garbage)
    del garbage
    assert _tracked(kept)

    frozen = freeze_startup_heap()

    assert gone() is None, "start-up's cyclic garbage was frozen instead of freed"
    assert not _tracked(kept), "a live start-up object is still walked by every collection"
    # Frozen objects freed since by their last reference going (the test's own
    # temporaries) leave the permanent generation, so the count can only have fallen.
    assert 0 < gc.get_freeze_count() <= frozen
    made_later = _Node()
    assert _tracked(made_later), "objects made after the freeze are collected as usual"
