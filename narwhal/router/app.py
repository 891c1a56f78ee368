"""The router's HTTP routes.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health`` (200 only when an engine can prefill and one can
decode), and ``GET /metrics`` when the router is asked to serve it here too. Errors use the OpenAI shape ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from narwhal.engines.connector import RequestKind
from narwhal.errors import MethodNotAllowed, NotFound
from narwhal.http.server import JSON_HEADERS, Request, ResponseWriter
from narwhal.router.keys import BearerKeys
from narwhal.router.lifecycle import RequestLifecycle
from narwhal.router.state import RouterState

__all__ = ["RouterApp"]

_AUTHORIZATION = "authorization"  # header names are matched case-insensitively
_INFERENCE: dict[str, RequestKind] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class RouterApp:
    """The request handler given to :class:`narwhal.http.server.HTTPServer`."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        #: Serve ``GET /metrics`` here too (as vLLM does on its API port): the
        #: exposition in the format an ``Accept`` asks for, and its content type (see
        #: :meth:`narwhal.router.metrics.RouterMetrics.render`), or None for the admin
        #: listener only.
        self.metrics: Callable[[str | None], tuple[bytes, str]] | None = None
        self._keys = BearerKeys(state.config.server.api_keys)
        self._created = int(time.time())

    def _authorize(self, request: Request) -> str | None:
        """The name of the key the request presents (None: unnamed, or no keys); raises
        :class:`~narwhal.errors.Unauthorized` without a configured key."""
        return self._keys.match(request.header(_AUTHORIZATION)) if self._keys else None

    async def __call__(self, request: Request, response: ResponseWriter) -> None:
        path = request.path
        kind = _INFERENCE.get(path)
        if kind is not None:
            if request.method != "POST":
                raise MethodNotAllowed(f"{request.method} is not allowed on {path}")
            key_name = self._authorize(request)
            await RequestLifecycle(self.state, request, response, kind, key_name).run()
            return
        if path == "/health":
            await self._health(response)
        elif path == "/metrics" and self.metrics is not None:
            self._authorize(request)
            body, content_type = self.metrics(request.header("accept"))
            await response.respond(200, (("content-type", content_type),), body)
        elif path == "/v1/models":
            self._authorize(request)
            await self._models(response)
        else:
            raise NotFound(f"no route for {request.method} {path}")

    async def _health(self, response: ResponseWriter) -> None:
        body = self.state.health(detail=False)  # pragma: no mutate (equivalent: detail=None is as false; detail=True is killed)
        await response.respond(200 if body["status"] == "ready" else 503, JSON_HEADERS, _json(body))

    async def _models(self, response: ResponseWriter) -> None:
        data = []
        for name, max_len in self.state.models.items():
            entry: dict[str, Any] = {"id": name, "object": "model", "created": self._created, "owned_by": "narwhal"}
            if max_len is not None:
                entry["max_model_len"] = max_len
            data.append(entry)
        await response.respond(200, JSON_HEADERS, _json({"object": "list", "data": data}))
