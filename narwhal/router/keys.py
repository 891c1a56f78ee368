"""Bearer keys: the client keys of the router port and the admin keys of the admin port.

A request presents a key as ``Authorization: Bearer <key>`` (the scheme in any case).
Every configured key is compared, each in constant time, so that the time taken says
neither which key matched nor how much of one; a client key may name its tenant. A key is never shown: not in a log
line, an error, a ``repr``.

The admin surface reads the live fleet and events and can reload the fleet: a listener
that others can reach (an address other than loopback) needs admin keys
(:func:`admin_listener_problem`). A loopback listener without keys still answers no web
page (:func:`browser_problem`): a page can make the operator's browser send requests to
127.0.0.1, and by rebinding its own name to 127.0.0.1 (DNS rebinding) read the answers.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable

from narwhal.config import ApiKeyConfig, ServerConfig
from narwhal.errors import ConfigError, Unauthorized

__all__ = ["ADMIN_KEY_ENV", "BearerKeys", "admin_listener_problem", "bearer", "browser_problem", "is_loopback"]

#: The environment variable that adds an admin key (``narwhal serve``) and presents
#: one (``narwhal top``): other users cannot read a process's environment in ``ps``.
ADMIN_KEY_ENV = "NARWHAL_ADMIN_KEY"


class BearerKeys:
    """The keys a listener accepts, each named or not (a client key's ``name`` is its
    tenant's); none configured accepts every request.

    Each comparison is of SHA-256 digests, in constant time, so that neither a key's
    content nor its length shows in the time taken; every key is compared."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str | ApiKeyConfig]) -> None:
        self._digests = [
            (hashlib.sha256(k.encode()).digest(), None) if isinstance(k, str)
            else (hashlib.sha256(k.key.encode()).digest(), k.name)
            for k in keys
        ]  # fmt: skip

    def __repr__(self) -> str:
        return f"BearerKeys(<{len(self._digests)} keys>)"

    def __bool__(self) -> bool:
        return bool(self._digests)

    def _find(self, authorization: str | None) -> tuple[bool, str | None]:
        # No header is no scheme; another scheme presents an empty value, which no key is.
        scheme, _, token = (authorization or "").partition(" ")  # pragma: no mutate (equivalent: any text without a scheme presents no key)
        presented = hashlib.sha256(token.strip().encode() if scheme.lower() == "bearer" else b"").digest()  # pragma: no mutate (equivalent: a key is non-empty text, never the mutant's literal)
        ok = False
        name: str | None = None  # pragma: no mutate (equivalent: read only after a match sets it)
        for digest, key_name in self._digests:  # every key is compared, each in constant time
            hit = hmac.compare_digest(presented, digest)
            ok |= hit
            if hit:
                name = key_name
        return ok, name

    def accepts(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` header value presents one of the keys."""
        return not self._digests or self._find(authorization)[0]

    def match(self, authorization: str | None) -> str | None:
        """The name of the key an ``Authorization: Bearer`` header presents (None: an
        unnamed key).

        Raises:
            Unauthorized: no header, another scheme, or a key that is not configured.
        """
        ok, name = self._find(authorization)
        if not ok:
            raise Unauthorized("missing or invalid API key", code="invalid_api_key")
        return name


def bearer(key: str | None) -> dict[str, str]:
    """The request headers that present ``key`` (none for None)."""
    return {} if key is None else {"authorization": f"Bearer {key}"}


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only: ``localhost`` or a loopback
    IP (127.0.0.0/8, ``::1``). A wildcard, a routable address or any other name is not."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _hostname(authority: str) -> str:
    """The host of a ``Host`` header or of an origin's ``host[:port]`` (brackets off an
    IPv6 address)."""
    if authority.startswith("["):
        return authority[1:].partition("]")[0]  # pragma: no mutate (equivalent: one closing bracket)
    return authority.rpartition(":")[0] if authority.count(":") == 1 else authority  # pragma: no mutate (equivalent: one colon)


def _local_name(host: str) -> bool:
    """Whether ``host`` names this machine without DNS: an IP address, or ``localhost``
    (and its subdomains, which resolvers answer with loopback themselves, RFC 6761)."""
    host = host.lower().rstrip(".")  # pragma: no mutate (equivalent: lowercased, no "X" to strip)
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def browser_problem(host: str | None, origin: str | None) -> str | None:
    """Why a request to an admin listener without keys must be refused (None: it may
    pass): it came from a web page. ``host`` and ``origin``: its ``Host`` and ``Origin``
    headers.

    A browser sends ``Origin`` with a WebSocket handshake and with every request but a
    plain ``GET``: one from a page that is not served from this machine is refused. A
    page that rebinds its own name to 127.0.0.1 is same-origin and may send a ``GET``
    without ``Origin``, but its ``Host`` is that name: a ``Host`` that is not an address
    or ``localhost`` is refused (curl, Prometheus and ``narwhal top`` name the listener by
    its address). Admin keys lift both checks (a page has no key).
    """
    if host is not None and not _local_name(_hostname(host.strip())):
        return (f"Host {host!r} is a name, not this machine's address: without admin keys "
                "the admin port answers requests to 127.0.0.1, [::1] or localhost only")  # fmt: skip
    if origin is not None:  # ("null", a sandboxed page's, names no host: refused too)
        _, _, authority = origin.strip().partition("://")  # pragma: no mutate (equivalent: one scheme separator)
        if not authority or not is_loopback(_hostname(authority)):
            return (f"a web page's request (Origin {origin!r}): without admin keys the admin "
                    "port answers no page that is not served from this machine")  # fmt: skip
    return None


def admin_listener_problem(server: ServerConfig, host: str | None = None) -> ConfigError | None:
    """Why the admin listener must not start on ``host`` (default ``server.admin_host``):
    an address others can reach and no admin key to keep them out; None when it may."""
    host = server.admin_host if host is None else host
    if server.admin_api_keys or is_loopback(host):
        return None
    return ConfigError(
        f"admin_host {host!r} is not a loopback address and no admin key is set: anyone who "
        "reaches the admin port could read /events and reload the fleet with PUT /fleet; set "
        f"server.admin_api_keys (or {ADMIN_KEY_ENV}), or bind it to 127.0.0.1",
        path="$.server.admin_host",
    )
