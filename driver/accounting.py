"""GPU accounting: allocated and idle GPU-seconds per namespace, tenant, class and sharing.

Each sample (`gpudra.driver.sampling.Sample`) bills the interval since the previous one:
each holder of a device (a claim's request, by claim UID) is billed the part of the
interval it held the device, times its share of a whole GPU (`HeldDevice.shares`: a MIG
device is its compute slices' part of its GPU, a 1g of an A100 or H100 a seventh;
memory slices by their share of the GPU's memory; time-sliced and MPS holders split
their device equally; admin access not billed; a slice or shares whose basis is not
known, nothing: `gpudra.driver.holders` has the rules). So the counters are GPU-seconds
whatever the device: one GPU for one second is one, seven 1g instances held for a
second are one.

A claim holds its devices from its prepare completing to its unprepare: the preparer
tells the sampler's `HoldingLog` when, on the sampler's clock, with the checkpoint
change itself (`gpudra.driver.holders`). The interval is cut at each of those times
on the device, and each piece's time is split among the holders of that piece, each
at its share among them: a claim that came halfway through a 30 s interval onto a
time-sliced GPU another held pays a quarter of 30 s, the other three quarters. A claim
prepared and unprepared between two samples is billed at the next sample for the time
it held its devices, with the labels it had when it was unprepared. Since the shares
of one piece's holders add up to at most the device's part of its GPU, the GPU-seconds
billed for a device over an interval never exceed the interval. Times are as the event
loop saw them: a claim that changes while a pass reads NVML counts as changed at the
sample's time.

A holder change the agent was not told the time of (one whose entry the log dropped,
or whose checkpoint write failed) keeps the rule of the samples alone:
the samples do not say when in the interval it happened, so a holder seen at only one
end of the interval is billed nothing for it, and still counts as a holder when the
others' shares are split (a time-sliced holder whose co-holder left untold still pays
half). A dropped change between two told ones of the same claim (a release between
two holds) leaves the time between those two unbilled for it the same way (`_spans`).
A holder's share that changed between two samples with nobody coming or going
(an unread claim read, the GPU's shares published again) is billed at the smaller of
the two it had. Either way the time is never billed to a holder that did not hold the
device, nor shifted from a holder that left onto one that stayed, at the cost of up to
one sampling interval per such change unbilled. After an agent restart the counters
start at zero, and a claim prepared before it is billed from the first sample on.
Counters live in memory, as Prometheus counters may.

The time also counts as idle when the device's utilization was under `idle_below`
percent in this sample: for a whole GPU the mean of NVML's own samples since the
previous pass (the percent of time a kernel ran: `gpudra.driver.utilization`), for a
MIG device GPM's figure over the same span (the percent of its SMs busy, a different
measure that reads lower for the same work: `gpudra.driver.gpm`). A device whose
utilization NVML does not give (a MIG device without per-instance utilization) is
billed as allocated and never as idle: the agent does not know, and says so with the
`utilization_scope` label of its device series.

Use is the device's, never a holder's: NVML gives no utilization per process. Each
holder's billed time is idle or not with the whole device, so on a device shared by
several holders (time-slicing, MPS, memory slices, integer shares) a holder that ran
nothing beside a busy one is billed its part as used, and a busy one beside an idle
one is billed idle only when the device as a whole was. The split among holders is of
the time each was allocated, by what it took, not of who used it.

How long a device has been idle is kept per holder: a holder's idle time starts at the
first sample where it held the device idle, so a claim that gets a device another claim
left idle does not inherit the other's idle time (nor its idle alert).

A sample more than `STALE_AFTER_INTERVALS` sampling intervals after the previous one
follows a stall (a pass that hung in NVML, or kept failing): the samples do not say
what the devices did in between, so that time is billed to nobody, neither allocated
nor idle, not even to claims that came and went within it, and idle runs start again
at the sample after it. The metrics withdraw the device series once the latest sample
is that old (`gpudra.driver.metrics`).

Memory: between two samples the log keeps at most `DEFAULT_HOLDING_CHANGES` changes,
dropping the oldest and counting them (`gpudra_holding_changes_dropped_total`); a
dropped change only leaves time unbilled. Once billed, a sample's changes are gone:
the accounting keeps only the latest sample's holders. A counter (one per namespace,
tenant, class and sharing) is dropped once nothing has held a device under its labels
for `retain_s` (`DEFAULT_RETAIN_S`, a day): thousands of short-lived namespaces would
otherwise each keep two series until the agent restarts. Prometheus sees the series
end; `increase()` over a window that saw it counts what it grew by, and a counter
created again later starts from zero as a new series, as after an agent restart.

Each new series is first served at zero (`Accounting.serve`): `increase()` takes a
series' first sample as where it starts, so one first served at its count would never
have that count billed. Zero is served to every scrape for `zero_window_s`
(`DEFAULT_ZERO_WINDOW_S`) from the series' first, not to the first scrape only: the
agent cannot tell its readers apart (two Prometheus servers of an HA pair, `gpudra
top`, `gpudra report`, a person's curl), and a zero the first of them used up would
leave every other reader's first sample at the count. Each reader that scrapes at
least once within the window sees the zero; one that scrapes less often may not. Only
the keys not served yet and those within their window are kept for that, and they go
with their counters, or once their window has passed.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final, TypeAlias

from gpudra.driver.holders import ADMIN, HeldDevice, Holder
from gpudra.driver.sampling import Sample

__all__ = [
    "DEFAULT_IDLE_BELOW",
    "DEFAULT_RETAIN_S",
    "DEFAULT_ZERO_WINDOW_S",
    "STALE_AFTER_INTERVALS",
    "AccountKey",
    "Accounting",
    "IdleDevice",
    "Served",
    "holding",
    "stale_after",
]

DEFAULT_IDLE_BELOW: Final = 5.0
# A pass takes a fraction of an interval and starts one interval after the previous
# one ended: three intervals without a sample is a stall, not a slow pass.
STALE_AFTER_INTERVALS: Final = 3
# How long a counter nothing holds a device under is kept: a day, so a report over the
# last day from the agents' own counters still has the namespaces of the day.
DEFAULT_RETAIN_S: Final = 24 * 3600.0
# How long a new counter is served at zero from its first scrape: long enough for every
# reader scraping at the chart's PodMonitor interval (30 s) or Prometheus's default
# (1 m) to scrape within it even with one scrape failed or late.
DEFAULT_ZERO_WINDOW_S: Final = 120.0

# A holder of one device, the same from sample to sample: (claim UID, request).
_HolderId: TypeAlias = tuple[str, str]
# A span of time on the sampler's clock: (start, end).
_Span: TypeAlias = tuple[float, float]


@dataclass(frozen=True, slots=True, order=True)
class AccountKey:
    """What GPU-seconds are summed by."""

    namespace: str
    tenant: str
    device_class: str
    sharing: str


@dataclass(frozen=True, slots=True)
class IdleDevice:
    """A held device idle for `seconds` for `holders` (`holding`: never admin access):
    since each of them first held it idle (a shared device's holders that came at other
    times are other `IdleDevice`s)."""

    device: str
    uuid: str
    holders: tuple[Holder, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class Served:
    """One counter key as a scrape serves it: the GPU-seconds `allocated` and `idle`
    its two series show, and those they hold back (`withheld_allocated`,
    `withheld_idle`): all of them during the series' first window, none after."""

    allocated: float
    idle: float
    withheld_allocated: float = 0.0
    withheld_idle: float = 0.0


@dataclass(frozen=True, slots=True)
class _Seen:
    """What the accounting keeps of a sample until the next: its time and holders."""

    at: float
    held: Mapping[str, HeldDevice]


def _holder_id(holder: Holder) -> _HolderId:
    return holder.claim_uid, holder.request


def _account_key(holder: Holder) -> AccountKey:
    return AccountKey(holder.namespace, holder.tenant, holder.device_class, holder.sharing)


def stale_after(interval_s: float) -> float:
    """Seconds after which a sample no longer tells what a device sampled every
    `interval_s` is doing: a sampling stall."""
    return STALE_AFTER_INTERVALS * interval_s


def holding(held: HeldDevice) -> dict[_HolderId, Holder]:
    """Who holds a device, for its series and idle time: one holder per claim and
    request (one claim may hold two slices of a GPU for one request), and never an
    admin-access claim, which holds nothing (a monitoring pod on a free GPU)."""
    found: dict[_HolderId, Holder] = {}
    for holder in held.holders:
        if holder.sharing != ADMIN:
            found.setdefault(_holder_id(holder), holder)
    return found


def _spans(
    before: bool, after: bool, changes: Sequence[tuple[bool, float]], start: float, end: float
) -> tuple[list[_Span], list[_Span]]:
    """When in [start, end] one claim held one device: the spans whose both ends are
    known (billed), and those with an end the agent was not told (not billed, but the
    claim may have held the device then, so it counts when others' shares are split).

    `before` and `after`: whether the samples at `start` and `end` saw it hold the
    device; `changes`: what the preparer told in between, oldest first (held or not,
    when), taken as happening in order within the interval. A change that repeats the
    state before it follows one the agent was not told (the log dropped it, or its
    checkpoint write failed): a release between two holds, or a hold between two
    releases, at a time not known, so the span between the two is unsure. Taken as
    held throughout, it would bill the claim for a gap it held nothing in; as free
    throughout, its co-holders for its share.
    """
    billed: list[_Span] = []
    unsure: list[_Span] = []
    held, since = before, start
    for now_held, told_at in changes:
        at = min(max(told_at, since), end)
        if now_held == held:
            unsure.append((since, at))
        elif held:
            billed.append((since, at))
        held, since = now_held, at
    if held and after:
        billed.append((since, end))
    elif held or after:  # left, or came, at a time not told
        unsure.append((since, end))
    return billed, unsure


def _pieces(
    spans: Mapping[str, tuple[list[_Span], list[_Span]]], start: float, end: float
) -> Iterator[tuple[float, float, tuple[str, ...], frozenset[str]]]:
    """The pieces of [start, end] between one holder change and the next, each with
    the claims that held the device over it (billed or unsure), in `spans`' order (not
    the order they came in: a device's holders are billed, and their counters summed,
    in the order its samples list them), and those of them whose holding there is
    billed.

    One sweep over the changes in time order, keeping a count of the spans of each
    claim open at the piece: a claim prepared and unprepared thousands of times between
    two samples (short jobs, CI pods) costs time in the number of changes, not in
    changes times claims times spans, as scanning every claim's spans for every piece
    would. Every span's ends are cuts, so a span open at a piece's start covers the
    whole piece; the counts need no span list sorted or apart (a span of no length
    covers no piece, and opens nothing).
    """
    order = {uid: index for index, uid in enumerate(spans)}
    # (when, claim, +1 or -1 to its spans held, +1 or -1 to those billed)
    moves: list[tuple[float, str, int, int]] = []
    for uid, (billed, unsure) in spans.items():
        for spans_of, bills in ((billed, 1), (unsure, 0)):
            for s, e in spans_of:
                if s < e:
                    moves += ((s, uid, 1, bills), (e, uid, -1, -bills))
    moves.sort(key=lambda move: move[0])
    held: dict[str, int] = {}  # claim -> its spans covering the piece
    billing: dict[str, int] = {}  # claim -> its billed spans covering the piece
    cuts = sorted({start, end, *(t for b, u in spans.values() for span in (*b, *u) for t in span)})
    done = 0
    for a, b in itertools.pairwise(cuts):
        while done < len(moves) and moves[done][0] <= a:
            _, uid, held_by, billed_by = moves[done]
            done += 1
            for counts, by in ((held, held_by), (billing, billed_by)):
                if by:
                    counts[uid] = counts.get(uid, 0) + by
                    if not counts[uid]:
                        del counts[uid]
        yield a, b, tuple(sorted(held, key=order.__getitem__)), frozenset(billing)


def _device_seconds(
    views: Sequence[tuple[HeldDevice, Mapping[str, tuple[Holder, ...]]]],
    spans: Mapping[str, tuple[list[_Span], list[_Span]]],
    start: float,
    end: float,
) -> dict[_HolderId, float]:
    """GPU-seconds of each holder of one device over [start, end].

    The interval is cut wherever a holder came or went (`_pieces`), and each piece is
    split among the claims that held the device in it (`HeldDevice.shares`), billing
    those whose holding is known. Each view is the device and its claims' holders as
    one sample saw them; a holder gets the least any view bills it, so a share
    that changed between the samples with no change told is billed at the smaller.
    Each view sums its pieces in time order, one sweep serving all views.
    """
    seconds: list[dict[_HolderId, float]] = [{} for _ in views]
    # The same claims split a piece the same way: churning claims take turns, so a
    # view's split is worked out once for each set of claims that held the device.
    splits: list[dict[tuple[str, ...], list[tuple[Holder, float]]]] = [{} for _ in views]
    for a, b, present, billing in _pieces(spans, start, end):
        if not present:
            continue
        for (device, holders_of), split, billed in zip(views, splits, seconds, strict=True):
            if present not in split:
                holders = tuple(h for uid in present for h in holders_of[uid])
                split[present] = replace(device, holders=holders).shares()
            for holder, share in split[present]:
                if holder.claim_uid in billing:
                    ident = _holder_id(holder)
                    billed[ident] = billed.get(ident, 0.0) + (b - a) * share
    least: dict[_HolderId, float] | None = None
    for billed in seconds:
        least = (
            billed
            if least is None
            else {k: min(v, billed[k]) for k, v in least.items() if k in billed}
        )
    return least or {}


def _by_claim(held: HeldDevice | None) -> dict[str, tuple[Holder, ...]]:
    found: dict[str, list[Holder]] = {}
    for holder in held.holders if held is not None else ():
        found.setdefault(holder.claim_uid, []).append(holder)
    return {uid: tuple(holders) for uid, holders in found.items()}


def _billed(previous: _Seen, sample: Sample) -> dict[str, dict[_HolderId, tuple[Holder, float]]]:
    """Device name -> each holder's labels (the latest known) and GPU-seconds over the
    interval from `previous` to `sample`."""
    told: dict[str, list[tuple[bool, float]]] = {}
    for change in sample.changes:
        told.setdefault(change.claim_uid, []).append((change.held, change.at))
    found: dict[str, dict[_HolderId, tuple[Holder, float]]] = {}
    for name in {*previous.held, *sample.held, *sample.released}:
        before, after = previous.held.get(name), sample.held.get(name)
        released = sample.released.get(name)
        at_start, at_end, gone = _by_claim(before), _by_claim(after), _by_claim(released)
        spans = {
            uid: _spans(uid in at_start, uid in at_end, told.get(uid, ()), previous.at, sample.at)
            for uid in {*at_start, *at_end, *gone}
        }
        # Each view takes a claim's holders, and the device, from its own sample first.
        late = {**at_start, **gone, **at_end}
        early = {**at_end, **gone, **at_start}
        device_late = after or released or before
        device_early = before or released or after
        assert device_late is not None and device_early is not None
        seconds = _device_seconds(
            ((device_early, early), (device_late, late)),
            spans,
            previous.at,
            sample.at,
        )
        labels = {_holder_id(h): h for holders in late.values() for h in holders}
        found[name] = {ident: (labels[ident], s) for ident, s in seconds.items() if s > 0}
    return found


class Accounting:
    """GPU-second counters fed by the sampler; read from the metrics thread."""

    def __init__(
        self,
        *,
        idle_below: float = DEFAULT_IDLE_BELOW,
        retain_s: float = DEFAULT_RETAIN_S,
        zero_window_s: float = DEFAULT_ZERO_WINDOW_S,
    ) -> None:
        if not 0 <= idle_below <= 100:
            msg = f"idle threshold {idle_below} is not a percentage (0 to 100)"
            raise ValueError(msg)
        if retain_s <= 0:
            msg = f"counter retention {retain_s} must be a positive number of seconds"
            raise ValueError(msg)
        if not (math.isfinite(zero_window_s) and zero_window_s >= 0):
            msg = f"zero window {zero_window_s} must be a number of seconds, 0 or more"
            raise ValueError(msg)
        self.idle_below = idle_below
        self.retain_s = retain_s
        self.zero_window_s = zero_window_s
        self._held_at: dict[AccountKey, float] = {}  # the latest sample a key had a holder
        self._lock = threading.Lock()
        self._allocated: dict[AccountKey, float] = {}
        self._idle: dict[AccountKey, float] = {}
        # Keys served at zero: until when, on the scrapes' clock (None: not served yet).
        self._zero_until: dict[AccountKey, float | None] = {}
        self._idle_since: dict[tuple[str, _HolderId], float] = {}
        self._idle_now: tuple[IdleDevice, ...] = ()
        self._last: _Seen | None = None

    def observe(self, sample: Sample) -> None:
        """Bill the time since the previous sample (a `Sampler` `on_sample` callback)."""
        previous, self._last = self._last, _Seen(sample.at, sample.held)
        if previous is not None and sample.at - previous.at > stale_after(sample.interval_s):
            previous = None  # a stall: nothing is known of the time since the previous
        billed = (
            _billed(previous, sample) if previous is not None and sample.at > previous.at else {}
        )
        utilization = {d.uuid: r.values.get("utilization") for d, r in sample.devices}

        def idle(held: HeldDevice) -> bool:
            util = utilization.get(held.uuid or held.gpu_uuid)
            return util is not None and util < self.idle_below

        idle_since: dict[tuple[str, _HolderId], float] = {}
        idle_now: list[IdleDevice] = []
        with self._lock:
            known_since = self._idle_since if previous is not None else {}
            for name, held in sample.held.items():
                if not idle(held):
                    continue
                by_since: dict[float, list[Holder]] = {}
                for ident, holder in holding(held).items():
                    hold = (name, ident)
                    since = idle_since[hold] = known_since.get(hold, sample.at)
                    by_since.setdefault(since, []).append(holder)
                idle_now.extend(
                    IdleDevice(name, held.uuid or held.gpu_uuid, tuple(holders), sample.at - since)
                    for since, holders in sorted(by_since.items())
                )
            for name, seconds_of in billed.items():
                device = sample.held.get(name) or sample.released.get(name)
                if device is None and previous is not None:
                    device = previous.held.get(name)
                was_idle = device is not None and idle(device)
                for holder, seconds in seconds_of.values():
                    key = _account_key(holder)
                    self._held_at[key] = sample.at
                    if key not in self._allocated:
                        self._zero_until[key] = None
                    self._allocated[key] = self._allocated.get(key, 0.0) + seconds
                    if was_idle:
                        self._idle[key] = self._idle.get(key, 0.0) + seconds
            self._idle_since = idle_since
            self._idle_now = tuple(idle_now)
            self._forget_unheld(sample)

    def _forget_unheld(self, sample: Sample) -> None:
        """Drop the counters nothing held a device under for `retain_s` (call with the
        lock held)."""
        for held in sample.held.values():
            for holder in holding(held).values():
                self._held_at[_account_key(holder)] = sample.at
        for key in [k for k, at in self._held_at.items() if sample.at - at > self.retain_s]:
            del self._held_at[key]
            self._allocated.pop(key, None)
            self._idle.pop(key, None)
            self._zero_until.pop(key, None)

    def serve(self, now: float) -> dict[AccountKey, Served]:
        """The counters as a scrape at `now` serves them: a series shows zero, its
        GPU-seconds withheld, to every scrape from its first until `zero_window_s`
        after it, and its total from then on.

        Prometheus's `increase()` and `rate()` take a series' first sample as where it
        starts: a new namespace's counter first served at 30 would never have those 30
        billed. First served at zero, every second is. The zero is served for a window,
        not to the first scrape only, because the agent cannot tell one reader from
        another: a second Prometheus, or `gpudra report` reading the agent first, would
        otherwise take the zero from the one that bills. The withheld GPU-seconds are
        served beside it for a reader that sums the counters as they are (`gpudra
        report` without Prometheus), which would otherwise miss them.

        `now` is on the sampler's clock (that of `Sample.at`, which the metrics read
        anyway for the samples' age): the accounting keeps no clock of its own.
        """
        with self._lock:
            for key, until in list(self._zero_until.items()):
                if until is None:
                    self._zero_until[key] = now + self.zero_window_s
                elif now >= until:
                    del self._zero_until[key]
            return {
                key: Served(0.0, 0.0, seconds, self._idle.get(key, 0.0))
                if key in self._zero_until
                else Served(seconds, self._idle.get(key, 0.0))
                for key, seconds in self._allocated.items()
            }

    def allocated(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._allocated)

    def idle(self) -> Mapping[AccountKey, float]:
        with self._lock:
            return dict(self._idle)

    def idle_devices(self) -> tuple[IdleDevice, ...]:
        """The held devices under the idle threshold at the latest sample."""
        with self._lock:
            return self._idle_now
