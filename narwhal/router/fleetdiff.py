"""What a fleet document changes: its settings (by dotted path, a secret's values
redacted), which of them take a restart, and whether an engine is reached as before.

:mod:`narwhal.router.fleet` applies the difference; this module only compares.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs

from narwhal.config import EngineConfig, FleetConfig, converter, redacted

__all__ = ["RESTART_ONLY", "FleetChange", "changed_settings", "restart_only", "same_connection"]

#: Settings that change only with a restart (dotted paths; a prefix covers its fields).
RESTART_ONLY: Final = (
    "server",
    "journal",
    "tracing",  # the exporter and its batch thread are built once, at start
    "engine_limits",
    "controller.prompt_tokens",
    "controller.prefix_cache",
    "controller.reactive.enabled",
    "tenancy.store",  # the connections to it are made once, at start
)

#: Sections that are the fleet's engines, not settings.
_ENGINE_SECTIONS: Final = ("engines", "engine_groups")


@attrs.frozen
class FleetChange:
    """What one applied document changed.

    Attributes:
        source: where the document came from (``SIGHUP``, ``PUT /fleet``, ``dns:<group>``).
        added: engines added (starting until their readiness probe passes).
        removed: engines draining out of the fleet.
        replaced: engines drained and then added again (a connection setting changed).
        roles: engines whose roles changed in place.
        settings: the dotted paths of the settings that changed.
    """

    source: str
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.replaced or self.roles or self.settings)

    def describe(self) -> str:
        """One line: ``added p2; removed d0`` (or ``no change``)."""
        fields = (("added", self.added), ("removed", self.removed), ("replaced", self.replaced),
                  ("roles changed", self.roles), ("settings changed", self.settings))  # fmt: skip
        return "; ".join(f"{what} {', '.join(names)}" for what, names in fields if names) or "no change"

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "added": list(self.added),
            "removed": list(self.removed),
            "replaced": list(self.replaced),
            "roles": list(self.roles),
            "settings": list(self.settings),
        }


def same_connection(a: EngineConfig, b: EngineConfig) -> bool:
    """Whether ``a`` and ``b`` reach the same engine the same way (names, roles and the
    simulator block aside)."""
    return attrs.evolve(a, name=b.name, roles=b.roles, sim=b.sim) == b


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: {}}
    return {prefix: obj}


def _settings(config: FleetConfig) -> dict[str, Any]:
    """The document's settings, as JSON (its engines aside: a fleet of thousands of
    engines is not unstructured for a diff of its settings)."""
    return {
        f.name: converter.unstructure(getattr(config, f.name))
        for f in attrs.fields(FleetConfig)
        if f.name not in _ENGINE_SECTIONS
    }


def changed_settings(old: FleetConfig, new: FleetConfig) -> list[tuple[str, Any, Any]]:
    """``(dotted path, old value, new value)`` of every setting that differs (the engines
    aside); a secret's values are redacted (:func:`~narwhal.config.redacted`), so that a
    message built from them shows none."""
    fa, fb = _flatten(_settings(old)), _flatten(_settings(new))
    return [
        (k, redacted(k, fa.get(k)), redacted(k, fb.get(k)))
        for k in sorted(fa.keys() | fb.keys())
        if fa.get(k) != fb.get(k)
    ]


def restart_only(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in RESTART_ONLY)
