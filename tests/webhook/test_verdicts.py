"""ClaimJudge: a spec allowed before is allowed again without being judged, and only
under the very rules and DeviceClass configs it was allowed under; everything else is
judged afresh, and its answer is what judging it says."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from gpudra.api.configcache import ConfigCache
from gpudra.api.deviceclasses import device_classes
from gpudra.webhook import verdicts as verdicts_module
from gpudra.webhook.convert import DEFAULT_POLICY
from gpudra.webhook.device_classes import DeviceClassCache
from gpudra.webhook.tenant_rules import TenantRules
from gpudra.webhook.validate import ClaimVerdict, ClassConfigs, validate_claim_object
from gpudra.webhook.verdicts import ClaimJudge
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.webhook.test_validate import (
    CLASSES,
    SHARED,
    claim,
    class_view,
    gpu_config,
    opaque,
    req,
    rules,
    shared_class,
    template,
)


class Counting:
    """validate_claim_object, counting the objects it judged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.judged: list[object] = []
        real = verdicts_module.validate_claim_object

        def counting(obj: Any, **kw: Any) -> ClaimVerdict:
            self.judged.append(obj)
            return real(obj, **kw)

        monkeypatch.setattr(verdicts_module, "validate_claim_object", counting)


def judge_of(device_classes: dict[str, ClassConfigs] | None = None, **kw: Any) -> ClaimJudge:
    return ClaimJudge(DEFAULT_POLICY, CLASSES, device_classes, ConfigCache().parse, **kw)


def named(obj: dict[str, Any], name: str) -> dict[str, Any]:
    copied = copy.deepcopy(obj)
    copied["metadata"]["name"] = name
    return copied


TIME_SLICED = claim(req("gpu"), config=[opaque(gpu_config(strategy="TimeSlicing"))])
MPS = claim(req("gpu"), config=[opaque(gpu_config(strategy="MPS"))])


def test_an_allowed_spec_is_judged_once_under_the_same_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counting = Counting(monkeypatch)
    judge, tenant = judge_of(), rules()
    for index in range(3):
        verdict = judge.judge(named(MPS, f"c{index}"), template=False, rules=tenant)
        assert (verdict.allowed, verdict.name) == (True, f"c{index}")
    assert len(counting.judged) == 1 and len(judge) == 1
    # A template carries its spec one level down: the same spec, allowed the same.
    assert judge.judge(template(MPS), template=True, rules=tenant).allowed
    assert len(counting.judged) == 1 and len(judge) == 1


def test_a_spec_allowed_elsewhere_is_judged_under_this_namespaces_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An escape attempt on the memo: a spec allowed in a namespace without rules, or
    under another tenant's, is judged again under this namespace's, and refused."""
    counting = Counting(monkeypatch)
    judge = judge_of()
    strict = rules(allowedSharing=["Exclusive", "TimeSlicing"])
    assert judge.judge(named(MPS, "free"), template=False, rules=None).allowed
    assert judge.judge(named(MPS, "lax"), template=False, rules=rules()).allowed
    for _ in range(2):
        (line,) = judge.judge(named(MPS, "bound"), template=False, rules=strict).forbidden
        assert "does not allow sharing mode MPS" in line
    assert len(counting.judged) == 4  # a denial is never kept


def test_new_rules_for_the_same_tenant_judge_it_again() -> None:
    """A tenant's rules changed since (a new `TenantRules`): the spec is judged again."""
    judge = judge_of()
    assert judge.judge(MPS, template=False, rules=rules()).allowed
    changed = rules(allowedSharing=["Exclusive"])
    assert not judge.judge(MPS, template=False, rules=changed).allowed


def test_a_device_class_changed_since_judges_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared class gains an MPS config after a spec on it was allowed under rules
    without MPS: the same spec is refused; written back as it was, allowed again."""
    counting = Counting(monkeypatch)
    view = class_view()
    judge = judge_of(view.configs)
    tenant = rules(allowedSharing=["Exclusive", "TimeSlicing"])
    on_shared = claim(req("gpu", SHARED))
    assert judge.judge(on_shared, template=False, rules=tenant).allowed
    view.event("MODIFIED", shared_class(strategy="MPS"))
    (line,) = judge.judge(on_shared, template=False, rules=tenant).forbidden
    assert "does not allow sharing mode MPS" in line
    view.event("MODIFIED", shared_as_first_listed())
    assert judge.judge(on_shared, template=False, rules=tenant).allowed
    # From the memo: the class's configs are again those it was allowed under.
    assert len(counting.judged) == 2


def shared_as_first_listed() -> dict[str, Any]:
    (dc,) = (c for c in device_classes() if c["metadata"]["name"] == SHARED)
    return dc


def test_the_device_classes_are_read_live_from_an_empty_view() -> None:
    """The webhook builds its judge before the DeviceClasses are listed: the classes
    listed later are the ones it judges by."""
    view = DeviceClassCache(DEFAULT_POLICY.driver)
    judge = judge_of(view.configs)
    tenant = rules(allowedSharing=["Exclusive"])
    view.replace([*device_classes(), shared_class(strategy="TimeSlicing")])
    (line,) = judge.judge(claim(req("gpu", SHARED)), template=False, rules=tenant).forbidden
    assert "does not allow sharing mode TimeSlicing" in line


def test_a_namespace_wide_denial_is_never_skipped() -> None:
    judge = judge_of()
    assert judge.judge(TIME_SLICED, template=False, rules=None).allowed
    verdict = judge.judge(TIME_SLICED, template=False, rules=None, denial="rules not loaded")
    assert verdict.forbidden == ["rules not loaded"]


def test_a_malformed_object_around_a_known_spec_is_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(monkeypatch)
    judge = judge_of()
    assert judge.judge(TIME_SLICED, template=False, rules=None).allowed
    for metadata in ({"name": 5}, ["c"], "c"):
        bad = copy.deepcopy(TIME_SLICED)
        bad["metadata"] = metadata
        verdict = judge.judge(bad, template=False, rules=None)
        assert (
            verdict.invalid
            and verdict.invalid
            == validate_claim_object(
                bad, template=False, policy=DEFAULT_POLICY, classes=CLASSES, rules=None
            ).invalid
        )
    assert len(counting.judged) == 4
    no_metadata = {"spec": copy.deepcopy(TIME_SLICED["spec"])}
    assert judge.judge(no_metadata, template=False, rules=None) == ClaimVerdict()


def test_the_memo_is_bounded_in_specs_and_in_their_size() -> None:
    """A tenant sending only new specs fills a bounded memo; a spec too long to keep is
    judged and not kept."""
    judge = judge_of(size=2, max_key_bytes=600)
    for count in (1, 2, 3):
        assert judge.judge(claim(req("gpu", count=count)), template=False, rules=None).allowed
    assert len(judge) == 2
    long = claim(*(req(f"gpu-{i}") for i in range(12)))
    assert judge.judge(long, template=False, rules=None).allowed
    assert len(judge) == 2


_SHARINGS = st.sampled_from(
    [None, {"strategy": "TimeSlicing"}, {"strategy": "MPS"}, {"strategy": "Sliced"}]
)
_CLASSES = st.sampled_from(["gpu.nvidia.com", SHARED, "mig.nvidia.com", "other.example.com"])


@st.composite
def _claims(draw: st.DrawFn) -> dict[str, Any]:
    names = [f"r{i}" for i in range(draw(st.integers(1, 3)))]
    requests = [req(n, draw(_CLASSES), draw(st.integers(1, 3))) for n in names]
    configs = []
    for name in names:
        sharing = draw(_SHARINGS)
        if sharing is not None:
            configs.append(opaque(gpu_config(**sharing), requests=[name]))
    return claim(*requests, config=configs)


_RULES = [
    None,
    rules(),
    rules(allowedSharing=["Exclusive"]),
    rules(maxDevicesPerPod=2),
    rules(allowedDeviceClasses=["gpu.nvidia.com"]),
]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(_claims(), st.integers(0, len(_RULES) - 1), st.booleans()), max_size=8))
def test_every_answer_is_what_judging_the_claim_says(
    sequence: list[tuple[dict[str, Any], int, bool]],
) -> None:
    """Whatever came before, each claim gets the verdict judging it afresh gives."""
    judge = judge_of(class_view(shared_class(strategy="TimeSlicing")).configs)
    fresh_classes = class_view(shared_class(strategy="TimeSlicing")).configs
    for obj, which, as_template in sequence * 2:
        tenant: TenantRules | None = _RULES[which]
        subject = template(obj) if as_template else obj
        got = judge.judge(subject, template=as_template, rules=tenant)
        want = validate_claim_object(
            subject,
            template=as_template,
            policy=DEFAULT_POLICY,
            classes=CLASSES,
            rules=tenant,
            device_classes=fresh_classes,
        )
        assert got == want
