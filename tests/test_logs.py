"""One INFO line per request with its terminal class; JSON lines; never the prompt."""

from __future__ import annotations

import json
import logging

import pytest
import trio

from narwhal.logs import JSONFormatter

from .routerkit import open_stack


async def test_one_line_per_request_never_the_prompt(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.router")
    secret = "zebra-secret-prompt-word"
    async with open_stack() as stack:
        await stack.complete({"prompt": f"a {secret} c", "max_tokens": 2})
        await stack.complete({"prompt": f"a {secret}", "max_tokens": "x"})
    lines = [r for r in caplog.records if r.name == "narwhal.router" and r.getMessage().startswith("request ")]
    assert [r.terminal_class for r in lines] == ["ok", "invalid_request"]  # type: ignore[attr-defined]
    formatted = [JSONFormatter().format(r) for r in caplog.records]
    assert all(secret not in line for line in formatted)
    assert all(secret not in r.getMessage() for r in caplog.records)
    doc = json.loads(JSONFormatter().format(lines[0]))
    assert doc["terminal_class"] == "ok" and doc["level"] == "info" and doc["output_len"] == 2
    assert all(secret not in json.dumps(r) for r in stack.records)
