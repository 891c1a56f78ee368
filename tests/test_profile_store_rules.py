"""The profile pair's rules without a sweep: the records' formulas and validation, the
pair's paths, atomic JSON files and the loader's refusals, each with its JSON path."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from narwhal.config import converter
from narwhal.engines.client import EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.fit import CACHED_MODEL, TPOT_MODEL, TTFT_MODEL
from narwhal.profile.store import (
    PROFILES_KIND,
    SCHEMA_VERSION,
    CachedPrefill,
    CoefficientBand,
    DecodeAxis,
    DecodeDomain,
    DecodeModel,
    EngineProfile,
    KVCapacity,
    Profiles,
    SamplesRef,
    TTFTCurve,
    Uncertainty,
    file_sha256,
    load_profiles,
    pair_paths,
    read_json,
    write_json,
)

IDENTITY = EngineIdentity("http://e0.test:8101", "m", "0.9", 4096, 1_700_000_000.0)


def uncertainty(upper_factor: float = 1.25) -> Uncertainty:
    return Uncertainty(level=0.95, resamples=200,
                       coefficients={"a": CoefficientBand(value=0.02, low=0.018, high=0.022)},
                       upper_factor=upper_factor, worst_half_width=0.1)  # fmt: skip


def curve(**changes: Any) -> TTFTCurve:
    base: dict[str, Any] = {"a": 0.02, "b": 5e-5, "c": 2e-8, "min_length": 128,
                            "max_length": 2048, "mean_error": 0.01, "worst_error": 0.02}  # fmt: skip
    return TTFTCurve(**(base | changes))


def decode(**changes: Any) -> DecodeModel:
    domain = DecodeDomain(active=DecodeAxis(min=1, max=8), kv_tokens=DecodeAxis(min=300, max=9000))
    base: dict[str, Any] = {"c0": 0.005, "c1": 0.0008, "c2": 2e-7, "fit_mape": 0.01,
                            "cv_mape": 0.02, "cells": 6, "domain": domain}  # fmt: skip
    return DecodeModel(**(base | changes))


def engine_profile(name: str = "e0", **changes: Any) -> EngineProfile:
    base: dict[str, Any] = {
        "name": name, "identity": IDENTITY, "ttft": curve(), "decode": decode(),
        "kv_capacity": KVCapacity(source="physical", tokens=100_000, basis="reported"),
    }  # fmt: skip
    return EngineProfile(**(base | changes))


def document(*profiles: EngineProfile, sha256: str = "0" * 64) -> Profiles:
    return Profiles(schema_version=SCHEMA_VERSION, created_at="2026-01-01T00:00:00+00:00",
                    software={"narwhal": "test"},
                    samples=SamplesRef(path="profiles.samples.json", sha256=sha256),
                    engines={p.name: p for p in profiles})  # fmt: skip


def write_pair(folder: Path, doc: Profiles | None = None) -> Path:
    """A profiles file and its sidecar, the file naming the sidecar's SHA-256."""
    sidecar = folder / "profiles.samples.json"
    write_json(sidecar, {"kind": "narwhal.profile-samples"})
    doc = doc if doc is not None else document(engine_profile())
    data = doc.to_json()
    data["samples"] = {"path": sidecar.name, "sha256": file_sha256(sidecar)}
    path = folder / "profiles.json"
    write_json(path, data)
    return path


def refused(path: Path, **kw: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_profiles(path, **kw)
    return info.value


def edited(path: Path, edit: Any) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_the_curves_predict_their_formulas_and_the_upper_bound() -> None:
    ttft = curve()
    assert ttft.predict(1000) == pytest.approx(0.02 + 5e-5 * 1000 + 2e-8 * 1e6)
    assert ttft.predict_upper(1000) == ttft.predict(1000)  # no intervals: no factor
    bounded = curve(uncertainty=uncertainty(1.25))
    assert bounded.predict_upper(1000) == pytest.approx(1.25 * ttft.predict(1000))
    cached = CachedPrefill(a=0.02, b=5e-5, c=2e-8, d=1e-6, cells=9, min_length=128,
                           max_length=2048, max_cached=1024, block_size=16, mean_error=0.01,
                           worst_error=0.02, loo_mean_error=0.02, loo_worst_error=0.03,
                           uncertainty=uncertainty(1.5))  # fmt: skip
    truth = 0.02 + 5e-5 * (1000 - 400) + 2e-8 * (1000**2 - 400**2) + 1e-6 * 400
    assert cached.predict(1000, 400) == pytest.approx(truth)
    assert cached.predict_upper(1000, 400) == pytest.approx(1.5 * truth)
    model = decode()
    assert model.predict(4, 5000) == pytest.approx(0.005 + 0.0008 * 4 + 2e-7 * 5000)
    assert model.upper_factor == 1.0
    assert decode(uncertainty=uncertainty(1.25)).upper_factor == 1.25
    p = engine_profile()
    assert p.predict_ttft(1000) == ttft.predict(1000)
    assert p.predict_tpot(4, 5000) == model.predict(4, 5000)
    assert p.decode_model is p.decode and p.kv_limit is p.kv_capacity


def test_the_decode_domain_includes_its_edges_only() -> None:
    domain = decode().domain
    assert domain.contains(1, 300) and domain.contains(8, 9000) and domain.contains(4, 5000)
    for active, kv in ((0.999, 5000), (8.001, 5000), (4, 299.9), (4, 9000.1)):
        assert not domain.contains(active, kv)
    assert DecodeAxis(min=2, max=2).contains(2)


def test_only_a_measured_kv_capacity_is_no_limit() -> None:
    assert KVCapacity(source="physical", tokens=1, basis="x").is_limit
    assert KVCapacity(source="tpot", tokens=1, basis="x").is_limit
    assert not KVCapacity(source="measured", tokens=1, basis="x").is_limit


def test_a_prefill_only_profile_has_no_decode_figures() -> None:
    p = engine_profile("p0", decode=None, kv_capacity=None, roles=("prefill",))
    for figure, what in ((lambda: p.decode_model, "decode model"),
                         (lambda: p.kv_limit, "KV capacity"),
                         (lambda: p.predict_tpot(1, 100), "decode model")):  # fmt: skip
        with pytest.raises(ValueError) as info:
            figure()
        assert str(info.value) == f"engine p0 was profiled for prefill only (no {what})"
    assert p.predict_ttft(100) == curve().predict(100)


@pytest.mark.parametrize("value", [-1e-12, math.nan])
def test_a_negative_or_nan_coefficient_is_refused_with_its_field(value: float) -> None:
    with pytest.raises(ConfigError) as info:
        curve(b=value)
    assert str(info.value) == "expected a number >= 0 @ $.b"
    with pytest.raises(ConfigError) as info:
        decode(c2=value)
    assert info.value.path == "$.c2" and info.value.reason == "expected a number >= 0"
    with pytest.raises(ConfigError, match=r"@ \$\.mean_half_width$"):
        Uncertainty(level=0.9, resamples=1, coefficients={}, upper_factor=1.0,
                    worst_half_width=0.0, mean_half_width=value)  # fmt: skip
    assert curve(a=0.0, b=0.0, c=0.0, mean_error=0.0, worst_error=0.0).predict(5) == 0.0


def test_a_record_of_another_formula_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        curve(model="a + b*L")
    assert str(info.value) == f"expected {TTFT_MODEL!r} @ $.model"
    with pytest.raises(ConfigError, match=r"@ \$\.model$"):
        decode(model=CACHED_MODEL)
    assert curve(model=TTFT_MODEL).model == TTFT_MODEL and decode().model == TPOT_MODEL


def test_the_document_looks_up_engines_and_round_trips() -> None:
    doc = document(engine_profile("e0"), engine_profile("e1"))
    assert doc["e1"].name == "e1" and "e0" in doc and "e9" not in doc
    with pytest.raises(KeyError):
        doc["e9"]
    data = doc.to_json()
    assert data["kind"] == PROFILES_KIND and data["schema_version"] == SCHEMA_VERSION
    assert data["engines"]["e0"]["ttft"]["b"] == 5e-5 and data["refit_of"] is None
    assert converter.structure(json.loads(json.dumps(data)), Profiles) == doc
    with pytest.raises(ConfigError) as info:
        Profiles(schema_version=2, created_at="x", software={},
                 samples=SamplesRef(path="s", sha256="0"), engines={})  # fmt: skip
    assert str(info.value) == (
        "schema_version 2 is not 1; profile again with this narwhal @ $.schema_version"
    )


def test_the_sidecar_is_named_after_the_profiles_file(tmp_path: Path) -> None:
    assert pair_paths("runs/profiles.json") == (
        Path("runs/profiles.json"), Path("runs/profiles.samples.json"))  # fmt: skip
    assert pair_paths(tmp_path / "p") == (tmp_path / "p", tmp_path / "p.samples.json")
    assert pair_paths("a.json.json")[1] == Path("a.json.samples.json")
    assert pair_paths("json")[1] == Path("json.samples.json")


def test_the_digest_covers_every_byte_of_a_large_file(tmp_path: Path) -> None:
    path = tmp_path / "big"
    data = os.urandom((1 << 20) * 2 + 7)  # several read blocks and a partial one
    path.write_bytes(data)
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_json_is_written_whole_indented_and_finite(tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "doc.json"
    write_json(path, {"a": [1, 2], "b": "é"})
    assert path.read_text(encoding="utf-8") == json.dumps({"a": [1, 2], "b": "é"}, indent=1) + "\n"
    write_json(path, {"a": 3})  # replaces the file
    assert json.loads(path.read_text()) == {"a": 3}
    assert sorted(p.name for p in path.parent.iterdir()) == ["doc.json"]  # no temporary left
    with pytest.raises(ValueError):
        write_json(path, {"a": math.inf})
    assert json.loads(path.read_text()) == {"a": 3}  # a failed write leaves the file as it was
    assert read_json(path, "a doc") == {"a": 3}


def test_an_unreadable_or_malformed_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        read_json(missing, "samples file")
    assert str(info.value) == f"{missing}: cannot read samples file: No such file or directory @ $"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError) as info:
        read_json(bad, "samples file")
    assert info.value.reason.startswith("samples file is not valid JSON: ")
    assert info.value.source == str(bad)
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="samples file is not valid JSON"):
        read_json(bad, "samples file")


def test_the_loader_accepts_a_pair_and_refuses_each_mix_up(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^[^:]*nope\.json: cannot read profiles file: "):
        load_profiles(tmp_path / "nope.json")
    path = write_pair(tmp_path)
    assert load_profiles(path)["e0"] == engine_profile()
    source = str(path)

    err = refused(edited(write_pair(tmp_path), lambda d: d.update(kind="narwhal.fleet")))
    assert (err.reason, err.path, err.source) == (
        "not a narwhal profiles file (kind 'narwhal.fleet')", "$.kind", source)  # fmt: skip
    path.write_text("[]")
    err = refused(path)
    assert (err.reason, err.path, err.source) == ("expected an object", "$", source)

    err = refused(edited(write_pair(tmp_path), lambda d: d["engines"]["e0"].update(name="e1")))
    assert (err.reason, err.path, err.source) == (
        "profile of engine 'e1' filed under 'e0'", "$.engines.e0.name", source)  # fmt: skip

    err = refused(edited(write_pair(tmp_path), lambda d: d["engines"]["e0"]["ttft"].update(a=-1)))
    assert err.path == "$.engines['e0'].ttft.a" and err.source == source

    write_pair(tmp_path)
    (tmp_path / "profiles.samples.json").unlink()
    err = refused(path)
    assert (err.reason, err.path, err.source) == (
        "its samples sidecar profiles.samples.json is missing", "$.samples.path", source)  # fmt: skip
    assert "e0" in load_profiles(path, verify_samples=False)

    write_pair(tmp_path)
    (tmp_path / "profiles.samples.json").write_text("{}\n")
    err = refused(path)
    assert (err.reason, err.path, err.source) == (
        "its samples sidecar profiles.samples.json is not the one it was written with "
        "(SHA-256 differs)", "$.samples.sha256", source)  # fmt: skip
    assert load_profiles(path, verify_samples=False)["e0"] == engine_profile()


def test_the_sidecar_is_looked_up_beside_the_profiles_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pair").mkdir()
    path = write_pair(tmp_path / "pair")
    monkeypatch.chdir(tmp_path)  # not where the pair is
    assert "e0" in load_profiles(path)
    assert "e0" in load_profiles(Path("pair") / "profiles.json")
