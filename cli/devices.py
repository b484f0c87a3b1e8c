"""`gpudra devices`: every published device, who holds it and how it is shared.

A pod that stays Pending with `cannot allocate all claims` has one of three causes
the scheduler's message does not tell apart: no published device matches the class
("no match"), every matching device is taken ("all busy"), or the claim asks for more
devices than any one node has ("too many asked"). This view answers all three from
the API server's own objects (ResourceSlices and the allocations in ResourceClaims):
per node and class, how many devices exist and how many are free, taken in part
(shares or memory slices left) or full; and per device, the claims and pods holding
it with their sharing mode. It reads; it changes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import aiohttp
import anyio
from gpudra.api.deviceclasses import CLASS_TYPES, DEFAULT_DRIVER
from gpudra.api.quantity import QuantityError, parse_quantity
from gpudra.api.sharing import SHARES_CAPACITY, driver_capacities
from gpudra.cli.cluster import add_kubeconfig, connect
from gpudra.cli.terminal import printable
from gpudra.common.kube import ApiError, Kube

__all__ = ["Device", "Holder", "devices", "read", "register", "render"]

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
FREE, PART, FULL, BLOCKED = "free", "part", "full", "blocked"


@dataclass(frozen=True, slots=True)
class Holder:
    """One claim's allocation of a device."""

    claim: str  # namespace/name
    pods: tuple[str, ...]
    sharing: str  # the GpuConfig sharing strategy that applies, or Exclusive
    shares: Fraction | None = None
    memory: Fraction | None = None

    def describe(self) -> str:
        pods = ",".join(self.pods) or "no pod"
        amount = f", {self.shares} share" if self.shares is not None else ""
        if self.memory is not None:
            amount = f", {_gib(self.memory)} memory"
        return f"{self.claim} (pod {pods}, {self.sharing}{amount})"


@dataclass(slots=True)
class Device:
    node: str
    pool: str
    name: str
    type: str
    model: str = ""  # the productName attribute
    shares: Fraction | None = None  # published integer shares
    memory: Fraction | None = None  # memory a sliced GPU hands out
    multiple: bool = False  # allowMultipleAllocations
    consumes: dict[str, dict[str, Fraction]] = field(default_factory=dict)  # set -> counters
    taints: tuple[str, ...] = ()
    holders: list[Holder] = field(default_factory=list)
    blocked_by: str = ""

    @property
    def state(self) -> str:
        if self.holders:
            return PART if self.multiple and self._room() else FULL
        return BLOCKED if self.blocked_by or self.taints else FREE

    def _room(self) -> bool:
        taken = self._taken()
        return taken is not None and taken[0] < taken[1]

    def _taken(self) -> tuple[Fraction, Fraction] | None:
        """(taken, published) of the shares, else of the memory a sliced GPU hands out;
        a holder that names no amount took all of it."""
        if self.shares is not None:
            total = self.shares
            return sum((h.shares or total for h in self.holders), Fraction(0)), total
        if self.memory is not None and self.multiple:
            total = self.memory
            return sum((h.memory or total for h in self.holders), Fraction(0)), total
        return None

    def use(self) -> str:
        """The state in words, with what is left where the device is shared."""
        if self.state == BLOCKED:
            return (
                f"unavailable ({self.blocked_by} uses the same GPU)"
                if self.blocked_by
                else f"tainted ({', '.join(self.taints)})"
            )
        taken = self._taken()
        if taken is None:
            return self.state
        if self.shares is not None:
            return f"{self.state}: {taken[0]}/{taken[1]} shares taken"
        return f"{self.state}: {_gib(taken[0])}/{_gib(taken[1])} memory taken"


def devices(
    slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]], driver: str
) -> list[Device]:
    """The devices of `driver` in `slices`, with the allocations in `claims`."""
    found: dict[tuple[str, str], Device] = {}
    left: dict[tuple[str, str], dict[str, Fraction]] = {}  # (pool, counter set) -> counters
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        pool = (spec.get("pool") or {}).get("name", "")
        for counter_set in spec.get("sharedCounters") or ():
            left[(pool, counter_set.get("name", ""))] = _counters(counter_set)
        for d in spec.get("devices") or ():
            found[(pool, d["name"])] = _device(d, spec.get("nodeName") or "", pool, driver)
    users: dict[tuple[str, str], str] = {}
    for claim in claims:
        for result, holder in _holders(claim, driver):
            device = found.get((result.get("pool", ""), result.get("device", "")))
            if device is None:
                continue
            device.holders.append(holder)
            for name, counters in device.consumes.items():
                users.setdefault((device.pool, name), device.name)
                have = left.setdefault((device.pool, name), {})
                for counter, amount in counters.items():
                    have[counter] = have.get(counter, Fraction(0)) - amount
    # A dynamic MIG placement and its whole GPU draw on one counter set: what the held
    # devices took may leave too little for another.
    for device in found.values():
        for name, counters in device.consumes.items():
            have = left.get((device.pool, name), {})
            short = any(have.get(c, amount) < amount for c, amount in counters.items())
            if not device.holders and short and (device.pool, name) in users:
                device.blocked_by = users[(device.pool, name)]
    return sorted(found.values(), key=lambda d: (d.node, d.type, _natural(d.name)))


async def read(kube: Kube, driver: str, node: str = "") -> list[Device]:
    """The devices of `driver` as the API server has them (only `node`'s if given)."""
    query = {"fieldSelector": f"spec.nodeName={node}"} if node else None
    slices = await kube.request("GET", SLICES, query=query)
    claims = await kube.request("GET", CLAIMS)
    return devices(slices.get("items") or [], claims.get("items") or [], driver)


def _counters(entry: Mapping[str, Any]) -> dict[str, Fraction]:
    return {
        name: amount
        for name, value in (entry.get("counters") or {}).items()
        if (amount := _amount(value)) is not None
    }


def _device(raw: Mapping[str, Any], node: str, pool: str, driver: str) -> Device:
    attributes = raw.get("attributes") or {}
    kind = next(iter((attributes.get("type") or {}).values()), "")
    model = next(iter((attributes.get("productName") or {}).values()), "")
    capacity = driver_capacities(raw.get("capacity") or {}, driver)
    shares = _amount(capacity.get(SHARES_CAPACITY))
    memory = _amount(capacity.get("memory"))
    return Device(
        node=node,
        pool=pool,
        name=str(raw.get("name", "")),
        type=str(kind),
        model=str(model),
        shares=shares,
        memory=memory,
        multiple=raw.get("allowMultipleAllocations") is True,
        consumes={c.get("counterSet", ""): _counters(c) for c in raw.get("consumesCounters") or ()},
        # An informational taint (effect None: an application's XID, an unmonitored GPU)
        # neither keeps a pod off the device nor evicts one: it is free all the same.
        taints=tuple(
            f"{t.get('key')}:{t.get('effect')}"
            for t in raw.get("taints") or ()
            if t.get("effect") != "None"
        ),
    )


def _holders(claim: Mapping[str, Any], driver: str) -> Iterable[tuple[Mapping[str, Any], Holder]]:
    meta = claim.get("metadata") or {}
    status = claim.get("status") or {}
    allocation = (status.get("allocation") or {}).get("devices") or {}
    pods = tuple(
        str(r.get("name")) for r in status.get("reservedFor") or () if r.get("resource") == "pods"
    )
    configs = allocation.get("config") or []
    for result in allocation.get("results") or ():
        if result.get("driver") != driver or result.get("adminAccess"):
            # Admin access (a monitoring or debugging pod) takes nothing: the scheduler
            # still gives the device to others, and it is not what holds it.
            continue
        request = str(result.get("request", ""))
        consumed = driver_capacities(result.get("consumedCapacity") or {}, driver)
        shares = _amount({"value": consumed.get(SHARES_CAPACITY)})
        memory = None if shares is not None else _amount({"value": consumed.get("memory")})
        yield (
            result,
            Holder(
                claim=f"{meta.get('namespace')}/{meta.get('name')}",
                pods=pods,
                sharing=_sharing(configs, request, driver),
                shares=shares,
                memory=memory,
            ),
        )


def _sharing(configs: Sequence[Mapping[str, Any]], request: str, driver: str) -> str:
    """The strategy of the last config for this request (class configs come first)."""
    strategy = "Exclusive"
    base = request.partition("/")[0]
    for entry in configs:
        opaque = entry.get("opaque") or {}
        names = entry.get("requests") or []
        if opaque.get("driver") != driver or (names and not {request, base} & set(names)):
            continue
        sharing = (opaque.get("parameters") or {}).get("sharing") or {}
        strategy = str(sharing.get("strategy") or strategy)
    return strategy


def _amount(capacity: object) -> Fraction | None:
    if not isinstance(capacity, Mapping) or capacity.get("value") is None:
        return None
    try:
        return parse_quantity(str(capacity["value"])).amount
    except QuantityError:
        return None


def _gib(amount: Fraction) -> str:
    return f"{float(amount / 2**30):g}Gi"


def _natural(name: str) -> tuple[str, int]:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


def render(found: Sequence[Device]) -> str:
    """Per node and class the counts, then one line per device with its holders."""
    counts: list[list[str]] = [["NODE", "CLASS", "DEVICES", "FREE", "PART", "FULL", "UNAVAILABLE"]]
    for node in sorted({d.node for d in found}):
        for cls, kind in CLASS_TYPES.items():
            mine = [d for d in found if d.node == node and d.type == kind]
            states = [sum(d.state == s for d in mine) for s in (FREE, PART, FULL, BLOCKED)]
            counts.append([node, cls, str(len(mine)), *map(str, states)])
    rows = [["NODE", "DEVICE", "TYPE", "USE", "HELD BY"]]
    for d in found:
        held = "; ".join(h.describe() for h in d.holders) or "-"
        rows.append([d.node, d.name, d.type, d.use(), held])
    return f"{_table(counts)}\n\n{_table(rows)}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    """The rows aligned; every cell shown as text (claims and slices hold what tenants
    and drivers wrote: a sharing strategy, a product name)."""
    cells = [[printable(cell) for cell in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "devices",
        help="show published devices, free and held, and which pods hold them",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    add_kubeconfig(p)
    p.add_argument("--driver-name", default=DEFAULT_DRIVER, help="the DRA driver name")
    p.add_argument("--node", default="", help="only this node's devices")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    async def main() -> str:
        kube = await connect(args.kubeconfig, command="devices", otherwise="set $KUBECONFIG")
        try:
            return render(await read(kube, args.driver_name, args.node))
        except (ApiError, aiohttp.ClientError, OSError) as e:
            raise SystemExit(f"gpudra devices: reading the cluster failed: {e}") from None
        finally:
            await kube.close()

    print(anyio.run(main))
    return 0
