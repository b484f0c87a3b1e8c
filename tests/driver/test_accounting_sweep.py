"""Accounting splits an interval among a device's holders with one sweep over the
holder changes: a node that prepares and unprepares claims many times between two
samples (short jobs, CI pods, the prepare benchmark) bills each sample in time that
grows with the changes, not with their square, and bills exactly what scanning every
claim's spans for every piece of the interval did."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

import pytest
from gpudra.driver.accounting import _device_seconds, _holder_id, _spans
from gpudra.driver.holders import (
    ADMIN,
    EXCLUSIVE,
    MEMORY_SLICE,
    MPS,
    TIME_SLICING,
    UNKNOWN,
    HeldDevice,
    Holder,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.driver.test_accounting_spans import l4_node, prepared, unprepared, uuid_of
from tests.driver.test_device_metrics import billed, claim

pytestmark = pytest.mark.anyio

_Span = tuple[float, float]
_Views = list[tuple[HeldDevice, dict[str, tuple[Holder, ...]]]]

START, END = 1000.0, 1010.0


def _covers(spans: Iterable[_Span], start: float, end: float) -> bool:
    return any(s <= start and end <= e for s, e in spans)


def reference_seconds(
    views: Sequence[tuple[HeldDevice, Mapping[str, tuple[Holder, ...]]]],
    spans: Mapping[str, tuple[list[_Span], list[_Span]]],
    start: float,
    end: float,
) -> dict[tuple[str, str], float]:
    """The split as first written, the plain reading of the rule: for every piece
    between two cuts, every claim whose spans cover it, each view on its own."""
    cuts = sorted({start, end, *(t for b, u in spans.values() for span in (*b, *u) for t in span)})
    least: dict[tuple[str, str], float] | None = None
    for device, holders_of in views:
        seconds: dict[tuple[str, str], float] = {}
        for a, b in itertools.pairwise(cuts):
            present = [
                uid for uid, (billed, unsure) in spans.items() if _covers((*billed, *unsure), a, b)
            ]
            if not present:
                continue
            piece = replace(device, holders=tuple(h for uid in present for h in holders_of[uid]))
            for holder, share in piece.shares():
                if _covers(spans[holder.claim_uid][0], a, b):
                    ident = _holder_id(holder)
                    seconds[ident] = seconds.get(ident, 0.0) + (b - a) * share
        least = (
            seconds
            if least is None
            else {k: min(v, seconds[k]) for k, v in least.items() if k in seconds}
        )
    return least or {}


# Times on a coarse grid, so that changes often coincide (pieces of no length, a claim
# leaving as another comes), and anywhere, in and a little outside the interval.
_TIMES = st.one_of(
    st.integers(-2, 22).map(lambda half: START + half / 2),
    st.floats(START - 3, END + 3, allow_nan=False),
)

_HOLDER = st.tuples(
    st.sampled_from((EXCLUSIVE, TIME_SLICING, MPS, MEMORY_SLICE, ADMIN, UNKNOWN)),
    st.sampled_from(("gpu", "gpu-2")),
    st.one_of(st.none(), st.integers(1, 8)),
    st.one_of(st.none(), st.sampled_from((1, 5, 10, 40))),
)

_DEVICE = st.tuples(
    st.sampled_from((None, 1.0, 1 / 7, 3 / 7, 0.5)),
    st.one_of(st.none(), st.integers(0, 8)),
    st.one_of(st.none(), st.sampled_from((0, 20, 40))),
)


def holders(
    uid: str, specs: Sequence[tuple[str, str, int | None, int | None]]
) -> tuple[Holder, ...]:
    return tuple(
        Holder(
            f"ns-{uid}",
            f"pod-{uid}",
            f"claim-{uid}",
            uid,
            request,
            sharing,
            shares=shares,
            memory=memory,
        )
        for sharing, request, shares, memory in specs
    )


def device(spec: tuple[float | None, int | None, int | None]) -> HeldDevice:
    compute, published, memory_total = spec
    return HeldDevice(
        "gpu-0", "GPU-0", "GPU-0", False, (), published, compute=compute, memory_total=memory_total
    )


@st.composite
def claims_and_views(
    draw: st.DrawFn, spans_of: st.SearchStrategy[tuple[list[_Span], list[_Span]]]
) -> tuple[_Views, dict[str, tuple[list[_Span], list[_Span]]]]:
    """Up to six claims on one device, each with its spans and, per view, its holders
    (as the two samples saw them: their shares may differ), and the device per view."""
    uids = [f"u{i}" for i in range(draw(st.integers(0, 6)))]
    spans = {uid: draw(spans_of) for uid in uids}
    views: _Views = []
    for _ in range(2):
        held = {uid: holders(uid, draw(st.lists(_HOLDER, min_size=1, max_size=2))) for uid in uids}
        views.append((device(draw(_DEVICE)), held))
    return views, spans


# A claim's spans as `_spans` makes them from the samples at both ends and what the
# preparer told in between.
_TOLD = st.builds(
    lambda before, after, changes: _spans(before, after, changes, START, END),
    st.booleans(),
    st.booleans(),
    st.lists(st.tuples(st.booleans(), _TIMES), max_size=12),
)

# Any spans at all, unsorted, overlapping, of no length or backwards.
_ANY = st.tuples(
    st.lists(st.tuples(_TIMES, _TIMES), max_size=5),
    st.lists(st.tuples(_TIMES, _TIMES), max_size=3),
)


@settings(max_examples=400, deadline=None, database=None, derandomize=True)
@given(case=claims_and_views(_TOLD))
def test_the_sweep_bills_what_scanning_every_claim_for_every_piece_did(
    case: tuple[_Views, dict[str, tuple[list[_Span], list[_Span]]]],
) -> None:
    """The same GPU-seconds to the last bit, for the same holders in the same order
    (the order the counters are summed in), whatever claims came and went, told or
    not, whatever their shares in either view."""
    views, spans = case
    got = _device_seconds(views, spans, START, END)
    assert list(got.items()) == list(reference_seconds(views, spans, START, END).items())


@settings(max_examples=200, deadline=None, database=None, derandomize=True)
@given(case=claims_and_views(_ANY))
def test_the_sweep_needs_no_span_list_sorted_or_apart(
    case: tuple[_Views, dict[str, tuple[list[_Span], list[_Span]]]],
) -> None:
    """The sweep counts each claim's open spans rather than assuming the order
    `_spans` makes them in, so it bills as the scan did whatever the spans."""
    views, spans = case
    got = _device_seconds(views, spans, START, END)
    assert list(got.items()) == list(reference_seconds(views, spans, START, END).items())


def test_a_claim_that_held_nothing_in_the_interval_is_billed_nothing() -> None:
    """Pieces nobody held are billed to nobody; a claim whose spans have no length
    (prepared and unprepared at one time) is no holder anywhere."""
    sliced = [(TIME_SLICING, "gpu", None, None)]
    views: _Views = [(device((1.0, None, None)), {u: holders(u, sliced) for u in ("u1", "u2")})]
    spans: dict[str, tuple[list[_Span], list[_Span]]] = {
        "u1": ([(1002.0, 1004.0)], []),
        "u2": ([(1003.0, 1003.0)], []),
    }
    assert _device_seconds(views, spans, START, END) == {("u1", "gpu"): 2.0}


async def test_a_claim_prepared_thousands_of_times_in_an_interval_is_billed_its_time() -> None:
    """Eight claims take turns on a time-sliced GPU, each holding it 1/128 s at a time
    with 1/128 s free between: 4096 changes in a 32 s interval. Alone they are billed
    exactly the half of the interval they held it; beside a claim that holds it
    throughout, half of that, and the other claim the rest."""
    node = l4_node(interval_s=32)
    uuid = uuid_of(node)

    def churn() -> None:
        for turn in range(2048):
            uid = f"ci-{turn % 8}"
            prepared(node, claim(uid, "ci", uid, "gpu-0", uuid, time_slice=True))
            node.clock.now += 1 / 128
            unprepared(node, uid)
            node.clock.now += 1 / 128

    await node.sampler.sample_once()
    churn()
    await node.sampler.sample_once()
    assert billed(node) == {"ci": pytest.approx(16)}
    prepared(node, claim("long", "team-a", "long", "gpu-0", uuid, time_slice=True))
    churn()
    await node.sampler.sample_once()
    assert billed(node) == {"ci": pytest.approx(16 + 8), "team-a": pytest.approx(16 + 8)}


def test_holders_are_billed_in_the_order_of_the_claims_not_of_their_coming() -> None:
    """A device's counters are summed holder by holder, so the order is kept as the
    claims are listed, not as they came: u1 came first but was billed nothing alone
    (shares of a device not published with any), and from u0's coming both are billed
    half, u0 listed first."""
    views: _Views = [
        (
            device((1.0, None, None)),
            {
                "u0": holders("u0", [(TIME_SLICING, "gpu", None, None)]),
                "u1": holders("u1", [(TIME_SLICING, "gpu", 3, None)]),
            },
        )
    ]
    spans: dict[str, tuple[list[_Span], list[_Span]]] = {
        "u0": ([(1005.0, 1010.0)], []),
        "u1": ([(1000.0, 1010.0)], []),
    }
    got = _device_seconds(views, spans, START, END)
    assert list(got.items()) == [(("u0", "gpu"), 2.5), (("u1", "gpu"), 2.5)]
    assert list(got.items()) == list(reference_seconds(views, spans, START, END).items())
