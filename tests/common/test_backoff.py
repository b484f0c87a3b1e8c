"""Retry delays: doubling, capped, and a clear error for a policy that cannot work."""

import itertools

import pytest
from gpudra.common.backoff import Backoff


def test_delays_double_up_to_the_cap_and_stay_there() -> None:
    delays = Backoff(first_s=0.2, max_s=1.0).delays()
    assert list(itertools.islice(delays, 6)) == [0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_each_series_starts_over() -> None:
    policy = Backoff(first_s=0.5, max_s=2.0)
    first = policy.delays()
    assert [next(first), next(first)] == [0.5, 1.0]
    assert next(policy.delays()) == 0.5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"first_s": 0.0}, "first_s"), ({"first_s": 2.0, "max_s": 1.0}, "max_s")],
)
def test_a_policy_that_cannot_work_names_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"Backoff.{field}"):
        Backoff(**kwargs)
