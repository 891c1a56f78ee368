"""Who a request is: its tenant (by API key name or a trusted gateway's header) and its
latency class (the tenant's, or another its tenant allows it to ask for).

A fleet document without a ``tenancy`` section has one class (``controller.slo`` and
``controller.admission``, as placement has them) and no tenants: :meth:`Tenancy.identify`
then returns a constant.

A request's key is matched, and named, by :class:`narwhal.router.keys.BearerKeys`
(in constant time; nothing keeps or formats the key itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from narwhal.config import (
    ClassConfig,
    FleetConfig,
    SLOConfig,
    TenantConfig,
    TenantLimits,
)
from narwhal.errors import Forbidden
from narwhal.router.placement import Room

__all__ = ["ClassSpec", "Tenancy", "TenantSpec"]


@attrs.frozen
class ClassSpec:
    """A latency class as admission and placement use it.

    Attributes:
        name: the class name (None: the one class of a fleet without tenancy).
        ttft_s: the TTFT target that bounds a request's wait for a placement (None: none).
        priority: lower is more urgent.
        slo: the targets placement prices the class's requests against (None: placement's
            own, ``controller.slo``).
        wait: whether a request may wait in the router's queue for capacity.
        max_wait_s: how long from arrival it may wait there (None: the request deadline).
        max_queued: most requests of the class waiting at once.
        room: what its requests must leave for others when placed: room for the classes
            more urgent than it (their strictest targets), and with ``wait`` short engine
            queues (:class:`~narwhal.router.placement.Room`); None: nothing.
    """

    name: str | None
    ttft_s: float | None = None
    priority: int = 0
    slo: SLOConfig | None = None
    wait: bool = False
    max_wait_s: float | None = None
    max_queued: int = 0
    room: Room | None = None


@attrs.frozen
class TenantSpec:
    """A tenant as admission uses it: its class, the classes it may ask for, its weight
    and limits (``limits`` is its whole limit; admission applies the process's share)."""

    name: str
    latency_class: ClassSpec
    allowed: frozenset[str]
    weight: float
    limits: TenantLimits

    @property
    def limited(self) -> bool:
        lim = self.limits
        return lim.max_in_flight is not None or lim.requests_per_s is not None or lim.tokens_per_s is not None


def _classes(configs: Sequence[ClassConfig], default_slo: SLOConfig, request_timeout_s: float) -> dict[str, ClassSpec]:
    out: dict[str, ClassSpec] = {}
    for c in configs:
        slo = c.slo if c.slo is not None else default_slo
        urgent = [o.slo if o.slo is not None else default_slo for o in configs if o.priority < c.priority]
        ttfts = [s.ttft_s for s in urgent if s.ttft_s is not None]
        tpots = [s.tpot_s for s in urgent if s.tpot_s is not None]
        room = Room(min(ttfts, default=None), min(tpots, default=None), c.wait) if ttfts or tpots or c.wait else None
        wait_s = c.max_wait_s if c.max_wait_s is not None else slo.ttft_s if slo.ttft_s is not None else request_timeout_s
        out[c.name] = ClassSpec(c.name, slo.ttft_s, c.priority, slo, c.wait, wait_s, c.max_queued, room)
    return out


def _tenant(t: TenantConfig, classes: dict[str, ClassSpec]) -> TenantSpec:
    own = classes[t.latency_class]
    allowed = {t.latency_class, *t.classes}
    allowed |= {name for name, c in classes.items() if c.priority >= own.priority}
    return TenantSpec(t.name, own, frozenset(allowed), t.weight, t.limits)


class Tenancy:
    """The tenants and classes of one fleet document, and how a request names its own."""

    def __init__(self, config: FleetConfig) -> None:
        cfg = config.tenancy
        self.config = cfg
        #: The one class of a fleet without a ``tenancy`` section.
        self.default_class = ClassSpec(None, config.controller.slo.ttft_s)
        # (Without a tenancy section identify() reads none of these: their values are moot.)
        self.classes: dict[str, ClassSpec] = {}  # pragma: no mutate (equivalent: unread without tenancy)
        self.tenants: dict[str, TenantSpec] = {}
        self.default: TenantSpec | None = None  # pragma: no mutate (equivalent: unread without tenancy)
        self.header: str | None = None  # pragma: no mutate (equivalent: unread without tenancy)
        self.class_header = ""  # pragma: no mutate (equivalent: unread without tenancy)
        self.engine_priority = False  # pragma: no mutate (equivalent: unread without tenancy)
        if cfg is None:
            return
        self.classes = _classes(cfg.classes, config.controller.slo, config.engine.request_timeout_s)
        self.tenants = {t.name: _tenant(t, self.classes) for t in cfg.tenants}
        self.default = self.tenants[cfg.default_tenant] if cfg.default_tenant is not None else None
        self.header = cfg.header.lower() if cfg.header is not None else None
        self.class_header = cfg.class_header.lower()
        self.engine_priority = cfg.engine_priority

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def identify(self, header: Callable[[str], str | None], key_name: str | None) -> tuple[TenantSpec | None, ClassSpec]:
        """The tenant and class of a request whose headers ``header`` reads and whose API
        key is named ``key_name`` (None: unnamed, or no keys configured).

        Raises:
            Forbidden: the request names no tenant and there is no default one; the
                gateway's header names an unknown tenant; the class header names a class
                the tenant may not ask for.
        """
        if self.config is None:
            return None, self.default_class
        tenant: TenantSpec | None
        if self.header is not None:
            named = header(self.header)
            tenant = self.default if named is None else self.tenants.get(named.strip())
            if tenant is None and named is not None:
                raise Forbidden(f"the {self.header} header names no tenant of this router", code="unknown_tenant")
        else:
            tenant = self.tenants[key_name] if key_name is not None else self.default
        if tenant is None:
            raise Forbidden("this request names no tenant (a key with a tenant's name, or the gateway's header)",
                            code="unknown_tenant")  # fmt: skip
        asked = header(self.class_header)
        if asked is None:
            return tenant, tenant.latency_class
        asked = asked.strip()
        if asked not in tenant.allowed:
            what = asked[:64]  # pragma: no mutate (equivalent: a bound on what is echoed, not its content)
            raise Forbidden(f"class {what!r} is not one tenant {tenant.name} may ask for", code="class_not_allowed")
        return tenant, self.classes[asked]
