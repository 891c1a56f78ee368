"""How a check's results read: one line per result, and the JSON a report and a record keep."""

from __future__ import annotations

import math

import pytest

from narwhal.check.results import CheckReport, CheckResult, ProfilePair, format_value, jsonable
from narwhal.engines.client import EngineIdentity

IDENT = EngineIdentity(
    url="http://e0.test:8101",
    model="m",
    version="0.32.0",
    max_model_len=4096,
    process_start_time=1_700_000_000.5,
)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (True, "true"),
        (False, "false"),
        (None, "null"),
        (0.0812345, "0.08123"),
        (12.0, "12"),
        (99_999.0, "1e+05"),
        (100_000.0, "100000.00"),
        (1_700_000_000.5, "1700000000.50"),
        (-100_000.0, "-100000.00"),
        (-99_999.0, "-1e+05"),
        (7, "7"),
        ("0.32.0", "0.32.0"),
        ({"b": 1, "a": (2, 3)}, '{"a": [2, 3], "b": 1}'),
        ([math.inf], '["inf"]'),
    ],
)
def test_format_value(value: object, shown: str) -> None:
    assert format_value(value) == shown


def test_jsonable_turns_tuples_attrs_keys_and_non_finite_floats_into_json() -> None:
    pair = ProfilePair(profiles="p.json", samples="s.json")
    got = jsonable({1: (pair, math.nan, -math.inf, 2.5), "x": [None, True]})
    assert got == {
        "1": [
            {"profiles": "p.json", "samples": "s.json", "profiles_sha256": None, "samples_sha256": None},
            "nan",
            "-inf",
            2.5,
        ],
        "x": [None, True],
    }


def test_a_result_reads_as_one_line() -> None:
    fail = CheckResult(name="decode.fit_mape", engine="e1", ok=False, measured=0.081, limit=0.05,
                       message="decode fit MAPE 8.10% exceeds the limit")  # fmt: skip
    assert fail.line() == (
        "FAIL decode.fit_mape e1: decode fit MAPE 8.10% exceeds the limit "
        "(measured 0.081; limit 0.05)"
    )
    ok = CheckResult(name="pool", engine=None, ok=True, message="m: fine")
    assert ok.line() == "ok   pool fleet: m: fine (measured null; limit null)"
    assert CheckResult(name="x", engine="", ok=True).line() == "ok   x fleet:  (measured null; limit null)"


def test_a_result_as_json() -> None:
    r = CheckResult(name="pool", engine=None, ok=True, measured={"producers": 1}, limit=(1, 2),
                    message="m", detail={"t": math.inf})  # fmt: skip
    assert r.to_json() == {
        "name": "pool",
        "engine": None,
        "ok": True,
        "measured": {"producers": 1},
        "limit": [1, 2],
        "message": "m",
        "detail": {"t": "inf"},
    }
    assert CheckResult(name="n", engine="e", ok=False).to_json()["detail"] == {}
    assert CheckResult(name="n", engine="e", ok=False).message == ""


def test_a_report_passes_only_with_results_all_ok() -> None:
    good = CheckResult(name="a", engine="e0", ok=True)
    bad = CheckResult(name="b", engine="e1", ok=False)
    bad2 = CheckResult(name="a", engine="e2", ok=False)
    assert not CheckReport(results=()).ok
    assert CheckReport(results=(good,)).ok
    assert not CheckReport(results=(good, bad)).ok
    report = CheckReport(results=(good, bad, bad2))
    assert report.failures == [bad, bad2]
    assert report.named("a") == [good, bad2]
    assert report.named("c") == []
    assert report.lines() == [good.line(), bad.line(), bad2.line()]


def test_a_report_as_json() -> None:
    pair = ProfilePair(profiles="p.json", samples="s.json", profiles_sha256="ab", samples_sha256="cd")
    good = CheckResult(name="a", engine="e0", ok=True)
    bad = CheckResult(name="b", engine="e1", ok=False)
    report = CheckReport(
        results=(good, bad),
        source="fleet.json",
        identities={"e0": IDENT, "e1": None},
        identities_after={"e0": IDENT},
        profiles=pair,
        refit_original=pair,
        started_at="2026-01-01T00:00:00Z",
        duration_s=1.5,
    )
    ident = {
        "url": "http://e0.test:8101",
        "model": "m",
        "version": "0.32.0",
        "max_model_len": 4096,
        "process_start_time": 1_700_000_000.5,
    }
    got = report.to_json()
    assert {k: v for k, v in got["engines"]["e0"].items() if k in ident} == ident
    pair_json = {"profiles": "p.json", "samples": "s.json", "profiles_sha256": "ab",
                 "samples_sha256": "cd"}  # fmt: skip
    assert got == {
        "kind": "narwhal.check",
        "ok": False,
        "fleet": "fleet.json",
        "started_at": "2026-01-01T00:00:00Z",
        "duration_s": 1.5,
        "engines": {"e0": got["engines"]["e0"], "e1": None},
        "engines_after": {"e0": got["engines"]["e0"]},
        "profiles": pair_json,
        "refit_original": pair_json,
        "failures": 1,
        "results": [good.to_json(), bad.to_json()],
    }
    bare = CheckReport(results=(good,)).to_json()
    assert bare["ok"] is True and bare["fleet"] is None and bare["failures"] == 0
    assert bare["profiles"] is None and bare["refit_original"] is None
    assert bare["engines"] == {} and bare["engines_after"] == {}
    assert bare["started_at"] == "" and bare["duration_s"] == 0.0
