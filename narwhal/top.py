"""``narwhal top``: a terminal view of a running router, built on its admin surface.

Per engine: roles, load (legs in flight), breaker state, and rolling TTFT / TPOT of
the requests it served over the last window, against the fleet's SLO. With tenants and
latency classes (the fleet's ``tenancy``), per class and tenant: the requests of the
window, the share that met the class's targets (first byte within its TTFT target, TPOT
within its TPOT target), what waits in the router's queue now, the wait of the queued
ones, and the 429s and 503s. The view reads ``GET /fleet`` (again at each redraw while
there are classes: their queues) and follows ``/events`` (journal records and breaker
transitions) over WebSocket. With admin keys on the router, it presents ``key``
(``narwhal top --admin-key``, or the ``NARWHAL_ADMIN_KEY`` environment variable).
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import httpx
import trio
import trio_websocket

from narwhal.cmdline import CommandError, leaves
from narwhal.router.admin import open_events
from narwhal.router.keys import ADMIN_KEY_ENV, bearer

__all__ = ["TopView", "run_top"]


_LOST = (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionClosed)


def _p(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


class TopView:
    """The state behind the view; :meth:`render` turns it into text."""

    def __init__(self, fleet: dict[str, Any], *, window: int = 200) -> None:
        self.engines: dict[str, dict[str, Any]] = {e["name"]: dict(e) for e in fleet["engines"]}
        self.slo: dict[str, float | None] = fleet.get("slo") or {}
        self.ttft: dict[str, collections.deque[float]] = collections.defaultdict(lambda: collections.deque(maxlen=window))
        self.tpot: dict[str, collections.deque[float]] = collections.defaultdict(lambda: collections.deque(maxlen=window))
        self.classes: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.window = window
        #: The classes and tenants (GET /fleet's ``tenancy``; None: the fleet has none).
        self.tenancy: dict[str, Any] | None = fleet.get("tenancy")
        #: Per (class, tenant): whether each of its latest requests met the class's targets,
        #: the waits of its latest queued ones, and its 429s and 503s.
        self.met: dict[tuple[str, str], collections.deque[bool]] = {}
        self.waits: dict[tuple[str, str], collections.deque[float]] = {}
        self.refusals: dict[tuple[str, str], collections.Counter[int]] = {}

    def update_fleet(self, fleet: dict[str, Any]) -> None:
        """A fresh ``GET /fleet``: the queues of the classes now."""
        self.tenancy = fleet.get("tenancy")

    def _tenant_record(self, record: dict[str, Any]) -> None:
        key = (str(record.get("latency_class")), str(record["tenant"]))
        klass = record["terminal_class"]
        if klass == "client_cancelled":
            return
        spec = ((self.tenancy or {}).get("classes") or {}).get(key[0]) or {}
        ttft, tpot = spec.get("ttft_s"), spec.get("tpot_s")
        first, step = record.get("first_byte_s"), record.get("tpot_s")
        met = klass == "ok" and (ttft is None or (first is not None and first <= ttft)) and (
            tpot is None or step is None or step <= tpot)  # fmt: skip
        self.met.setdefault(key, collections.deque(maxlen=self.window)).append(met)
        if record.get("queued_s"):
            self.waits.setdefault(key, collections.deque(maxlen=self.window)).append(record["queued_s"])
        if record.get("status") in (429, 503):
            self.refusals.setdefault(key, collections.Counter())[record["status"]] += 1

    def apply(self, event: dict[str, Any]) -> None:
        if event.get("type") == "request":
            record = event["record"]
            self.requests += 1
            self.classes[record["terminal_class"]] += 1
            if record.get("tenant") is not None:
                self._tenant_record(record)
            if record.get("ttft_s") is not None and record.get("producer") in self.engines:
                self.ttft[record["producer"]].append(record["ttft_s"])
            if record.get("tpot_s") is not None and record.get("consumer") in self.engines:
                self.tpot[record["consumer"]].append(record["tpot_s"])
        elif event.get("type") == "breaker" and event.get("engine") in self.engines:
            kind = event["event"]
            engine = self.engines[event["engine"]]
            if kind == "ejected":
                engine["breaker"] = "ejected"
            elif kind in ("readmitted", "closed"):
                engine["breaker"] = "ok"
            elif kind == "quarantined" and engine.get("breaker") == "ok":
                engine["breaker"] = "quarantined"

    def render(self) -> str:
        slo_ttft, slo_tpot = self.slo.get("ttft_s"), self.slo.get("tpot_s")
        head = (
            f"narwhal top — {self.requests} requests   SLO ttft {_ms(slo_ttft)} ms, tpot {_ms(slo_tpot)} ms\n"
            + "classes: " + (", ".join(f"{k} {v}" for k, v in sorted(self.classes.items())) or "-") + "\n\n"
        )
        cols = f"{'engine':<16}{'roles':<16}{'breaker':<13}{'load':>6}{'ttft p50':>10}{'ttft p90':>10}{'tpot p50':>10}{'tpot p90':>10}  slo"
        rows = [cols, "-" * len(cols)]
        for name, e in self.engines.items():
            ttft, tpot = list(self.ttft[name]), list(self.tpot[name])
            t90, p90 = _p(ttft, 0.9), _p(tpot, 0.9)
            misses = []
            if slo_ttft is not None and t90 is not None and t90 > slo_ttft:
                misses.append("ttft")
            if slo_tpot is not None and p90 is not None and p90 > slo_tpot:
                misses.append("tpot")
            verdict = "miss " + "+".join(misses) if misses else ("ok" if (ttft or tpot) and (slo_ttft or slo_tpot) else "-")
            rows.append(
                f"{name:<16}{'+'.join(e.get('roles', [])):<16}{e.get('breaker', '?'):<13}{e.get('in_flight', 0):>6}"
                f"{_ms(_p(ttft, 0.5)):>10}{_ms(t90):>10}{_ms(_p(tpot, 0.5)):>10}{_ms(p90):>10}  {verdict}"
            )
        return head + "\n".join(rows) + "\n" + self._render_tenancy()

    def _render_tenancy(self) -> str:
        tenancy = self.tenancy
        if tenancy is None:
            return ""
        classes, tenants = tenancy.get("classes") or {}, tenancy.get("tenants") or {}
        cols = (f"{'class':<14}{'tenant':<16}{'n':>6}{'attain':>9}{'queued':>8}{'wait p50':>10}{'wait p90':>10}"
                f"{'429':>6}{'503':>6}  targets")  # fmt: skip
        rows = ["", cols, "-" * len(cols)]
        keys = {(t.get("class"), name) for name, t in tenants.items()} | set(self.met)
        for klass, tenant in sorted(keys, key=lambda k: (classes.get(k[0], {}).get("priority", 0), str(k[0]), k[1])):
            key = (str(klass), tenant)
            met, waits = list(self.met.get(key, ())), list(self.waits.get(key, ()))
            refused = self.refusals.get(key, collections.Counter())
            spec = classes.get(klass) or {}
            queued = ((tenants.get(tenant) or {}).get("queued") or {}).get(str(klass), 0)
            attain = f"{100 * sum(met) / len(met):.1f}%" if met else "-"
            targets = f"ttft {_ms(spec.get('ttft_s'))} ms, tpot {_ms(spec.get('tpot_s'))} ms"
            rows.append(
                f"{klass!s:<14}{tenant:<16}{len(met):>6}{attain:>9}{queued:>8}{_ms(_p(waits, 0.5)):>10}"
                f"{_ms(_p(waits, 0.9)):>10}{refused[429]:>6}{refused[503]:>6}  {targets}"
            )
        return "\n".join(rows) + "\n"


async def run_top(
    admin_url: str, *, once_after_s: float | None = None, out: TextIO = sys.stdout, key: str | None = None
) -> None:
    """Follow a router's admin surface and redraw the view (or print it once), presenting
    the admin ``key`` when one is given."""
    base = admin_url.rstrip("/")
    fleet = await _fleet(base, key)
    view = TopView(fleet)
    ws_url = "ws" + base[len("http"):] + "/events"
    tty = out.isatty()
    try:
        await _follow(base, view, once_after_s=once_after_s, out=out, tty=tty, key=key)
    except BaseException as exc:
        found = leaves(exc)
        if not all(isinstance(e, _LOST) for e in found):
            raise
        raise CommandError(f"lost the router's event stream at {ws_url} ({found[0]!r}): has the router stopped?") from exc
    if once_after_s is not None:
        if view.tenancy is not None:
            view.update_fleet(await _fleet(base))
        out.write(view.render())
        out.flush()


async def _fleet(base: str, key: str | None = None) -> dict[str, Any]:
    """``GET /fleet`` of the admin surface at ``base``; a CommandError naming it when that fails."""
    hint = "is narwhal serve running, and is this its admin port (server.admin_port)?"
    try:
        async with httpx.AsyncClient(timeout=10, headers=bearer(key)) as client:
            resp = await client.get(f"{base}/fleet")
    except httpx.TransportError as exc:
        raise CommandError(f"no router admin surface answers at {base} ({exc or type(exc).__name__}): {hint}") from exc
    if resp.status_code == 401:
        given = "refused the admin key given" if key is not None else "asks for an admin key"
        raise CommandError(
            f"{base}/fleet answered HTTP 401: the router {given} (server.admin_api_keys): "
            f"pass --admin-key or set {ADMIN_KEY_ENV}"
        )
    try:
        fleet = resp.json() if resp.status_code == 200 else None
    except ValueError:
        fleet = None
    if not isinstance(fleet, dict) or not isinstance(fleet.get("engines"), list):
        raise CommandError(f"{base}/fleet answered HTTP {resp.status_code} without a fleet view: {hint}")
    return fleet


async def _follow(
    admin_url: str, view: TopView, *, once_after_s: float | None, out: TextIO, tty: bool, key: str | None = None
) -> None:
    async with open_events(admin_url, key) as ws:
        with trio.move_on_after(math.inf if once_after_s is None else once_after_s):
            last = 0.0
            while True:
                with trio.move_on_after(1.0):
                    view.apply(json.loads(await ws.get_message()))
                now = trio.current_time()
                if once_after_s is None and now - last >= 1.0:
                    last = now
                    if view.tenancy is not None:  # the queues now (the last known, if /fleet fails)
                        with contextlib.suppress(CommandError):
                            view.update_fleet(await _fleet(admin_url))
                    out.write(("\x1b[H\x1b[2J" if tty else "") + view.render())
                    out.flush()
