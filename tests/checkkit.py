"""Helpers for the preflight tests: fleets of simulated engines, profile pairs written
directly with :mod:`narwhal.profile.store`'s classes (chosen fits and errors), and the
live identities a pair is bound to."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from narwhal.config import FleetConfig, converter, parse_fleet
from narwhal.engines.client import EngineClient, EngineIdentity
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


def write_pair(
    out: Path,
    profiles: Iterable[EngineProfile],
    *,
    cells: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    refit_of: str | None = None,
    extra_samples: Mapping[str, Any] | None = None,
) -> Path:
    """Write a profile pair at ``out`` (its sidecar beside it); returns the profiles path.

    ``cells`` gives an engine's kept decode cells as ``(active, kv_tokens)``; engines
    without cells get none in the sidecar (the gate then counts the domain).
    """
    profiles_path, samples_path = pair_paths(out)
    engines: dict[str, Any] = {}
    by_name = {p.name: p for p in profiles}
    for name, p in by_name.items():
        entry: dict[str, Any] = {
            "name": name,
            "status": "ok",
            "reason": None,
            "identity": attrs.asdict(p.identity),
            "profile": converter.unstructure(p),
        }
        if cells is not None and name in cells:
            entry["decode"] = {
                "cell_medians": [
                    {"active": a, "kv_tokens": kv, "tpot_s": p.predict_tpot(a, kv)}
                    for a, kv in cells[name]
                ]
            }
        engines[name] = entry
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


def with_profiles(doc: Mapping[str, Any], path: Path, **limits: float) -> FleetConfig:
    """The fleet document with ``profiles.path`` (and limits) set, loaded."""
    out = dict(copy.deepcopy(doc))
    out["profiles"] = {"path": str(path), **limits}
    return parse_fleet(out)
