"""HTTP/1.1 serving (on trio) for the router and the simulated engines."""

from __future__ import annotations

from narwhal.http.server import Handler, HTTPServer, Request, ResponseWriter, ServerLimits

__all__ = ["HTTPServer", "Handler", "Request", "ResponseWriter", "ServerLimits"]
