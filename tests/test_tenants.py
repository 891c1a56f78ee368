"""Tenants and classes in the fleet document; who a request is; keys never shown."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import parse_fleet, unstructure_fleet
from narwhal.errors import ConfigError, Forbidden, Unauthorized
from narwhal.logs import JSONFormatter
from narwhal.router.keys import BearerKeys
from narwhal.router.tenants import Tenancy

from .routerkit import fleet_doc, open_stack

CLASSES = [{"name": "chat", "priority": 0, "slo": {"ttft_s": 0.5, "tpot_s": 0.05}},
           {"name": "batch", "priority": 10, "wait": True, "slo": {"ttft_s": 10.0}}]  # fmt: skip
TENANTS = [{"name": "web", "latency_class": "chat"},
           {"name": "etl", "latency_class": "batch", "classes": ["chat"], "weight": 2.0,
            "limits": {"max_in_flight": 4, "requests_per_s": 10.0, "tokens_per_s": 5000.0}}]  # fmt: skip
SECRET_KEYS = {"web": "sk-web-TOPSECRET-1111", "etl": "sk-etl-TOPSECRET-2222"}


def doc(**tenancy: Any) -> dict[str, Any]:
    return fleet_doc(
        server={"api_keys": [{"key": k, "name": n} for n, k in SECRET_KEYS.items()]},
        tenancy={"classes": copy.deepcopy(CLASSES), "tenants": copy.deepcopy(TENANTS), **tenancy},
    )


# ------------------------------------------------------------------ the document


def test_a_document_with_tenants_round_trips_and_keeps_plain_keys() -> None:
    d = doc()
    d["server"]["api_keys"].append("sk-unnamed")
    config = parse_fleet(d)
    assert config.tenancy is not None and [t.name for t in config.tenancy.tenants] == ["web", "etl"]
    assert unstructure_fleet(config)["server"]["api_keys"][2] == "sk-unnamed"
    assert parse_fleet(unstructure_fleet(config)) == config
    # A key's repr (in a traceback, a debugger) never shows the key.
    assert "TOPSECRET" not in repr(config)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda d: d["tenancy"]["classes"].append({"name": "chat"}), "duplicate class name 'chat' @ $.tenancy.classes[2].name"),
        (lambda d: d["tenancy"]["tenants"][0].update(latency_class="gold"),
         "no class 'gold' (classes: 'chat', 'batch') @ $.tenancy.tenants[0].latency_class"),
        (lambda d: d["tenancy"]["tenants"][1].update(classes=["chat", "x"]),
         "no class 'x' (classes: 'chat', 'batch') @ $.tenancy.tenants[1].classes[1]"),
        (lambda d: d["tenancy"]["tenants"].append({"name": "web", "latency_class": "chat"}),
         "duplicate tenant name 'web' @ $.tenancy.tenants[2].name"),
        (lambda d: d["tenancy"].update(default_tenant="nobody"), "no tenant 'nobody' @ $.tenancy.default_tenant"),
        (lambda d: d["server"]["api_keys"].append({"key": "k", "name": "nobody"}),
         "no tenant 'nobody' in tenancy.tenants @ $.server.api_keys[2].name"),
        (lambda d: d.pop("tenancy"), "a key names a tenant, but the document has no tenancy section @ $.server.api_keys[0].name"),
        (lambda d: d["server"].update(api_keys=["plain"]),
         "no request can name a tenant: give a key a tenant's name (server.api_keys), a gateway header "
         "(tenancy.header) or a default_tenant @ $.tenancy.default_tenant"),
        (lambda d: d["tenancy"]["tenants"][1]["limits"].update(requests_per_s=0),
         "expected a number > 0 @ $.tenancy.tenants[1].limits.requests_per_s"),
        (lambda d: d["tenancy"]["classes"][1].update(max_wait_s=-1), "expected a number > 0 @ $.tenancy.classes[1].max_wait_s"),
        (lambda d: d["tenancy"].update(header="x tenant"), "expected an HTTP header name @ $.tenancy.header"),
        (lambda d: d["tenancy"].update(store={"url": "redis://:pw@host:6379"}),
         "expected a redis://host:port/db URL (no password in it: use password_env) @ $.tenancy.store.url"),
        (lambda d: d["tenancy"].update(store={"url": "redis://h:1", "on_outage": "open"}),
         "expected one of 'local', 'refuse' @ $.tenancy.store.on_outage"),
        (lambda d: d["tenancy"].update(classes=[]), "expected at least one class @ $.tenancy.classes"),
        (lambda d: d["server"].update(api_keys=[{"key": "k", "nam": "web"}]),
         "unknown key 'nam' (did you mean 'name'?) @ $.server.api_keys[0]"),
    ],
)
def test_a_bad_tenancy_names_its_path(change: Any, expected: str) -> None:
    d = doc()
    change(d)
    with pytest.raises(ConfigError) as info:
        parse_fleet(d)
    assert str(info.value) == expected


# ------------------------------------------------------------------ who a request is


def headers(**values: str) -> Any:
    lowered = {k.replace("_", "-").lower(): v for k, v in values.items()}
    return lambda name: lowered.get(name)


def test_the_key_names_the_tenant_and_the_tenant_its_class() -> None:
    tenancy = Tenancy(parse_fleet(doc()))
    tenant, klass = tenancy.identify(headers(), "etl")
    assert tenant is not None and (tenant.name, klass.name, klass.wait, klass.max_wait_s) == ("etl", "batch", True, 10.0)
    # batch leaves room for chat, the class above it: half of chat's TTFT target, its TPOT.
    assert klass.room is not None and (klass.room.ttft_s, klass.room.tpot_s, klass.room.hold) == (0.5, 0.05, True)
    _, chat = tenancy.identify(headers(x_narwhal_class="chat"), "etl")  # etl may ask for chat
    assert chat.name == "chat" and chat.room is None
    _, batch = tenancy.identify(headers(x_narwhal_class="batch"), "web")  # a less urgent class: always
    assert batch.name == "batch"
    with pytest.raises(Forbidden) as info:
        tenancy.identify(headers(), None)  # an unnamed key, and no default tenant
    assert info.value.to_body()["error"] == {
        "message": "this request names no tenant (a key with a tenant's name, or the gateway's header)",
        "type": "permission_error", "code": "unknown_tenant",
    }  # fmt: skip


def test_a_tenant_may_not_ask_for_a_more_urgent_class_it_is_not_given() -> None:
    tenants = copy.deepcopy(TENANTS)
    tenants[1]["classes"] = []
    d = doc()
    d["tenancy"]["tenants"] = tenants
    tenancy = Tenancy(parse_fleet(d))
    with pytest.raises(Forbidden) as info:
        tenancy.identify(headers(x_narwhal_class="chat"), "etl")
    assert info.value.to_body()["error"] == {"message": "class 'chat' is not one tenant etl may ask for",
                                             "type": "permission_error", "code": "class_not_allowed"}  # fmt: skip


def test_a_class_without_targets_takes_the_fleets_and_waits_until_its_ttft() -> None:
    d = doc()
    d["controller"] = {"slo": {"ttft_s": 2.0, "tpot_s": 0.1}}
    d["tenancy"]["classes"] = [{"name": "fleet", "wait": True}, {"name": "same", "priority": 0},
                               {"name": "lax", "priority": 5, "slo": {"tpot_s": 0.2}}]  # fmt: skip
    d["tenancy"]["tenants"] = [{"name": "web", "latency_class": "fleet"}, {"name": "etl", "latency_class": "lax"}]
    tenancy = Tenancy(parse_fleet(d))
    fleet, lax = tenancy.classes["fleet"], tenancy.classes["lax"]
    assert (fleet.slo, fleet.ttft_s, fleet.max_wait_s) == (parse_fleet(d).controller.slo, 2.0, 2.0)
    # No TTFT target: it may wait until the request's own deadline; it leaves the classes
    # above (the fleet's targets) their room.
    assert lax.ttft_s is None and lax.max_wait_s == 600.0
    assert lax.room is not None and (lax.room.ttft_s, lax.room.tpot_s, lax.room.hold) == (2.0, 0.1, False)
    # A class of the same priority is no more urgent than one's own: any tenant may ask for it.
    _, same = tenancy.identify(headers(x_narwhal_class="same"), "web")
    assert same.name == "same"


def test_an_unnamed_key_is_no_tenant_of_its_own() -> None:
    config = parse_fleet(fleet_doc(server={"api_keys": ["sk-plain"]}))
    assert BearerKeys(config.server.api_keys).match("Bearer sk-plain") is None
    with pytest.raises(Unauthorized) as info:
        BearerKeys(config.server.api_keys).match("Bearer sk-other")
    assert info.value.to_body()["error"] == {"message": "missing or invalid API key", "type": "authentication_error",
                                             "code": "invalid_api_key"}  # fmt: skip


def test_a_trusted_gateway_header_names_the_tenant() -> None:
    tenancy = Tenancy(parse_fleet(doc(header="X-Tenant", default_tenant="web")))
    tenant, _ = tenancy.identify(headers(x_tenant="etl"), None)
    assert tenant is not None and tenant.name == "etl"
    tenant, _ = tenancy.identify(headers(), "etl")  # the header, not the key, says who
    assert tenant is not None and tenant.name == "web"
    with pytest.raises(Forbidden) as info:
        tenancy.identify(headers(x_tenant="mallory"), None)
    assert info.value.to_body()["error"] == {"message": "the x-tenant header names no tenant of this router",
                                             "type": "permission_error", "code": "unknown_tenant"}  # fmt: skip


def test_without_tenancy_every_request_is_the_one_class() -> None:
    tenancy = Tenancy(parse_fleet(fleet_doc(controller={"slo": {"ttft_s": 0.7}})))
    tenant, klass = tenancy.identify(headers(x_narwhal_class="chat"), None)
    assert tenant is None and klass.name is None and klass.ttft_s == 0.7 and klass.slo is None


def test_the_keys_compare_digests_and_gives_back_only_the_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import narwhal.router.keys as module

    compared: list[tuple[bytes, bytes]] = []
    real = module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(module.hmac, "compare_digest", spy)
    config = parse_fleet(doc())
    ring = BearerKeys(config.server.api_keys)
    assert ring.match(f"Bearer {SECRET_KEYS['etl']}") == "etl"
    # Every key compared, as digests of one length: neither which key matched nor how
    # long the keys are shows in the time taken.
    assert [b for _, b in compared] == [hashlib.sha256(k.encode()).digest() for k in SECRET_KEYS.values()]
    assert {len(a) for a, _ in compared} == {32}
    for wrong in (None, "Bearer nope", f"Basic {SECRET_KEYS['web']}", SECRET_KEYS["web"]):
        with pytest.raises(Unauthorized):
            ring.match(wrong)


# ------------------------------------------------------------------ keys never shown


async def test_a_reload_that_would_change_the_keys_does_not_quote_them(autojump_clock: trio.abc.Clock,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    old = fleet_doc(server={"api_keys": ["sk-old-TOPSECRET"]})
    new = fleet_doc(server={"api_keys": ["sk-new-TOPSECRET"]})
    async with open_stack(old, journal_path=tmp_path / "journal.jsonl") as stack:
        stack.net.listen("admin.test", 8001, stack.router.admin)
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            answer = await admin.put("/fleet", content=json.dumps(new))
    assert answer.status_code == 400
    assert answer.json()["error"]["path"] == "$.server.api_keys"
    assert answer.json()["error"]["message"] == (
        "changes only with a restart (running with ['<redacted>'], the document says ['<redacted>'])"
    )
    assert "TOPSECRET" not in (tmp_path / "journal.fleet.jsonl").read_text()


async def test_keys_are_never_shown(autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture,
                                    tmp_path: Path) -> None:  # fmt: skip
    caplog.set_level(logging.DEBUG)
    d = doc()
    ops = "sk-ops-TOPSECRET-3333"
    d["server"]["api_keys"].append({"key": ops, "name": "ops"})
    d["tenancy"]["tenants"].append({"name": "ops", "latency_class": "chat", "limits": {"requests_per_s": 1.0}})
    d["tenancy"]["classes"][1]["max_wait_s"] = 0.05
    shown: list[str] = []
    async with open_stack(d, priced=True, journal_path=tmp_path / "journal.jsonl") as stack:
        stack.net.listen("admin.test", 8001, stack.router.admin)
        events: list[str] = []
        async with httpx.AsyncClient(transport=stack.net.transport(), base_url="http://admin.test:8001") as admin:
            async with trio.open_nursery() as nursery:

                async def follow() -> None:
                    with stack.router.events.subscribe() as sub:
                        async for event in sub.receive:
                            events.append(json.dumps(event))

                nursery.start_soon(follow)
                await trio.lowlevel.checkpoint()
                body = {"prompt": " ".join(["w"] * 2000), "max_tokens": 4}
                for key, extra in [
                    (SECRET_KEYS["web"], {}), (ops, {}), (ops, {}),  # ok, ok, then 429
                    (SECRET_KEYS["web"] + "x", {}),  # 401
                    (SECRET_KEYS["web"], {"x-narwhal-class": "nope"}),  # 403
                ]:
                    out = await stack.complete(body, headers={"authorization": f"Bearer {key}", **extra})
                    shown.append(f"{out.status_code} {dict(out.headers)} {out.text}")
                await trio.sleep(1.0)
                # Two of etl's at once: the second waits past its class's 50 ms (503).
                async def etl() -> None:
                    out = await stack.complete(body, headers={"authorization": f"Bearer {SECRET_KEYS['etl']}"})
                    shown.append(f"{out.status_code} {dict(out.headers)} {out.text}")

                async with trio.open_nursery() as two:
                    two.start_soon(etl)
                    two.start_soon(etl)
                changed = copy.deepcopy(d)
                changed["server"]["api_keys"][0]["key"] = "sk-web-TOPSECRET-9999"
                shown.append((await admin.put("/fleet", content=json.dumps(changed))).text)
                changed = copy.deepcopy(d)
                changed["tenancy"]["tenants"][0]["weight"] = 3.0
                shown.append((await admin.put("/fleet", content=json.dumps(changed))).text)
                for route in ("/fleet", "/metrics", "/health"):
                    shown.append((await admin.get(route)).text)
                nursery.cancel_scope.cancel()
        statuses = sorted(r["status"] for r in stack.records)
    assert statuses == [200, 200, 200, 403, 429, 503]  # (the 401 is answered before any record)
    shown += events
    shown += [json.dumps(r) for r in stack.records]
    shown += [(tmp_path / name).read_text() for name in ("journal.fleet.jsonl",) if (tmp_path / name).exists()]
    shown += [JSONFormatter().format(r) for r in caplog.records] + [r.getMessage() for r in caplog.records]
    text = "\n".join(shown)
    assert "TOPSECRET" not in text
    # ... and yet the tenants are named where they are measured.
    assert '"tenant": "etl"' in text and 'tenant="etl"' in text


def test_each_worker_of_workers_takes_its_share(tmp_path: Path) -> None:
    from narwhal import cli

    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(doc(replicas=3)))
    args = cli._parser().parse_args(["serve", "--fleet", str(fleet), "--workers", "4", "--worker-of", "4"])
    config = cli._as_worker(args, cli._serve_config(args))
    # Three replicas of four workers each: every worker enforces a twelfth of each limit.
    assert config.tenancy is not None and config.tenancy.replicas == 12
