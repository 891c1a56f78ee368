"""Reactive control: correct the profiles from what the journal observes, and move
engines that permit both roles between prefill and decode when the gain is clear.

- **Corrections.** Every journaled success that was priced carries the placement's
  predictions; the controller keeps, per engine, an exponentially weighted ratio of
  observed to predicted router TTFT (producers) and TPOT (consumers) and hands it to
  the placement, which multiplies its prices by it. The ratios are also the model-drift
  figures of ``/metrics``.
- **Role movement.** Every ``controller.reactive.interval_s`` it estimates the recent
  demand (arrival rate, mean prompt and output lengths) and predicts, for the current
  assignment and for each single move of a dual-role engine, the fleet's *pressure*:
  the worse of predicted TTFT / target and predicted TPOT / target. Prefill is modelled
  as one queue served by the active producers together (M/D/1 waiting time on the
  pooled service rate); decode by Little's law solved as a fixed point (active streams
  = rate x output length x TPOT, resident KV = active x (prompt + output / 2)), spread
  over the active consumers. A move is made only when it lowers the pressure by more
  than ``controller.reactive.movement_margin`` (relative), at most one per interval, so
  noise does not make engines flap. Each decision, moved or not, is recorded with its
  evidence (published on the live events and appended to ``<journal>.controller.jsonl``).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from narwhal.config import EngineConfig, FleetConfig
from narwhal.router.pricing import PricedPlacement

__all__ = ["ReactiveController"]

log = logging.getLogger("narwhal.router.controller")

_ALPHA = 0.2  # EWMA weight of a new observation
_CLAMP = (0.25, 8.0)  # corrections stay within sane bounds
#: Iterations of decode's fixed point. A fleet that keeps up converges in a few (to 1e-9 s);
#: an overloaded one has no fixed point, and the prediction after this many grows with
#: how far over it is (a ranking of overloaded assignments, not a latency).
_FIXED_POINT_STEPS = 50


class ReactiveController:
    def __init__(
        self,
        config: FleetConfig,
        placement: PricedPlacement,
        *,
        publish: Callable[[dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        window_s: float | None = None,
        journal_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """``journal_path``: the journal the router writes (its decisions go beside it, in
        ``<journal>.controller.jsonl``); None: no decisions file."""
        self.placement = placement
        self.publish = publish
        self.clock = clock
        rc = config.controller.reactive
        self.margin = rc.movement_margin
        self.interval_s = rc.interval_s
        #: The demand window: as given, else three intervals (a reload's interval too).
        self._window_given = window_s
        self.window_s = window_s if window_s is not None else 3 * rc.interval_s
        self.slo = config.controller.slo
        #: The engines in placement (the fleet's, as reloads and discovery change it).
        self._members: list[EngineConfig] = list(config.engines)
        self.dual = [e.name for e in config.engines if e.can_prefill and e.can_decode]
        # Dual-role engines start in their first listed role.
        self.role: dict[str, str] = {e.name: e.roles[0] for e in config.engines if e.name in self.dual}
        self._apply_roles()
        self._arrivals: collections.deque[tuple[float, int, int]] = collections.deque()
        self.decisions: list[dict[str, Any]] = []
        self.decisions_path = Path(journal_path).with_suffix(".controller.jsonl") if journal_path else None

    # ------------------------------------------------------------ observations

    def on_record(self, record: dict[str, Any]) -> None:
        """Journal listener: demand and prediction errors."""
        if record.get("prompt_tokens") is not None and record.get("requested_output_len") is not None:
            self._arrivals.append((self.clock(), record["prompt_tokens"], record["requested_output_len"]))
        if record.get("terminal_class") != "ok":
            return
        for attempt in record.get("attempts") or ():
            if attempt.get("outcome") != "ok":
                continue
            pt, pp = record.get("ttft_s"), attempt.get("predicted_ttft_s")
            if pt is not None and pp:
                self._correct(self.placement.ttft_correction, attempt["producer"], pt, pp)
            ot, op = record.get("tpot_s"), attempt.get("predicted_tpot_s")
            if ot is not None and op:
                self._correct(self.placement.tpot_correction, attempt["consumer"], ot, op)

    def _correct(self, table: dict[str, float], engine: str, observed: float, predicted: float) -> None:
        # ``predicted`` already includes the current correction: recover the raw model's.
        current = table.get(engine, 1.0)
        ratio = observed / (predicted / current)
        updated = (1 - _ALPHA) * current + _ALPHA * ratio
        table[engine] = min(max(updated, _CLAMP[0]), _CLAMP[1])

    # ------------------------------------------------------------ the model

    def demand(self) -> tuple[float, float, float]:
        """(arrival rate /s, mean prompt tokens, mean output tokens) over the window."""
        now = self.clock()
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        n = len(self._arrivals)
        if n == 0:
            return 0.0, 0.0, 0.0
        span = max(now - self._arrivals[0][0], self.interval_s)
        return (
            n / span,
            sum(a[1] for a in self._arrivals) / n,
            sum(a[2] for a in self._arrivals) / n,
        )

    def predict(self, prefill: list[str], decode: list[str], rate: float, prompt: float, output: float) -> dict[str, float]:
        """Predicted TTFT, TPOT and pressure of an assignment under the given demand."""
        profiles = self.placement.profiles
        services = [profiles[n].predict_ttft(prompt) * self.placement.ttft_correction.get(n, 1.0) for n in prefill if n in profiles]
        if not services:
            ttft = math.inf
        else:
            capacity = sum(1.0 / s for s in services if s > 0) or math.inf
            service = len(services) / capacity  # mean service time of the pooled producers
            rho = rate / capacity
            ttft = math.inf if rho >= 1 else service * (1 + rho / (2 * (1 - rho)))
        consumers = [n for n in decode if n in profiles and profiles[n].decode is not None]
        if not consumers:
            tpot = math.inf
        else:
            tpot = min(profiles[n].decode_model.c0 for n in consumers)
            for _ in range(_FIXED_POINT_STEPS):  # Little's law as a fixed point
                active = rate * output * tpot / len(consumers)
                kv = active * (prompt + output / 2)
                new = sum(
                    profiles[n].predict_tpot(active, kv) * self.placement.tpot_correction.get(n, 1.0) for n in consumers
                ) / len(consumers)
                if abs(new - tpot) < 1e-9:  # pragma: no mutate (equivalent: converged; iterating on, or stopping at exactly 1e-9, moves it by less; its other mutants were killed)
                    break
                tpot = new
        slo_ttft = self.slo.ttft_s or 1.0
        slo_tpot = self.slo.tpot_s or 1.0
        return {"ttft_s": ttft, "tpot_s": tpot, "pressure": max(ttft / slo_ttft, tpot / slo_tpot)}

    def reconfigure(self, config: FleetConfig) -> None:
        """A reloaded fleet document: its SLO, margin and interval (and the demand window
        of three intervals, unless one was given) from now on."""
        rc = config.controller.reactive
        self.margin = rc.movement_margin
        self.interval_s = rc.interval_s
        self.window_s = self._window_given if self._window_given is not None else 3 * rc.interval_s
        self.slo = config.controller.slo

    def assign(self, members: list[EngineConfig]) -> tuple[list[str], list[str]]:
        """The placement roles of ``members`` (the fleet changed): a dual-role engine keeps
        the role it had, a new one starts in its first listed role."""
        self._members = list(members)
        self.dual = [e.name for e in members if e.can_prefill and e.can_decode]
        self.role = {e.name: self.role.get(e.name, e.roles[0]) for e in members if e.name in self.dual}
        return self._assignment(self.role)

    def _assignment(self, role: dict[str, str]) -> tuple[list[str], list[str]]:
        prefill: list[str] = []
        decode: list[str] = []
        for e in self._members:
            if e.name in role:
                (prefill if role[e.name] == "prefill" else decode).append(e.name)
            else:
                if e.can_prefill:
                    prefill.append(e.name)
                if e.can_decode:
                    decode.append(e.name)
        return prefill, decode

    def _apply_roles(self) -> None:
        prefill, decode = self._assignment(self.role)
        self.placement.set_roles(prefill, decode)

    # ------------------------------------------------------------ deciding

    def step(self) -> dict[str, Any] | None:
        """One control decision (None when there is no demand to judge by)."""
        rate, prompt, output = self.demand()
        if rate == 0 or not self.dual or len(self.placement.model_names()) > 1:
            # Several models (learned from engines that declare none: a document that
            # declares several is refused) have a demand each, which this model pools.
            return None
        current = self.predict(*self._assignment(self.role), rate, prompt, output)
        best: tuple[str, str, dict[str, float]] | None = None
        for name in self.dual:
            other = "decode" if self.role[name] == "prefill" else "prefill"
            alt = self.predict(*self._assignment({**self.role, name: other}), rate, prompt, output)
            if best is None or alt["pressure"] < best[2]["pressure"]:
                best = (name, other, alt)
        assert best is not None
        name, target, alt = best
        if math.isinf(current["pressure"]):
            gain = 0.0 if math.isinf(alt["pressure"]) else 1.0
        else:
            gain = (current["pressure"] - alt["pressure"]) / current["pressure"]
        moved = gain > self.margin
        decision = {
            "type": "controller",
            "at": self.clock(),
            "engine": name,
            "from": self.role[name],
            "to": target,
            "moved": moved,
            "gain": gain,
            "margin": self.margin,
            "evidence": {
                "rate_per_s": rate,
                "mean_prompt_tokens": prompt,
                "mean_output_tokens": output,
                "current": _finite(current),
                "proposed": _finite(alt),
                "ttft_correction": dict(self.placement.ttft_correction),
                "tpot_correction": dict(self.placement.tpot_correction),
            },
        }
        if moved:
            self.role[name] = target
            self._apply_roles()
            log.info("moved %s to %s (predicted gain %.1f%% > margin %.1f%%)", name, target, gain * 100, self.margin * 100)
        self.decisions.append(decision)
        del self.decisions[:-1000]
        if self.publish is not None:
            self.publish(decision)
        return decision

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Decide every ``interval_s`` until cancelled; decisions are appended to a file."""
        task_status.started()
        while True:
            await trio.sleep(self.interval_s)
            decision = self.step()
            if decision is not None and self.decisions_path is not None:
                line = json.dumps(decision) + "\n"
                await trio.to_thread.run_sync(_append, self.decisions_path, line)


def _finite(values: dict[str, float]) -> dict[str, float | None]:
    return {k: (v if math.isfinite(v) else None) for k, v in values.items()}


def _append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:  # (a JSON line is ASCII: any encoding writes it alike)
        fh.write(line.encode())
