"""The derivation the profiler and the preflight share (narwhal.profile.derive), called directly.

What a sidecar entry must hold, and the JSON path named when it does not; the profile
its raw samples give (coefficients, domain, capacity, identity); and what counts as a
difference between a claimed profile and the derived one.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import attrs
import pytest

from narwhal.errors import ConfigError
from narwhal.profile.derive import (
    decode_cells,
    derive_profile,
    derive_ttft,
    kv_capacity,
    prefill_repeats,
    profile_differences,
)
from narwhal.profile.fit import (
    MIN_DECODE_CELLS,
    MIN_PREFILL_LENGTHS,
    DecodeFit,
    DecodePoint,
    fit_decode,
)
from narwhal.profile.store import EngineProfile, KVCapacity
from tests.checkkit import DECODE, PREFILL, identity_of, raw_entry, sim_profile

WHERE = "$.engines.e0"


def entry(**changes: Any) -> dict[str, Any]:
    out = raw_entry(sim_profile("e0", identity_of("e0", 8101)))
    out.update(copy.deepcopy(changes))
    return out


def refused(call: Any, *args: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args)
    return info.value


# ------------------------------------------------------------------- prefill repeats


def test_prefill_repeats_are_read_as_length_and_seconds() -> None:
    got = prefill_repeats(
        {"prefill": {"repeats": [{"length": 16, "ttft_s": 1}, {"length": 32, "ttft_s": 0.5}]}},
        WHERE,
    )
    assert got == [(16, 1.0), (32, 0.5)] and all(type(s) is float for _, s in got)


@pytest.mark.parametrize(
    ("prefill", "path", "reason"),
    [
        (None, "$.engines.e0.prefill.repeats", "the samples hold no prefill repeats"),
        ({"repeats": []}, "$.engines.e0.prefill.repeats", "the samples hold no prefill repeats"),
        ({"repeats": {"length": 16}}, "$.engines.e0.prefill.repeats", "the samples hold no prefill repeats"),
        ({"repeats": [{"length": 16, "ttft_s": 0.1}, [16, 0.1]]}, "$.engines.e0.prefill.repeats[1]", None),
        ({"repeats": [{"length": 16.0, "ttft_s": 0.1}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": True, "ttft_s": 0.1}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": True}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": "0.1"}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": math.nan}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": math.inf}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": 0}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"length": 16, "ttft_s": -0.1}]}, "$.engines.e0.prefill.repeats[0]", None),
        ({"repeats": [{"ttft_s": 0.1}]}, "$.engines.e0.prefill.repeats[0]", None),
    ],
)  # fmt: skip
def test_malformed_prefill_repeats_name_their_path(
    prefill: Any, path: str, reason: str | None
) -> None:
    error = refused(prefill_repeats, {} if prefill is None else {"prefill": prefill}, WHERE)
    assert error.path == path
    assert error.reason == (reason or "expected {length: int, ttft_s: number > 0}")


# ---------------------------------------------------------------------- decode cells


def interval(
    stream: float = 0, seconds: Any = 0.01, active: float = 4, kv: float = 1000
) -> dict[str, Any]:
    return {"stream": stream, "seconds": seconds, "active": active, "kv_tokens": kv, "index": 0}


def test_decode_cells_keep_only_kept_cells_as_numbers() -> None:
    cells = [
        {"kept": True, "intervals": [interval(0, 0.01, 4, 1000), interval(1, "0.02", 4, 1000)]},
        {"kept": False, "intervals": [interval()]},
        {"kept": "yes", "intervals": [interval()]},
        {"intervals": [interval()]},
        "not a cell",
        {"kept": True, "intervals": [interval(0, 0.03, 8, 2000)]},
    ]
    got = decode_cells({"decode": {"cells": cells}}, WHERE)
    assert got == [
        [{"stream": 0.0, "seconds": 0.01, "active": 4.0, "kv_tokens": 1000.0},
         {"stream": 1.0, "seconds": 0.02, "active": 4.0, "kv_tokens": 1000.0}],
        [{"stream": 0.0, "seconds": 0.03, "active": 8.0, "kv_tokens": 2000.0}],
    ]  # fmt: skip
    assert all(type(v) is float for cell in got for row in cell for v in row.values())
    assert decode_cells({"decode": {"cells": []}}, WHERE) == []


@pytest.mark.parametrize(
    ("decode", "path", "reason"),
    [
        (None, "$.engines.e0.decode.cells", "the samples hold no decode cells"),
        ({"cells": {"kept": True}}, "$.engines.e0.decode.cells", "the samples hold no decode cells"),
        ({"cells": [{"kept": False}, {"kept": True}]}, "$.engines.e0.decode.cells[1].intervals",
         "a kept cell holds no intervals"),
        ({"cells": [{"kept": True, "intervals": []}]}, "$.engines.e0.decode.cells[0].intervals",
         "a kept cell holds no intervals"),
        ({"cells": [{"kept": True, "intervals": {"stream": 0}}]}, "$.engines.e0.decode.cells[0].intervals",
         "a kept cell holds no intervals"),
        ({"cells": [{"kept": True, "intervals": [interval(), {"stream": 0, "seconds": 0.1}]}]},
         "$.engines.e0.decode.cells[0].intervals[1]", "expected {stream, seconds, active, kv_tokens} numbers"),
        ({"cells": [{"kept": True, "intervals": [interval(seconds=None)]}]},
         "$.engines.e0.decode.cells[0].intervals[0]", "expected {stream, seconds, active, kv_tokens} numbers"),
        ({"cells": [{"kept": True, "intervals": [interval(seconds="fast")]}]},
         "$.engines.e0.decode.cells[0].intervals[0]", "expected {stream, seconds, active, kv_tokens} numbers"),
        ({"cells": [{"kept": True, "intervals": [interval(), interval(seconds=0)]}]},
         "$.engines.e0.decode.cells[0].intervals[1]", "expected finite numbers and seconds > 0"),
        ({"cells": [{"kept": True, "intervals": [interval(seconds=-1)]}]},
         "$.engines.e0.decode.cells[0].intervals[0]", "expected finite numbers and seconds > 0"),
        ({"cells": [{"kept": True, "intervals": [interval(kv=math.inf)]}]},
         "$.engines.e0.decode.cells[0].intervals[0]", "expected finite numbers and seconds > 0"),
        ({"cells": [{"kept": True, "intervals": [interval(active=math.nan)]}]},
         "$.engines.e0.decode.cells[0].intervals[0]", "expected finite numbers and seconds > 0"),
    ],
)  # fmt: skip
def test_malformed_decode_cells_name_their_path(decode: Any, path: str, reason: str) -> None:
    error = refused(decode_cells, {} if decode is None else {"decode": decode}, WHERE)
    assert (error.path, error.reason) == (path, reason)


# ----------------------------------------------------------------------- KV capacity


def decode_fit(c0: float = 0.005, c1: float = 0.0008, c2: float = 2e-7) -> DecodeFit:
    points = [DecodePoint(active=a, kv_tokens=k, tpot_s=c0 + c1 * a + c2 * k)
              for a in (1.0, 8.0) for k in (100.0, 50_000.0)]  # fmt: skip
    return fit_decode(points)


def test_kv_capacity_is_physical_else_the_tpot_target_else_only_what_was_measured() -> None:
    fit = decode_fit()
    assert kv_capacity(262_144, fit, measured_kv_max=50_000, tpot_target_s=0.05) == KVCapacity(
        source="physical", tokens=262_144, basis="vllm:cache_config_info kv_cache_size_tokens"
    )
    # 0.05 = 0.005 + 0.0008 * 8 + 2e-7 * kv  ->  kv = 193_000 at the most active requests (8).
    tpot = kv_capacity(None, fit, measured_kv_max=50_000, tpot_target_s=0.05)
    assert (tpot.source, tpot.tpot_s, tpot.active) == ("tpot", 0.05, 8.0)
    assert tpot.tokens == pytest.approx(193_000, abs=2) and type(tpot.tokens) is int
    assert tpot.basis == ("resident KV at which the decode fit reaches the TPOT target with the "
                          "most active requests measured")  # fmt: skip
    measured = KVCapacity(
        source="measured", tokens=50_000,
        basis="no capacity known: the engine reports no kv_cache_size_tokens and no TPOT target "
              "bounds it; this is the largest resident KV measured, the edge of the decode "
              "domain, priced beyond conservatively",
    )  # fmt: skip
    assert kv_capacity(None, fit, measured_kv_max=50_000, tpot_target_s=None) == measured
    # A target the fit misses without any KV bounds nothing.
    assert kv_capacity(None, fit, measured_kv_max=50_000, tpot_target_s=0.01) == measured


# ------------------------------------------------------------------- derive_profile


def test_the_profile_the_samples_give_is_the_simulators() -> None:
    p = derive_profile(entry(), "e0")
    assert p.name == "e0" and p.identity == identity_of("e0", 8101)
    assert p.roles == ("prefill", "decode")
    t = p.ttft
    assert (t.a, t.b, t.c) == pytest.approx((PREFILL["a"], PREFILL["b"], PREFILL["c"]), abs=1e-12)
    assert (t.min_length, t.max_length) == (16, 4096)
    assert t.mean_error == pytest.approx(0, abs=1e-9) and t.worst_error == pytest.approx(
        0, abs=1e-9
    )
    assert t.loo_mean_error == pytest.approx(0, abs=1e-9) and t.loo_worst_error == pytest.approx(
        0, abs=1e-9
    )
    assert t.uncertainty is not None and t.uncertainty.min_samples == 3
    assert set(t.uncertainty.coefficients) == {"a", "b", "c"}
    assert t.uncertainty.coefficients["b"].value == pytest.approx(PREFILL["b"])
    assert p.decode is not None
    d = p.decode
    assert (d.c0, d.c1, d.c2) == pytest.approx((DECODE["c0"], DECODE["c1"], DECODE["c2"]))
    assert d.cells == 4
    assert (d.domain.active.min, d.domain.active.max) == (1.0, 64.0)
    assert (d.domain.kv_tokens.min, d.domain.kv_tokens.max) == (100.0, 200_000.0)
    assert d.uncertainty is not None and d.uncertainty.min_samples == 8
    assert set(d.uncertainty.coefficients) == {"c0", "c1", "c2"}
    assert d.uncertainty.coefficients["c1"].value == pytest.approx(DECODE["c1"])
    assert p.kv_capacity == KVCapacity(source="physical", tokens=262_144,
                                       basis="vllm:cache_config_info kv_cache_size_tokens")  # fmt: skip


def test_capacity_inputs_are_read_as_numbers_only() -> None:
    # No physical size: the TPOT target recorded in the sidecar bounds the KV.
    raw = entry(engine={"kv_cache_size_tokens": None}, kv_capacity_inputs={"tpot_target_s": 0.2})
    cap = derive_profile(raw, "e0").kv_capacity
    assert cap is not None and (cap.source, cap.tpot_s, cap.active) == ("tpot", 0.2, 64.0)
    # (0.2 - 0.005 - 0.0008 * 64) / 2e-7 = 719_000
    assert cap.tokens == pytest.approx(719_000, abs=5)
    for physical, inputs in [(True, None), (262_144.0, None), ("262144", None),
                             (None, {"tpot_target_s": True}), (None, {"tpot_target_s": "0.2"}),
                             (None, [0.2]), (None, None)]:  # fmt: skip
        raw = entry(engine={"kv_cache_size_tokens": physical}, kv_capacity_inputs=inputs)
        cap = derive_profile(raw, "e0").kv_capacity
        assert cap is not None and (cap.source, cap.tokens) == ("measured", 200_000), (
            physical,
            inputs,
        )
    cap = derive_profile(
        entry(engine=None, kv_capacity_inputs={"tpot_target_s": 1}), "e0"
    ).kv_capacity
    assert cap is not None and (cap.source, cap.tpot_s) == ("tpot", 1.0)


def test_a_prefill_only_entry_gives_a_profile_without_decode() -> None:
    raw = entry(roles=["prefill"])
    raw.pop("decode")
    p = derive_profile(raw, "e0")
    assert (p.roles, p.decode, p.kv_capacity) == (("prefill",), None, None)
    both = derive_profile(entry(), "e0")
    assert (p.name, p.identity, p.ttft) == (both.name, both.identity, both.ttft)
    # The roles are the sidecar's, in its order.
    assert derive_profile(entry(roles=["decode", "prefill"]), "e0").roles == ("decode", "prefill")


def test_the_stored_intervals_are_the_bootstraps() -> None:
    from narwhal.profile.derive import uncertainty

    derived = derive_ttft([(n, (0.02 + 5e-5 * n) * f) for n in (16, 512, 1024, 2048)
                           for f in (0.95, 1.0, 1.05)])  # fmt: skip
    i, u = derived.intervals, uncertainty(derived.intervals)
    assert (u.level, u.resamples, u.upper_factor) == (i.level, i.resamples, i.upper_factor)
    assert (u.worst_half_width, u.mean_half_width, u.min_samples) == (
        i.worst_half_width, i.mean_half_width, i.min_samples)  # fmt: skip
    assert {k: (b.value, b.low, b.high) for k, b in u.coefficients.items()} == {
        k: (b.value, b.low, b.high) for k, b in i.coefficients.items()}  # fmt: skip
    assert any(b.low < b.value < b.high for b in u.coefficients.values())


@pytest.mark.parametrize(
    ("changes", "path", "reason"),
    [
        ({"identity": None}, "$.engines.e0.identity", "the samples are not bound to an engine generation"),
        ({"identity_after": None}, "$.engines.e0.identity_after",
         "the engine's generation after the sweep is missing or differs from the one before it"),
        ({"identity_after": attrs.asdict(attrs.evolve(identity_of("e0", 8101), process_start_time=2.0))},
         "$.engines.e0.identity_after",
         "the engine's generation after the sweep is missing or differs from the one before it"),
        ({"roles": None}, "$.engines.e0.roles", "expected the engine's roles"),
        ({"roles": []}, "$.engines.e0.roles", "expected the engine's roles"),
        ({"roles": ["prefill", 1]}, "$.engines.e0.roles", "expected the engine's roles"),
        ({"prefill": {"repeats": [{"length": 16, "ttft_s": 0.1}, {"length": 32, "ttft_s": 0.2}]}},
         "$.engines.e0.prefill.repeats", f"a TTFT fit needs at least {MIN_PREFILL_LENGTHS} lengths, got 2"),
        ({"prefill": None}, "$.engines.e0.prefill.repeats", "the samples hold no prefill repeats"),
        ({"decode": None}, "$.engines.e0.decode.cells", "the samples hold no decode cells"),
        ({"decode": {"cells": []}}, "$.engines.e0.decode.cells",
         f"0 usable decode cells; the fit needs at least {MIN_DECODE_CELLS}"),
    ],
)  # fmt: skip
def test_an_entry_that_gives_no_profile_names_its_path(
    changes: dict[str, Any], path: str, reason: str
) -> None:
    error = refused(derive_profile, entry(**changes), "e0")
    assert (error.path, error.reason) == (path, reason)


def test_a_rejected_ttft_curve_says_every_reason() -> None:
    good = derive_ttft([(n, 0.02 + 5e-5 * n) for n in (16, 512, 1024, 2048) for _ in range(3)])
    assert good.rejection() is None
    medians = zip((16, 512, 1024, 2048, 4096), (0.1, 1.0, 0.1, 1.0, 0.1), strict=True)
    noisy = derive_ttft([(n, m * f) for n, m in medians for f in (0.5, 1.0, 1.5)])
    reason = noisy.rejection()
    # The curve's own errors first, then its intervals' widths, each against its bound.
    assert reason is not None and reason.startswith("mean error 39.3% is above the 20% bound; ")
    assert "; mean prediction-interval half-width " in reason
    assert reason.index("leave-one-length-out") < reason.index("prediction-interval")
    assert noisy.rejection(max_mean_error=100.0, max_worst_error=100.0) is None
    assert (tight := noisy.rejection(max_mean_error=0.393, max_worst_error=100.0)) is not None
    assert tight.startswith("mean error 39.3% is above the 39% bound; ")
    few = derive_ttft([(n, 0.02 + 5e-5 * n) for n in (16, 512, 1024, 2048) for _ in range(2)])
    assert (
        few.rejection()
        == "2 repeat(s) at a length cannot bound its median (at least 3 are needed; raise --repeats)"
    )


# ------------------------------------------------------------------ the comparison


def test_a_profile_equals_itself_and_every_changed_figure_is_a_difference() -> None:
    p = derive_profile(entry(), "e0")
    assert profile_differences(p, p) == []
    assert p.decode is not None and p.ttft.uncertainty is not None
    t, d = p.ttft, p.decode
    changed = attrs.evolve(
        p,
        ttft=attrs.evolve(t, a=t.a * 1.001, max_length=8192),
        decode=attrs.evolve(
            d, domain=attrs.evolve(d.domain, active=attrs.evolve(d.domain.active, max=65.0))
        ),
        identity=attrs.evolve(p.identity, process_start_time=2.0),
    )
    assert profile_differences(changed, p) == [
        ("$.identity.process_start_time", 2.0, 1.0),
        ("$.ttft.a", t.a * 1.001, t.a),
        ("$.ttft.max_length", 8192, 4096),
        ("$.decode.domain.active.max", 65.0, 64.0),
    ]


def test_recomputed_figures_match_within_a_relative_millionth() -> None:
    p = derive_profile(entry(), "e0")
    assert p.decode is not None

    def decode_c1(value: float) -> EngineProfile:
        assert p.decode is not None
        return attrs.evolve(p, decode=attrs.evolve(p.decode, c1=value))

    c1 = p.decode.c1
    assert profile_differences(decode_c1(c1 * (1 + 5e-7)), p) == []
    assert profile_differences(decode_c1(c1 * (1 + 2e-6)), p) == [
        ("$.decode.c1", c1 * (1 + 2e-6), c1)
    ]
    # Near zero an absolute 1e-12 absorbs summation noise, not more.
    assert (
        profile_differences(
            decode_c1(5e-13), attrs.evolve(p, decode=attrs.evolve(p.decode, c1=0.0))
        )
        == []
    )
    assert profile_differences(
        decode_c1(5e-12), attrs.evolve(p, decode=attrs.evolve(p.decode, c1=0.0))
    ) == [("$.decode.c1", 5e-12, 0.0)]


def test_the_comparison_walks_lists_keys_and_types() -> None:
    p = derive_profile(entry(), "e0")
    other_roles = attrs.evolve(p, roles=("decode", "prefill"))
    assert profile_differences(other_roles, p) == [
        ("$.roles[0]", "decode", "prefill"),
        ("$.roles[1]", "prefill", "decode"),
    ]
    fewer = attrs.evolve(p, roles=("prefill",))
    assert profile_differences(fewer, p) == [("$.roles", ["prefill"], ["prefill", "decode"])]
    no_decode = attrs.evolve(p, decode=None)
    diffs = profile_differences(no_decode, p)
    assert diffs[0][0] == "$.decode" and diffs[0][1] is None
    assert len(diffs) == 1
    assert p.ttft.uncertainty is not None
    missing_band = {k: v for k, v in p.ttft.uncertainty.coefficients.items() if k != "c"}
    fewer_bands = attrs.evolve(p, ttft=attrs.evolve(p.ttft, uncertainty=attrs.evolve(
        p.ttft.uncertainty, coefficients=missing_band)))  # fmt: skip
    assert [path for path, claimed, _ in profile_differences(fewer_bands, p)] == [
        "$.ttft.uncertainty.coefficients.c"
    ]
    # A count is not a flag: True is not 1, nor 1 True.
    p_int = attrs.evolve(
        p, ttft=attrs.evolve(p.ttft, uncertainty=attrs.evolve(p.ttft.uncertainty, min_samples=1))
    )
    p_bool = attrs.evolve(
        p, ttft=attrs.evolve(p.ttft, uncertainty=attrs.evolve(p.ttft.uncertainty, min_samples=True))
    )
    assert profile_differences(p_bool, p_int) == [("$.ttft.uncertainty.min_samples", True, 1)]
    assert profile_differences(p_int, p_bool) == [("$.ttft.uncertainty.min_samples", 1, True)]
    assert profile_differences(p_bool, p_bool) == []


def test_a_figure_one_side_lacks_is_a_difference_not_an_error() -> None:
    from narwhal.profile.derive import _walk

    p = derive_profile(entry(), "e0")
    older = attrs.evolve(p, ttft=attrs.evolve(p.ttft, loo_mean_error=None))
    assert profile_differences(older, p) == [("$.ttft.loo_mean_error", None, p.ttft.loo_mean_error)]
    assert profile_differences(p, older) == [("$.ttft.loo_mean_error", p.ttft.loo_mean_error, None)]
    # A list against something else is one difference at that path (the walk is generic).
    for claimed, derived in [([1, 2], None), (None, [1, 2]), ([1], {"a": 1}), ({"a": 1}, [1])]:
        out: list[tuple[str, Any, Any]] = []
        _walk(claimed, derived, "$.x", out)
        assert out == [("$.x", claimed, derived)]
