"""The calibration of predicted prefix-cache hits (narwhal.router.cachecal), at its
edges: what it says and logs, its window, and the counters' guards."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from narwhal.router.cachecal import CacheCalibration


def record(producer: str | None, predicted: int | None, reported: int | None, prompt: int = 1200) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "attempts": [
        {"producer": producer, "predicted_cached_tokens": predicted, "cached_tokens": reported}]}  # fmt: skip


def placed(cal: CacheCalibration, predicted: int, n: int, prompt: int = 1000) -> None:
    """``n`` placements on p0 whose engine reports no hit per request."""
    for _ in range(n):
        cal.on_record(record("p0", predicted, None, prompt))


def test_the_view_says_once_that_it_overpredicts_and_once_that_it_is_calibrated_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    events: list[dict[str, Any]] = []
    cal = CacheCalibration(publish=events.append)
    caplog.set_level(logging.INFO, logger="narwhal.router.prefix")
    for _ in range(20):
        cal.on_record(record("p0", 1024, 35))
    for _ in range(10):  # still low: said once
        cal.on_record(record("p0", 1024, 35))
    ratio = 35 / 1024
    assert [e["event"] for e in events] == ["overpredicting"]
    event = events[0]
    assert event.pop("at") == pytest.approx(time.time(), abs=60)
    assert event == {"type": "prefix", "engine": "p0", "event": "overpredicting",
                     "detail": "3.4% of the predicted hits materialized", "materialized": round(ratio, 4)}  # fmt: skip
    assert cal.status("p0") == {"materialized": round(ratio, 4), "state": "overpredicting"}
    assert [r.getMessage() for r in caplog.records] == [
        "engine p0: only 3% of the prefix-cache hits the router predicted there materialized; "
        "its hits are priced at that share until they do again"]  # fmt: skip
    for _ in range(200):
        cal.on_record(record("p0", 1024, 1024))
    assert [e["event"] for e in events] == ["overpredicting", "calibrated"]
    assert events[1]["engine"] == "p0" and events[1]["materialized"] == 0.9034  # first over OK
    assert caplog.records[-1].getMessage() == "engine p0: the predicted prefix-cache hits materialize again (90%)"
    # A healthy engine says nothing.
    for _ in range(40):
        cal.on_record(record("p1", 1024, 1024))
    assert len(events) == 2 and cal.status("p1") == {"materialized": 1.0, "state": "ok"}


def test_the_thresholds_are_strict_and_nothing_materialized_is_a_ratio_of_zero() -> None:
    cal = CacheCalibration()
    for _ in range(20):  # exactly LOW: not under it
        cal.on_record(record("p0", 1000, 800))
    assert cal.ratio("p0") == pytest.approx(0.8) and "p0" not in cal.overpredicting
    for _ in range(20):
        cal.on_record(record("p1", 1000, 0))
    assert cal.ratio("p1") == 0.0 and cal.factor("p1") == 0.0 and "p1" in cal.overpredicting
    for _ in range(180):  # 180 of 200 in the window at 1,000: exactly OK, not over it
        cal.on_record(record("p1", 1000, 1000))
    assert cal.ratio("p1") == pytest.approx(0.9) and "p1" in cal.overpredicting


def test_the_window_is_the_latest_placements_with_a_predicted_hit() -> None:
    cal = CacheCalibration()
    cal.on_record(record("p0", 1024, 0))
    for _ in range(199):
        cal.on_record(record("p0", 1024, 1024))
    assert cal.ratio("p0") == pytest.approx(199 / 200)  # all 200 in the window
    cal = CacheCalibration()
    cal.on_record(record("p0", 2048, 2048))
    for _ in range(200):
        cal.on_record(record("p0", 1024, 512))
    assert cal.ratio("p0") == pytest.approx(0.5)  # the first one out


def test_every_attempt_of_a_record_counts_and_forget_drops_an_engine() -> None:
    cal = CacheCalibration()
    for _ in range(20):
        cal.on_record({"prompt_tokens": 1000, "attempts": [
            {"producer": None, "predicted_cached_tokens": None, "cached_tokens": None},  # refused there
            {"producer": "p1", "predicted_cached_tokens": 0, "cached_tokens": 0},  # a predicted miss
            {"producer": "p0", "predicted_cached_tokens": 1000, "cached_tokens": 250}]})  # fmt: skip
    assert cal.ratio("p0") == pytest.approx(0.25) and cal.ratio("p1") is None
    cal.forget("p0")
    assert cal.ratio("p0") is None and cal.factor("p0") == 1.0
    assert "p0" not in cal.overpredicting and cal.status("p0") == {"materialized": None, "state": "unknown"}


def test_the_counters_are_read_as_growth_from_the_last_read() -> None:
    cal = CacheCalibration()
    cal.observe_counters("p0", 10000.0, 20000.0)
    cal.observe_counters("p0", 10000.0, 20000.0)  # nothing placed between two reads: nothing to say
    cal.observe_counters("p0", None, 20000.0)  # a counter missing from a read: not read
    assert cal.ratio("p0") is None
    placed(cal, 800, 40)
    cal.observe_counters("p0", 26000.0, 60000.0)  # 16,000 hits of the 32,000 predicted since
    assert cal.ratio("p0") == pytest.approx(0.5)
    placed(cal, 800, 40)
    cal.observe_counters("p0", 26000.0, 100000.0)  # no hit at all
    assert cal.ratio("p0") == 0.0
    placed(cal, 800, 40)
    cal.observe_counters("p0", 66000.0, 140000.0)  # more hits than predicted: all materialized
    assert cal.ratio("p0") == 1.0


def test_the_counters_need_enough_predicted_hits_and_this_router_s_traffic() -> None:
    cal = CacheCalibration()
    cal.observe_counters("p0", 0.0, 0.0)
    placed(cal, 76, 4)  # 304 predicted tokens: under 20 blocks
    cal.observe_counters("p0", 0.0, 4000.0)
    assert cal.ratio("p0") is None
    placed(cal, 80, 4)  # 320: enough
    cal.observe_counters("p0", 0.0, 8000.0)
    assert cal.ratio("p0") == 0.0
    placed(cal, 800, 40)  # 40,000 sent: the engine queried 15% more (within OWN_SHARE)
    cal.observe_counters("p0", 16000.0, 54000.0)
    assert cal.ratio("p0") == pytest.approx(0.5)
    placed(cal, 800, 40)  # the engine queried 20% more: others' traffic
    cal.observe_counters("p0", 48000.0, 102000.0)
    assert cal.ratio("p0") == pytest.approx(0.5)
