"""Scripted faults of a simulated engine: which requests a fault hits, and how often.

A :class:`FaultPlan` holds the engine's armed :class:`~narwhal.config.FaultSpec`\\ s.
Each generation request draws its :class:`Faults` once, on arrival: every armed spec
whose ``on`` matches the request's leg is rolled against its ``probability`` with the
engine's seeded RNG, and a hit spends one of its ``times``. At most one spec per kind
hits a request (the first armed one that rolls a hit).

Legs: a request carrying ``kv_transfer_params.do_remote_decode == true`` is on the
*prefill* leg; a streaming request or one carrying ``do_remote_prefill == true`` is on
the *decode* leg; anything else is on neither and only ``on: "any"`` faults hit it.
``refuse_connection`` is not drawn per request: it acts on connections (see
:meth:`FaultPlan.take_refusal`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from narwhal.config import FaultSpec

__all__ = ["DESCRIPTOR_VARIANTS", "FaultPlan", "Faults", "Leg", "leg_of", "malform_descriptor"]

Leg = Literal["prefill", "decode", "other"]

DESCRIPTOR_VARIANTS: tuple[str, ...] = (
    "missing_engine_id",
    "bad_block_ids",
    "wrong_endpoint",
    "missing_request_id",
)


def leg_of(body: Mapping[str, Any]) -> Leg:
    """The leg a generation request body is on (see the module docstring)."""
    kv = body.get("kv_transfer_params")
    if isinstance(kv, Mapping):
        if kv.get("do_remote_decode") is True:
            return "prefill"
        if kv.get("do_remote_prefill") is True:
            return "decode"
    return "decode" if body.get("stream") is True else "other"


@attrs.define
class _Armed:
    spec: FaultSpec
    remaining: int | None


@attrs.frozen
class Faults:
    """The faults that hit one request, by kind."""

    by_kind: Mapping[str, FaultSpec] = attrs.field(factory=dict)

    def get(self, kind: str) -> FaultSpec | None:
        """The spec of ``kind`` that hit, or None."""
        return self.by_kind.get(kind)

    def __contains__(self, kind: object) -> bool:
        return kind in self.by_kind

    def __iter__(self) -> Iterator[FaultSpec]:
        return iter(self.by_kind.values())

    def __bool__(self) -> bool:
        return bool(self.by_kind)


NO_FAULTS = Faults()


class FaultPlan:
    """The armed faults of one engine and the seeded RNG that rolls them."""

    def __init__(self, specs: Sequence[FaultSpec] = (), *, rng: random.Random) -> None:
        self._rng = rng
        self._armed: list[_Armed] = []
        for spec in specs:
            self.add(spec)

    @property
    def specs(self) -> list[FaultSpec]:
        """The armed specs (spent ones are gone)."""
        return [a.spec for a in self._armed]

    def add(self, spec: FaultSpec) -> None:
        """Arm ``spec``."""
        self._armed.append(_Armed(spec, spec.times))

    def clear(self) -> None:
        """Disarm every fault."""
        self._armed.clear()

    def _spend(self, armed: _Armed) -> None:
        if armed.remaining is not None:
            armed.remaining -= 1
            if armed.remaining <= 0:
                self._armed.remove(armed)

    def draw(self, leg: Leg) -> Faults:
        """Roll the faults for one request on ``leg``; hits spend their ``times``."""
        hit: dict[str, FaultSpec] = {}
        for armed in list(self._armed):
            spec = armed.spec
            if spec.kind == "refuse_connection" or spec.kind in hit:
                continue
            if spec.on != "any" and spec.on != leg:
                continue
            if spec.probability < 1.0 and self._rng.random() >= spec.probability:
                continue
            hit[spec.kind] = spec
            self._spend(armed)
        return Faults(hit) if hit else NO_FAULTS

    def refusing(self) -> bool:
        """Whether a ``refuse_connection`` fault is armed."""
        return any(a.spec.kind == "refuse_connection" for a in self._armed)

    def take_refusal(self) -> bool:
        """Roll ``refuse_connection`` for one connection attempt; a hit spends one."""
        for armed in list(self._armed):
            if armed.spec.kind != "refuse_connection":
                continue
            if armed.spec.probability < 1.0 and self._rng.random() >= armed.spec.probability:
                continue
            self._spend(armed)
            return True
        return False

    def pick_variant(self, spec: FaultSpec) -> str:
        """The descriptor variant of a ``malformed_descriptor`` hit (null picks one)."""
        if spec.variant is not None:
            return spec.variant
        return self._rng.choice(DESCRIPTOR_VARIANTS)


def malform_descriptor(descriptor: Mapping[str, Any], variant: str) -> dict[str, Any]:
    """A copy of a NixlConnector descriptor broken the way ``variant`` says."""
    bad = dict(descriptor)
    if variant == "missing_engine_id":
        bad.pop("remote_engine_id", None)
    elif variant == "missing_request_id":
        bad.pop("remote_request_id", None)
    elif variant == "bad_block_ids":
        bad["remote_block_ids"] = ["not-a-block"]
    elif variant == "wrong_endpoint":
        port = bad.get("remote_port")
        bad["remote_port"] = port + 1 if isinstance(port, int) and port < 65535 else 1
    else:
        raise ValueError(f"unknown descriptor variant {variant!r}")
    return bad
