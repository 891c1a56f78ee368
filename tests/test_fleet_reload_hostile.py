"""A reload from an operator's mistake or a hostile admin client: no secret in any
message, and all of a change or none of it.

- A refused document says why without the values of a secret: not in its 400, not in
  the log, not in ``<journal>.fleet.jsonl``, not on ``/events``.
- An engine key that cannot go in a request header is refused before anything applies;
  anything that fails while a change is being made ready leaves the router as it was
  (``/fleet`` and ``/health`` answer, no phantom engine).
- A body nested deeper than any fleet document, or ``null``, is a 400 with a
  ``rejected`` record (never a 500, never a re-read of the file).
- A profiles file (or a fleet document) that is a device, a FIFO or larger than the
  limit is refused before it is read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import (
    MAX_DOCUMENT_BYTES,
    FleetConfig,
    is_secret,
    load_fleet,
    parse_fleet,
    redacted,
)
from narwhal.errors import ConfigError
from narwhal.profile.store import Profiles, load_profiles
from narwhal.router.fleetdiff import changed_settings
from narwhal.router.state import RouterState

from .routerkit import ROUTER_HOST, ROUTER_PORT
from .test_fleet_reload import ADMIN, Live, doc, open_live

SECRET = "sk-live-0123456789"
OTHER = "sk-other-9876543210"


def _server(**over: Any) -> dict[str, Any]:
    return {"host": ROUTER_HOST, "port": ROUTER_PORT, **over}


def _admin(live: Live) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=live.net.transport(), base_url=f"http://{ADMIN[0]}:{ADMIN[1]}")


# ----------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    ("path", "secret"),
    [
        ("server.api_keys", True), ("$.engines[3].api_key", True), ("engine_groups[0].api_key", True),
        ("server.admin_api_keys", True), ("server.admin_keys", True), ("x.bearer_token", True),
        ("x.client_secret", True), ("x.password", True), ("$.x.key", True),
        ("server.admin_host", False), ("kv_events.topic", False), ("engine_groups[0].max_engines", False),
        ("connector.kv_port", False), ("journal.path", False), ("$.engines[3]", False), ("monkeys", False),
    ],
)  # fmt: skip
def test_a_secret_is_known_by_the_name_of_its_field(path: str, secret: bool) -> None:
    assert is_secret(path) is secret


def test_a_secret_is_redacted_wherever_it_sits_and_its_absence_shows() -> None:
    assert redacted("server.api_keys", [SECRET, OTHER]) == ["<redacted>", "<redacted>"]
    assert redacted("server.api_keys", []) == [] and redacted("engines[0].api_key", None) is None
    assert redacted("server", {"port": 1, "api_keys": [SECRET], "admin": {"token": SECRET}}) == {
        "port": 1, "api_keys": ["<redacted>"], "admin": {"token": "<redacted>"},
    }  # fmt: skip
    assert redacted("engines", [{"name": "d0", "api_key": SECRET}]) == [{"name": "d0", "api_key": "<redacted>"}]
    assert redacted("server.port", 8000) == 8000


def test_a_settings_diff_shows_no_secret() -> None:
    old = parse_fleet(doc("p0", "d0", server=_server(api_keys=[SECRET])))
    new = parse_fleet(doc("p0", "d0", server=_server(api_keys=[OTHER, "x"]), engine={"request_timeout_s": 9.0}))
    assert changed_settings(old, new) == [
        ("engine.request_timeout_s", 600.0, 9.0), ("server.api_keys", ["<redacted>"], ["<redacted>", "<redacted>"]),
    ]  # fmt: skip


async def test_a_refused_reload_shows_no_secret_anywhere(
    autojump_clock: trio.abc.Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    journal = tmp_path / "journal.jsonl"
    async with open_live(doc("p0", "d0", server=_server(api_keys=[SECRET])), journal_path=journal) as live:
        changed = doc("p0", "d0", server=_server(api_keys=[OTHER]))
        async with _admin(live) as admin:
            answer = await admin.put("/fleet", content=json.dumps(changed).encode())
        with pytest.raises(ConfigError) as err:
            await live.router.reload(changed, source="SIGHUP")
        assert [k.key for k in live.router.state.config.server.api_keys] == [SECRET]  # nothing changed
    assert answer.status_code == 400
    assert answer.json()["error"] == {
        "message": "changes only with a restart (running with ['<redacted>'], the document says ['<redacted>'])",
        "path": "$.server.api_keys", "type": "invalid_fleet",
    }  # fmt: skip
    assert err.value.reason == answer.json()["error"]["message"]
    records = (tmp_path / "journal.fleet.jsonl").read_text()
    rejected = [e for e in live.events if e.get("event") == "rejected"]
    assert len(rejected) == 2 and len(records.splitlines()) == 2
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "fleet reload (PUT /fleet) refused" in logged
    for channel in (answer.text, logged, records, json.dumps(live.events), json.dumps(live.router.fleet.changes)):
        assert SECRET not in channel and OTHER not in channel


# ----------------------------------------------------------------- all or nothing


@pytest.mark.parametrize("key", ["密钥", "clé", "sk x", "sk\r\nx-injected: 1", "sk\x00"])
async def test_an_engine_key_that_cannot_be_a_header_is_refused_before_anything_applies(
    autojump_clock: trio.abc.Clock, key: str
) -> None:
    async with open_live(doc("p0", "d0")) as live:
        state = live.router.state
        config = state.config
        bad = doc("p0", "d0", "d1", engine={"request_timeout_s": 9.0})
        bad["engines"][2]["api_key"] = key
        async with _admin(live) as admin:
            answer = await admin.put("/fleet", content=json.dumps(bad).encode())
            fleet, health = await admin.get("/fleet"), await admin.get("/health")
        assert answer.status_code == 400 and answer.json()["error"]["path"] == "$.engines[2].api_key"
        assert key not in answer.text and key not in json.dumps(live.events)
        assert (fleet.status_code, health.status_code) == (200, 200)
        assert state.config is config and sorted(state.engines) == ["d0", "p0"] and not state.phase
        assert (await live.request("r0", 2)).ok


async def test_a_failure_while_a_change_is_made_ready_changes_nothing(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What can fail is done before anything changes: here, making the client of one
    of the engines a document adds fails (the settings stay, no engine is half known)."""
    async with open_live(doc("p0", "d0", "d1")) as live:
        state = live.router.state
        config, engines = state.config, dict(state.engines)
        make = RouterState._client

        def failing(self: RouterState, e: Any) -> Any:
            if e.url.startswith("http://d2."):
                raise RuntimeError("no client for you")
            return make(self, e)

        monkeypatch.setattr(RouterState, "_client", failing)
        with pytest.raises(RuntimeError, match="no client for you"):
            await live.router.reload(doc("p0", "p1", "d1", "d2", engine={"request_timeout_s": 9.0}), source="test")
        assert state.config is config and state.engines == engines and not state.phase
        assert sorted(state.clients) == sorted(state.breaker.states) == sorted(state.placement.loads) == sorted(engines)
        assert json.dumps(state.health(detail=True)) and live.router.admin.handler.fleet()  # type: ignore[attr-defined]
        assert not live.fleet_events("starting") and not live.fleet_events("draining")
        monkeypatch.setattr(RouterState, "_client", make)
        change = await live.router.reload(doc("p0", "p1", "d1", "d2"), source="test")
        assert change.added == ("p1", "d2") and change.removed == ("d0",)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "the document nests too deeply to be a fleet document"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "the document nests too deeply to be a fleet document"),
        (b"null", "expected a fleet document (a JSON object), not null"),
        (b"[]", "expected a fleet document (a JSON object), not a list"),
        (b'"fleet.json"', "expected a fleet document (a JSON object), not a string"),
    ],
    ids=["lists", "objects", "null", "list", "string"],
)
async def test_a_body_that_is_no_document_is_a_400_with_a_record(
    autojump_clock: trio.abc.Clock, body: bytes, message: str
) -> None:
    asked: list[Any] = []

    def prepare(document: Any) -> tuple[FleetConfig, Profiles | None]:
        asked.append(document)  # None would re-read the file the router was started from
        return parse_fleet(doc("p0", "d0", "d1")), None

    async with open_live(doc("p0", "d0"), prepare=prepare) as live:
        async with _admin(live) as admin:
            answer = await admin.put("/fleet", content=body)
        assert answer.status_code == 400
        assert answer.json()["error"] == {"message": message, "path": "$", "type": "invalid_fleet"}
        assert [(e["source"], e["error"]) for e in live.fleet_events("rejected")] == [("PUT /fleet", message)]
        assert asked == [] and sorted(live.router.state.engines) == ["d0", "p0"]


# ----------------------------------------------------------------- files


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


def _load_in_thread(load: Any, path: Path) -> BaseException | None:
    """Load ``path`` in a thread (a FIFO with no writer blocks an open for reading): what
    it raised, or a TimeoutError when it was still blocked after 10 s."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            load(path)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return outcome[0] if outcome else TimeoutError(f"still blocked reading {path}")


@pytest.mark.parametrize("load", [load_profiles, load_fleet], ids=["profiles", "fleet"])
def test_a_device_or_a_fifo_is_refused_unread(load: Any, tmp_path: Path) -> None:
    # (/dev/zero takes the same path as /dev/null: it is not read, whatever it would give.)
    for path in (Path("/dev/null"), _fifo(tmp_path)):
        err = _load_in_thread(load, path)
        assert isinstance(err, ConfigError), err
        assert err.reason.endswith(": not a regular file") and err.source == str(path)


@pytest.mark.parametrize("load", [load_profiles, load_fleet], ids=["profiles", "fleet"])
def test_a_file_over_the_limit_is_refused_by_its_size(load: Any, tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: nothing written but its size
        f.truncate(MAX_DOCUMENT_BYTES + 1)
    with pytest.raises(ConfigError) as err:
        load(big)
    assert err.value.reason.endswith(f"is larger than {MAX_DOCUMENT_BYTES} bytes ({MAX_DOCUMENT_BYTES + 1})")
