"""The shared store of tenants' limits and fair shares: Redis, spoken over trio.

Every router process (``--workers``, replicas behind a load balancer) that names the
same ``tenancy.store`` enforces one set of limits and one fair share per tenant:

- **limits**: one script per admitted request checks and takes, atomically, the tenant's
  request and token buckets and its in-flight count (:data:`ADMIT_SCRIPT`); the buckets
  run on the store's clock (``TIME``), so replicas need not agree on theirs. An in-flight
  request is a lease in a sorted set, scored by when it lapses (the request deadline
  and a margin): a router that dies without releasing its leases gives them back when
  they lapse;
- **fair shares**: each process adds the tokens it served per tenant to a hash and reads
  the fleet's totals back every ``tenancy.store.sync_s`` (:data:`SERVED_SCRIPT`), so that
  the queue's order by tokens served is the fleet's, not the process's.

Why not redis-py: its asyncio client runs on asyncio's event loop, not on trio's (and
the router is a trio program through and through); what the router needs is two
scripts, ``EVALSHA``, ``AUTH`` and ``SELECT``. :class:`RedisClient` is a small RESP2
client over trio streams: a bounded pool of connections, one command at a time on each,
every exchange under a deadline; a connection that fails or times out is closed, never
reused half-read. Any failure raises :class:`StoreUnavailable`; admission then does
what ``tenancy.store.on_outage`` says.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import trio

from narwhal.config import StoreConfig, TenantLimits

__all__ = ["ADMIT_SCRIPT", "SERVED_SCRIPT", "RedisClient", "RespError", "SharedLimits", "StoreUnavailable"]

#: Connections a process keeps to the store at most (requests beyond wait for one).
POOL_SIZE: Final = 8
#: Largest reply accepted from the store (a bulk string or the served-tokens hash).
MAX_REPLY: Final = 1 << 20
#: Most values one reply may hold (arrays' items at every depth), and its deepest
#: nesting: what the router's scripts return is a short flat list.
MAX_ITEMS: Final = 100_000
MAX_DEPTH: Final = 4


class StoreUnavailable(Exception):
    """The store did not answer in time, or the connection to it failed."""


class RespError(StoreUnavailable):
    """The store answered with an error reply (``-ERR ...``)."""


def _command(args: Sequence[str | bytes | int | float]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class _Connection:
    """One connection: a command written, its reply read, nothing else in between."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        self._items = 0

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise StoreUnavailable("the store closed the connection")
        self.buf += data
        if len(self.buf) > MAX_REPLY:
            raise StoreUnavailable("reply from the store too large")

    async def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            await self._fill()

    async def reply(self) -> Any:
        """One whole reply (raises :class:`StoreUnavailable` for one the router would not
        send for: too large, too many values, nested too deep, or malformed)."""
        self._items = 0
        return await self._value(0)

    async def _value(self, depth: int) -> Any:
        self._items += 1
        if self._items > MAX_ITEMS or depth > MAX_DEPTH:
            raise StoreUnavailable("reply from the store too large or nested too deep")
        line = await self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RespError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            if n > MAX_REPLY:
                raise StoreUnavailable("reply from the store too large")
            while len(self.buf) < n + 2:
                await self._fill()
            data = bytes(self.buf[:n])
            del self.buf[: n + 2]
            return data.decode()
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [await self._value(depth + 1) for _ in range(n)]
        raise StoreUnavailable(f"unexpected reply from the store: {line[:40]!r}")

    async def call(self, args: Sequence[str | bytes | int | float]) -> Any:
        await self.stream.send_all(_command(args))
        return await self.reply()


class RedisClient:
    """A pool of RESP2 connections to ``redis://host:port/db`` (see the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float, password_env: str | None = None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.db = int(parts.path.lstrip("/") or 0)
        self.timeout_s = timeout_s
        self.password_env = password_env
        self._idle: list[_Connection] = []
        self._slots = trio.Semaphore(POOL_SIZE)
        self._scripts: dict[str, str] = {}
        self._closed = False

    async def _open(self) -> _Connection:
        stream = await trio.open_tcp_stream(self.host, self.port)
        conn = _Connection(stream)
        try:
            password = os.environ.get(self.password_env) if self.password_env else None
            if password:
                await conn.call(["AUTH", password])
            if self.db:
                await conn.call(["SELECT", self.db])
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return conn

    async def call(self, *args: str | bytes | int | float) -> Any:
        """One command and its reply, within ``timeout_s`` (connecting included).

        Raises:
            StoreUnavailable: no answer in time, a broken connection, or an error reply
                (:class:`RespError`).
        """
        if self._closed:
            raise StoreUnavailable("the store client is closed")
        with trio.move_on_after(self.timeout_s) as scope:
            async with self._slots:
                conn = self._idle.pop() if self._idle else None
                try:
                    if conn is None:
                        conn = await self._open()
                    result = await conn.call(args)
                except RespError:
                    if conn is not None:
                        self._idle.append(conn)  # the reply was read whole: the connection is fine
                    raise
                except BaseException as exc:
                    if conn is not None:
                        await trio.aclose_forcefully(conn.stream)
                    if isinstance(exc, OSError | trio.BrokenResourceError | ValueError):
                        raise StoreUnavailable(f"store at {self.host}:{self.port}: {exc}") from None
                    raise
                self._idle.append(conn)
                return result
        assert scope.cancelled_caught
        raise StoreUnavailable(f"store at {self.host}:{self.port} did not answer within {self.timeout_s:g} s")

    async def script(self, source: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        """Run a Lua script by its digest, loading it the first time (``NOSCRIPT``)."""
        sha = self._scripts.get(source)
        if sha is None:
            sha = self._scripts[source] = hashlib.sha1(source.encode()).hexdigest()  # (Redis names scripts by SHA-1)
        try:
            return await self.call("EVALSHA", sha, len(keys), *keys, *args)
        except RespError as err:
            if not str(err).startswith("NOSCRIPT"):
                raise
        return await self.call("EVAL", source, len(keys), *keys, *args)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)


#: Checks and takes a tenant's limits at once. KEYS: requests bucket, tokens bucket,
#: in-flight leases. ARGV: requests/s, its depth, tokens/s, its depth, the request's
#: tokens, max in flight (each "" when not limited), the lease's member, its lifetime
#: in seconds. Returns {1} when admitted, else {0, seconds to wait (a string), which}.
ADMIT_SCRIPT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function refill(key, rate, depth)
  local v = redis.call('HMGET', key, 'level', 'at')
  local level = tonumber(v[1]) or depth
  local at = tonumber(v[2]) or now
  return math.min(depth, level + math.max(0, now - at) * rate)
end
local wait, which = 0, ''
local rl, tl
local cost = tonumber(ARGV[5])
if ARGV[1] ~= '' then
  local rate, depth = tonumber(ARGV[1]), tonumber(ARGV[2])
  rl = refill(KEYS[1], rate, depth)
  local need = math.min(1, depth)
  if rl < need then wait, which = (need - rl) / rate, 'requests_per_s' end
end
if ARGV[3] ~= '' then
  local rate, depth = tonumber(ARGV[3]), tonumber(ARGV[4])
  tl = refill(KEYS[2], rate, depth)
  local need = math.min(cost, depth)
  if tl < need and (need - tl) / rate > wait then wait, which = (need - tl) / rate, 'tokens_per_s' end
end
if ARGV[6] ~= '' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[6]) and wait == 0 then wait, which = 1, 'max_in_flight' end
end
if wait > 0 then return {0, tostring(wait), which} end
if ARGV[1] ~= '' then
  redis.call('HSET', KEYS[1], 'level', tostring(rl - 1), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) / tonumber(ARGV[1])) + 60)
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[2], 'level', tostring(tl - cost), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[4]) / tonumber(ARGV[3])) + 60)
end
if ARGV[6] ~= '' then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[8]), ARGV[7])
  redis.call('EXPIRE', KEYS[3], math.ceil(tonumber(ARGV[8])) + 60)
end
return {1}
"""

#: Adds this process's tokens served per tenant and reads the fleet's totals. KEYS: the
#: hash; ARGV: tenant, tokens, tenant, tokens, ... Returns the hash (HGETALL).
SERVED_SCRIPT: Final = """
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
return redis.call('HGETALL', KEYS[1])
"""


def _number(value: Any) -> float | None:
    """A finite number from a store's reply value (None: it is not one)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _arg(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class SharedLimits:
    """Tenants' limits and served tokens in the store (``tenancy.store``)."""

    def __init__(self, config: StoreConfig, *, client: RedisClient | None = None) -> None:
        self.config = config
        self.client = client if client is not None else RedisClient(
            config.url, timeout_s=config.timeout_s, password_env=config.password_env
        )
        self.prefix = config.key_prefix

    def _key(self, tenant: str, what: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:{what}"

    async def admit(self, tenant: str, limits: TenantLimits, tokens: int, lease: str, lease_s: float) -> tuple[float, str]:
        """Take one request of ``tokens`` tokens from ``tenant``'s limits: ``(0, "")``
        when admitted (its in-flight lease ``lease`` held for ``lease_s`` at most), else
        the seconds until it would be and the limit's name.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        rps, tps = limits.requests_per_s, limits.tokens_per_s
        args: list[str | int | float] = [
            _arg(rps), _arg(rps * limits.burst_s if rps is not None else None),
            _arg(tps), _arg(tps * limits.burst_s if tps is not None else None),
            tokens, "" if limits.max_in_flight is None else limits.max_in_flight, lease, repr(float(lease_s)),
        ]  # fmt: skip
        keys = [self._key(tenant, "requests"), self._key(tenant, "tokens"), self._key(tenant, "in_flight")]
        reply = await self.client.script(ADMIT_SCRIPT, keys, args)
        if not isinstance(reply, list) or not reply:
            raise StoreUnavailable(f"unexpected answer of the limits script: {reply!r}"[:200])
        if reply[0] == 1:
            return 0.0, ""
        wait = _number(reply[1]) if len(reply) > 1 else None
        return (min(wait, 3600.0) if wait is not None and wait > 0 else 1.0), str(reply[2])[:64] if len(reply) > 2 else ""

    async def release(self, tenant: str, lease: str) -> None:
        """End ``tenant``'s in-flight lease ``lease``."""
        await self.client.call("ZREM", self._key(tenant, "in_flight"), lease)

    async def exchange_served(self, served: Mapping[str, float]) -> dict[str, float]:
        """Add ``served`` (tokens per unit of weight, per tenant) to the fleet's totals and
        return the totals."""
        args: list[str | int | float] = []
        for tenant, tokens in served.items():
            args += [tenant, repr(float(tokens))]
        reply = await self.client.script(SERVED_SCRIPT, [f"{self.prefix}:served"], args)
        if not isinstance(reply, list) or len(reply) % 2:
            raise StoreUnavailable("unexpected answer of the served-tokens script")
        out: dict[str, float] = {}
        for name, value in zip(reply[::2], reply[1::2], strict=True):
            number = _number(value)
            if isinstance(name, str) and number is not None and number >= 0:
                out[name] = number
        return out

    async def aclose(self) -> None:
        await self.client.aclose()
