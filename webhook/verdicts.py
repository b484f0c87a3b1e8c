"""Claim validation that remembers the specs it allowed, and what it allowed them under.

Every claim a ResourceClaimTemplate makes carries the template's spec, and a cluster's
claims come from a few templates: the webhook judges the same `spec.devices` over and
over. Judging one is most of an admission's own work (its requests, their configs, the
sharing each resolves to, the tenant rules), and at the rate a real cluster creates
claims each admission meets that code gone cold: measured beside the Go reference
webhook on the same claims, the rest of an admission (TLS, HTTP, the review's decoding)
left no room for it.

What the judgement reads beside the spec is known and kept with it: the tenant rules of
the claim's namespace (a `TenantRules`, built anew on every tenant change, compared by
identity) and the configs of the driver's DeviceClasses (a `ClassConfigs` each, built
anew on every DeviceClass event, compared by value). A spec allowed before is allowed
again without being judged only when it is met under those same rules and configs, in
a namespace with no namespace-wide denial; anything else (other rules, a class changed,
added or deleted since) judges it afresh, and so does a claim whose other fields the
judgement reads are not plainly well formed. A template's spec is the same spec one
level down, and is kept as one. Only allowed specs are kept: a denial is always worked
out anew, so what a claim is told never depends on what came before, and a kept spec
gets exactly the answer judging it would (`tests/webhook/test_verdicts.py` checks both
ways).

A hostile tenant can send only new specs: the memo is bounded (`Memo`), and such a
tenant costs each admission the sorted encoding of its spec on top of the judgement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpudra.api.config import DeviceConfig, parse_opaque_config
from gpudra.api.memo import Memo
from gpudra.webhook.convert import ConversionPolicy
from gpudra.webhook.tenant_rules import TenantRules
from gpudra.webhook.validate import ClaimVerdict, ClassConfigs, validate_claim_object

__all__ = ["ClaimJudge"]

_SIZE: Final = 256
_MAX_KEY_BYTES: Final = 16 * 1024
"""A spec's JSON longer than this is judged every time and not kept: 256 specs of it
hold 4 MiB. The longest spec a template of 32 requests with a config each makes is
about 10 KiB; the usual ones are a few hundred bytes."""


@dataclass(frozen=True, slots=True)
class _Allowed:
    """What an allowed spec was judged under."""

    rules: TenantRules | None
    classes: tuple[ClassConfigs | None, ...]
    """The configs of each of the driver's DeviceClasses (`ClaimJudge.classes` order)."""


class ClaimJudge:
    """`validate_claim_object` for one policy and set of driver classes, remembering the
    specs it allowed."""

    def __init__(
        self,
        policy: ConversionPolicy,
        classes: frozenset[str],
        device_classes: Mapping[str, ClassConfigs] | None,
        parse_config: Callable[[object], DeviceConfig] = parse_opaque_config,
        *,
        size: int = _SIZE,
        max_key_bytes: int = _MAX_KEY_BYTES,
    ) -> None:
        """`device_classes` is the live view of the DeviceClasses' configs (read at each
        judgement, as `validate_claim_object` reads it)."""
        self._policy = policy
        self._classes = classes
        self._class_names = tuple(sorted(classes))
        # Not `or {}`: the live view is empty until the DeviceClasses are listed.
        self._device_classes: Mapping[str, ClassConfigs] = (
            device_classes if device_classes is not None else {}
        )
        self._parse_config = parse_config
        self._allowed: Memo[_Allowed] = Memo(size, max_key_bytes)

    def __len__(self) -> int:
        return len(self._allowed)

    def judge(
        self,
        obj: Mapping[str, Any],
        *,
        template: bool,
        rules: TenantRules | None,
        denial: str = "",
    ) -> ClaimVerdict:
        """What `validate_claim_object` says of `obj` under `rules` and `denial` (see
        its docstring), from the memo where `obj`'s spec was allowed under the same."""
        devices, name = _devices_and_name(obj, template)
        key = self._allowed.key(devices) if devices is not None and not denial else None
        if key is not None:
            known = self._allowed.get(key)
            if known is not None and known.rules is rules and self._same_classes(known):
                return ClaimVerdict(name=name)
        verdict = validate_claim_object(
            obj,
            template=template,
            policy=self._policy,
            classes=self._classes,
            rules=rules,
            denial=denial,
            device_classes=self._device_classes,
            parse_config=self._parse_config,
        )
        if key is not None and verdict.allowed:
            self._allowed.put(key, _Allowed(rules, self._snapshot()))
        return verdict

    def _snapshot(self) -> tuple[ClassConfigs | None, ...]:
        return tuple(map(self._device_classes.get, self._class_names))

    def _same_classes(self, known: _Allowed) -> bool:
        """The driver's DeviceClasses have the configs `known` was judged under: the very
        objects, or equal ones (a class written again unchanged)."""
        return self._snapshot() == known.classes


def _devices_and_name(obj: Mapping[str, Any], template: bool) -> tuple[object | None, str]:
    """`obj`'s ``spec.devices`` (``spec.spec.devices`` of a template) and its name, where
    every field on the way is plainly well formed, as the judgement's schema accepts
    them (objects, a string name); (None, "") otherwise, and the object is judged."""
    metadata = obj.get("metadata")
    if metadata is None:
        name: object = ""
    elif type(metadata) is dict:
        name = metadata.get("name", "")
    else:
        return None, ""
    spec = obj.get("spec")
    if template:
        spec = spec.get("spec") if type(spec) is dict else None
    devices = spec.get("devices") if type(spec) is dict else None
    if type(devices) is not dict or type(name) is not str:
        return None, ""
    return devices, name
