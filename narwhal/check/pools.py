"""Model pools: every model the fleet serves has a producer and a consumer that answer.

An engine's model is the one its ``model`` declares, else the one it reports (its
identity: the first model of its ``GET /v1/models``). For each model, in the order the
fleet first names it, one ``pool`` result says which reachable engines may prefill and
which may decode it; a model with no reachable producer or no reachable consumer fails,
naming the model and its engines. A declared engine that does not list its declared
model fails ``model.declared``: the router would send it requests it answers with 404.
"""

from __future__ import annotations

from collections.abc import Mapping

from narwhal.check.results import CheckResult
from narwhal.config import FleetConfig
from narwhal.engines.client import EngineIdentity

__all__ = ["check_pools", "engine_models"]


def engine_models(
    config: FleetConfig, identities: Mapping[str, EngineIdentity | None]
) -> dict[str, str | None]:
    """Each engine's model: declared, else reported; None when neither is known."""
    out: dict[str, str | None] = {}
    for e in config.engines:
        ident = identities.get(e.name)
        out[e.name] = e.model if e.model is not None else (ident.model if ident is not None else None)
    return out


def check_pools(
    config: FleetConfig, identities: Mapping[str, EngineIdentity | None]
) -> list[CheckResult]:
    """One ``model.declared`` result per reachable engine that declares a model, then one
    ``pool`` result per model."""
    results: list[CheckResult] = []
    for e in config.engines:
        ident = identities.get(e.name)
        if e.model is None or ident is None:
            continue
        # The identity names the declared model whenever the engine lists it.
        ok = ident.model == e.model
        results.append(
            CheckResult(
                name="model.declared",
                engine=e.name,
                ok=ok,
                measured=ident.model,
                limit=e.model,
                message=f"engine {e.name} serves its declared model {e.model!r}"
                if ok
                else f"engine {e.name} is declared to serve {e.model!r} but does not list it "
                f"(it serves {ident.model!r}); requests for {e.model!r} placed there would fail",
            )
        )
    models = engine_models(config, identities)
    for model in dict.fromkeys(m for m in models.values() if m is not None):
        pool = [e for e in config.engines if models[e.name] == model]
        live = [e for e in pool if identities.get(e.name) is not None]
        producers = [e.name for e in live if e.can_prefill]
        consumers = [e.name for e in live if e.can_decode]
        down = [e.name for e in pool if identities.get(e.name) is None]
        missing = [role for role, names in (("prefill", producers), ("decode", consumers)) if not names]
        counts = {"producers": len(producers), "consumers": len(consumers)}
        if missing:
            message = (
                f"model {model!r} has no reachable engine with the {' or '.join(missing)} role "
                f"(its engines: {', '.join(e.name for e in pool)}"
                + (f"; unreachable: {', '.join(down)}" if down else "")
                + ")"
            )
        else:
            message = f"model {model!r}: producers {', '.join(producers)}; consumers {', '.join(consumers)}"
        results.append(
            CheckResult(
                name="pool",
                engine=None,
                ok=not missing,
                measured=counts,
                limit={"producers": 1, "consumers": 1},
                message=message,
                detail={"model": model, "producers": producers, "consumers": consumers, "unreachable": down},
            )
        )
    return results
