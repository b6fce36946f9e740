"""The backoff both tiers share (kvtier_runtime.tiers.backoff): the filesystem tier pauses stores after
``backoff_after`` disk faults in a row, the remote tier marks its store down from the first fault."""
from __future__ import annotations

import pytest
from kvtier_runtime.tiers.backoff import Backoff


def test_pauses_start_at_the_nth_fault_in_a_row_double_up_to_the_cap_and_a_success_resets_the_count() -> None:
    now = [100.0]
    backoff = Backoff(5.0, 30.0, after=3, clock=lambda: now[0])
    assert [backoff.failure(), backoff.failure()] == [None, None] and not backoff.active
    assert [backoff.failure() for _ in range(4)] == [5.0, 10.0, 20.0, 30.0]
    assert backoff.active and backoff.until == 130.0
    now[0] = 130.0
    assert not backoff.active
    backoff.success()
    assert backoff.failures == 0 and backoff.failure() is None  # counting starts again


def test_the_first_fault_pauses_when_after_is_one_and_now_can_be_given() -> None:
    backoff = Backoff(1.0, 30.0, clock=lambda: 0.0)
    assert backoff.failure(now=50.0) == 1.0 and backoff.until == 51.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"base_s": 0.0, "max_s": 1.0}, "base_s=0.0 and max_s=1.0 must satisfy 0 < base_s <= max_s"),
    ({"base_s": 2.0, "max_s": 1.0}, "base_s=2.0 and max_s=1.0 must satisfy 0 < base_s <= max_s"),
    ({"base_s": 1.0, "max_s": 1.0, "after": 0}, "after=0 must be at least 1"),
])
def test_bad_settings_are_refused_naming_them(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Backoff(**kwargs)
