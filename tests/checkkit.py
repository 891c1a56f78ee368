"""Helpers for the preflight tests: fleets of simulated engines, profile pairs written
directly with :mod:`narwhal.profile.store`'s classes (chosen fits and errors), and the
live identities a pair is bound to."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from narwhal.config import FleetConfig, converter, parse_fleet
from narwhal.engines.client import EngineClient, EngineIdentity
from narwhal.errors import ConfigError
from narwhal.profile.derive import derive_profile
from narwhal.profile.store import (
    PROFILES_KIND,
    SAMPLES_KIND,
    SCHEMA_VERSION,
    DecodeAxis,
    DecodeDomain,
    DecodeModel,
    EngineProfile,
    KVCapacity,
    Profiles,
    SamplesRef,
    TTFTCurve,
    file_sha256,
    pair_paths,
    write_json,
)

PREFILL = {"a": 0.02, "b": 5e-5, "c": 0.0}
DECODE = {"c0": 0.005, "c1": 0.0008, "c2": 2e-7}
#: Virtual seconds a whole check may take in a test (a hang guard).
LIMIT_S = 600.0


def engine(
    name: str, port: int, roles: Sequence[str] = ("prefill", "decode"), **sim: Any
) -> dict[str, Any]:
    """A fleet document's engine with a simulated engine behind it (``sim=None``: none)."""
    doc: dict[str, Any] = {
        "name": name,
        "url": f"http://{name}.test:{port}",
        "roles": list(roles),
        "connector": {
            "type": "NixlConnector",
            "kv_host": f"{name}.kv.test",
            "kv_port": 15000 + port,
        },
    }
    if sim.pop("no_sim", False):
        return doc
    block: dict[str, Any] = {
        "seed": 1,
        "prefill": dict(PREFILL),
        "decode": dict(DECODE),
        "transfer_s_per_token": 0.0,
    }
    for key, value in sim.items():
        if isinstance(value, dict) and isinstance(block.get(key), dict):
            block[key] = {**block[key], **value}
        else:
            block[key] = copy.deepcopy(value)
    doc["sim"] = block
    return doc


def fleet_doc(*engines: dict[str, Any], **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "engines": list(engines) or [engine("e0", 8101), engine("e1", 8102)],
        "engine": {"first_token_timeout_s": 5.0, "decode_read_timeout_s": 5.0},
    }
    doc.update(copy.deepcopy(sections))
    return doc


async def identities(
    config: FleetConfig, transport: httpx.AsyncBaseTransport
) -> dict[str, EngineIdentity]:
    """Each simulated engine's live generation."""
    async with httpx.AsyncClient(transport=_Borrowed(transport)) as http:
        return {
            e.name: await EngineClient(
                e.url, name=e.name, model=e.model, http_client=http
            ).identity()
            for e in config.engines
            if e.sim is not None
        }


class _Borrowed(httpx.AsyncBaseTransport):
    """A transport that is not closed with the client (the fleet owns it)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        pass


def sim_profile(
    name: str,
    identity: EngineIdentity,
    *,
    prefill: Mapping[str, float] = PREFILL,
    decode: Mapping[str, float] = DECODE,
    fit_mape: float = 0.01,
    cv_mape: float = 0.02,
    active: tuple[float, float] = (1.0, 64.0),
    kv_tokens: tuple[float, float] = (100.0, 200_000.0),
    kv_capacity: int = 262_144,
    max_length: int = 4096,
) -> EngineProfile:
    """A profile with chosen coefficients and errors, bound to ``identity``."""
    domain = DecodeDomain(
        active=DecodeAxis(min=active[0], max=active[1]),
        kv_tokens=DecodeAxis(min=kv_tokens[0], max=kv_tokens[1]),
    )
    return EngineProfile(
        name=name,
        identity=identity,
        ttft=TTFTCurve(
            a=prefill["a"],
            b=prefill["b"],
            c=prefill["c"],
            min_length=16,
            max_length=max_length,
            mean_error=0.01,
            worst_error=0.02,
        ),
        decode=DecodeModel(
            c0=decode["c0"],
            c1=decode["c1"],
            c2=decode["c2"],
            fit_mape=fit_mape,
            cv_mape=cv_mape,
            cells=4,
            domain=domain,
        ),
        kv_capacity=KVCapacity(source="physical", tokens=kv_capacity, basis="test"),
    )


def identity_of(name: str, port: int) -> EngineIdentity:
    """An identity for an engine that is not running (suggest-slo needs none)."""
    return EngineIdentity(
        url=f"http://{name}.test:{port}",
        model="sim-llama",
        version="0.32.0",
        max_model_len=4096,
        process_start_time=1.0,
    )


def raw_entry(
    p: EngineProfile,
    *,
    cells: Sequence[tuple[float, float]] | None = None,
    decode_noise: float = 0.0,
    started_at: float | None = None,
) -> dict[str, Any]:
    """A sidecar entry of raw samples that the profile's curves generate.

    Prefill: three repeats at five lengths up to ``max_length`` on the TTFT curve.
    Decode (engines with the decode role): two streams of four window intervals per
    cell, at ``cells`` (``(active, kv_tokens)``) or the domain's four corners; with
    ``decode_noise`` the cells' TPOTs alternate ``1 +/- decode_noise`` around the model.
    """
    top = p.ttft.max_length
    lengths = sorted({16, top // 8, top // 4, top // 2, top})
    repeats = [{"length": n, "ttft_s": p.predict_ttft(n), "repeat": r}
               for n in lengths for r in range(3)]  # fmt: skip
    now = time.time() if started_at is None else started_at
    entry: dict[str, Any] = {
        "name": p.name,
        "status": "ok",
        "reason": None,
        "roles": list(p.roles),
        "identity": attrs.asdict(p.identity),
        "identity_after": attrs.asdict(p.identity),
        "wall_clock": {"started_at": now, "finished_at": now + 1.0},
        "prefill": {"repeats": repeats},
        "engine": {"kv_cache_size_tokens": None},
    }
    if p.decode is not None:
        dom = p.decode.domain
        grid = list(cells) if cells is not None else [
            (a, k) for a in (dom.active.min, dom.active.max)
            for k in (dom.kv_tokens.min, dom.kv_tokens.max)
        ]  # fmt: skip
        raw = []
        for i, (a, k) in enumerate(grid):
            tpot = p.decode.predict(a, k) * (1 + decode_noise * (-1) ** i)
            intervals = [{"stream": s, "index": j, "seconds": tpot, "active": a, "kv_tokens": k}
                         for s in range(2) for j in range(4)]  # fmt: skip
            raw.append({"kept": True, "intervals": intervals})
        entry["decode"] = {
            "cells": raw,
            "cell_medians": [{"active": a, "kv_tokens": k} for a, k in grid],
        }
        if p.kv_capacity is not None and p.kv_capacity.source == "physical":
            entry["engine"]["kv_cache_size_tokens"] = p.kv_capacity.tokens
    return entry


def write_pair(
    out: Path,
    profiles: Iterable[EngineProfile],
    *,
    cells: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    decode_noise: Mapping[str, float] | None = None,
    refit_of: str | None = None,
    extra_samples: Mapping[str, Any] | None = None,
) -> Path:
    """Write a profile pair at ``out`` (its sidecar beside it); returns the profiles path.

    The sidecar holds raw samples generated by each profile's curves
    (:func:`raw_entry`), and ``profiles.json`` holds the profiles those samples give
    (as the profiler derives them), so the pair passes the preflight's recomputation;
    an engine whose samples give no profile keeps the profile passed in.
    """
    profiles_path, samples_path = pair_paths(out)
    engines: dict[str, Any] = {}
    by_name: dict[str, EngineProfile] = {}
    for p in profiles:
        entry = raw_entry(p, cells=(cells or {}).get(p.name),
                          decode_noise=(decode_noise or {}).get(p.name, 0.0))  # fmt: skip
        try:
            derived = derive_profile(entry, p.name)
        except ConfigError:
            derived = p
        entry["profile"] = converter.unstructure(derived)
        engines[p.name] = entry
        by_name[p.name] = derived
    samples = {
        "schema_version": SCHEMA_VERSION,
        "kind": SAMPLES_KIND,
        "created_at": "now",
        "software": {},
        "profiles": profiles_path.name,
        "engines": engines,
        **(extra_samples or {}),
    }
    write_json(samples_path, samples)
    doc = Profiles(
        schema_version=SCHEMA_VERSION,
        kind=PROFILES_KIND,
        created_at="now",
        software={},
        samples=SamplesRef(path=samples_path.name, sha256=file_sha256(samples_path)),
        engines=by_name,
        refit_of=refit_of,
    )
    write_json(profiles_path, doc.to_json())
    return profiles_path


def rewrite_pair(profiles_path: Path, edit_profiles: Any = None, edit_samples: Any = None) -> None:
    """Edit a written pair's JSON in place and re-hash the sidecar into profiles.json
    (a tampered pair whose SHA-256 still matches)."""
    profiles_doc = json.loads(profiles_path.read_text())
    samples_path = profiles_path.with_name(profiles_doc["samples"]["path"])
    samples_doc = json.loads(samples_path.read_text())
    if edit_samples is not None:
        edit_samples(samples_doc)
    samples_path.write_text(json.dumps(samples_doc))
    if edit_profiles is not None:
        edit_profiles(profiles_doc)
    profiles_doc["samples"]["sha256"] = file_sha256(samples_path)
    profiles_path.write_text(json.dumps(profiles_doc))


def with_profiles(doc: Mapping[str, Any], path: Path, **limits: float) -> FleetConfig:
    """The fleet document with ``profiles.path`` (and limits) set, loaded."""
    out = dict(copy.deepcopy(doc))
    out["profiles"] = {"path": str(path), **limits}
    return parse_fleet(out)
