"""Engines found in DNS: the fleet document's ``engine_groups``.

A group names a host name, a port and roles, the way a Kubernetes headless Service
publishes its ready pods: every address the name resolves to is one engine,
``http://<address>:<port>``, named ``<group>-<address>`` (an IPv6 address with ``-``
for ``:``), with the group's roles, model, API key, connector (its KV host is the
address) and KV-event ports.

Each group is resolved (``trio.socket.getaddrinfo``, so a custom hostname resolver
applies) when the router starts or a reload brings it, then every
``resolve_every_s``. When the set of addresses changes, the fleet changes exactly as a
reload would (:mod:`narwhal.router.fleet`): a new address is a ``starting`` engine that
takes traffic once its readiness probe passes; a vanished one drains. A name that does
not exist (or has no address) has no engines; a resolution that fails otherwise (a
timeout, a server failure) keeps the addresses last resolved, and ``/fleet`` on the
admin port says so.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Iterable

import attrs
import trio

from narwhal.config import (
    ConnectorConfig,
    EngineConfig,
    EngineGroupConfig,
    FleetConfig,
    KVEventsConfig,
)
from narwhal.errors import ConfigError
from narwhal.router.fleet import LiveFleet

__all__ = ["Discovery", "group_engines", "resolve_group"]

log = logging.getLogger("narwhal.router.discovery")

#: getaddrinfo errors that say the name has no address (an empty Service), not a failure.
_NO_ADDRESS = frozenset(
    code for code in (getattr(socket, "EAI_NONAME", None), getattr(socket, "EAI_NODATA", None)) if code is not None
)


def _in_url(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def group_engines(group: EngineGroupConfig, addresses: Iterable[str]) -> list[EngineConfig]:
    """The engines of ``group`` at ``addresses``."""
    engines = []
    for address in addresses:
        host = _in_url(address)
        connector = None
        if group.connector is not None:
            connector = ConnectorConfig(type=group.connector.type, kv_host=address, kv_port=group.connector.kv_port)
        kv_events = None
        if group.kv_events is not None:
            kv = group.kv_events
            replay = f"tcp://{host}:{kv.replay_port}" if kv.replay_port is not None else None
            kv_events = KVEventsConfig(endpoint=f"tcp://{host}:{kv.port}", replay_endpoint=replay, topic=kv.topic)
        engines.append(
            EngineConfig(
                name=f"{group.name}-{address.replace(':', '-')}",
                url=f"http://{host}:{group.port}",
                roles=group.roles,
                model=group.model,
                api_key=group.api_key,
                connector=connector,
                kv_events=kv_events,
            )
        )
    return engines


async def resolve_group(group: EngineGroupConfig, timeout_s: float) -> tuple[str, ...]:
    """The addresses ``group.host`` resolves to now, sorted (empty: the name has none).

    Raises:
        OSError: the resolution failed (not "no such name"), or took over ``timeout_s``.
    """
    try:
        with trio.fail_after(timeout_s):
            infos = await trio.socket.getaddrinfo(group.host, group.port, type=socket.SOCK_STREAM)
    except trio.TooSlowError:
        raise OSError(errno.ETIMEDOUT, f"no answer within {timeout_s:g} s (engine.connect_timeout_s)") from None
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESS:
            return ()
        raise
    return tuple(sorted({str(info[4][0]) for info in infos}))


@attrs.define(eq=False)
class _Watch:
    group: EngineGroupConfig
    scope: trio.CancelScope


class Discovery:
    """Keeps the fleet's engine groups resolved (see the module docstring).

    Installs itself as the fleet's :attr:`~narwhal.router.fleet.LiveFleet.expand`, so that
    every document the fleet applies has its groups' engines.
    """

    def __init__(self, fleet: LiveFleet) -> None:
        self.fleet = fleet
        self.state = fleet.state
        #: group name -> the addresses it resolved to last.
        self.addresses: dict[str, tuple[str, ...]] = {}
        #: group name -> why its last resolution failed (the addresses above are kept).
        self.errors: dict[str, str] = {}
        self._watches: dict[str, _Watch] = {}
        self._nursery: trio.Nursery | None = None
        fleet.expand = self.expand
        fleet.before_apply = self.prepare
        fleet.after_apply = self.follow

    def expand(self, config: FleetConfig) -> list[EngineConfig]:
        """The document's engines and its groups' engines (a name or url that a listed
        engine already has is skipped, with a warning)."""
        engines = list(config.engines)
        names = {e.name for e in engines}
        urls = {e.url for e in engines}
        for group in config.engine_groups:
            for e in group_engines(group, self.addresses.get(group.name, ())):
                if e.name in names or e.url in urls:
                    log.warning("engine group %s: %s at %s is already in the fleet: skipped", group.name, e.name, e.url)
                    continue
                names.add(e.name)
                urls.add(e.url)
                engines.append(e)
        return engines

    async def prepare(self, config: FleetConfig) -> None:
        """Resolve the document's new (or changed) groups before it is applied.

        Raises:
            ConfigError: a new group's name does not resolve (the document is refused).
        """
        timeout = config.engine.connect_timeout_s
        for i, group in enumerate(config.engine_groups):
            watch = self._watches.get(group.name)
            if watch is not None and (watch.group.host, watch.group.port) == (group.host, group.port):
                continue
            try:
                self.addresses[group.name] = await resolve_group(group, timeout)
                self.errors.pop(group.name, None)
            except OSError as exc:
                raise ConfigError(f"cannot resolve {group.host!r}: {exc}", path=f"$.engine_groups[{i}].host") from None

    def follow(self, config: FleetConfig) -> None:
        """Resolve the document's groups periodically from now on (and no others)."""
        wanted = {g.name: g for g in config.engine_groups}
        for name in list(self._watches):
            if wanted.get(name) != self._watches[name].group:
                self._watches.pop(name).scope.cancel()
                if name not in wanted:
                    self.addresses.pop(name, None)
                    self.errors.pop(name, None)
        if self._nursery is None:
            return
        for name, group in wanted.items():
            if name not in self._watches:
                watch = self._watches[name] = _Watch(group, trio.CancelScope())
                self._nursery.start_soon(self._watch, watch)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Resolve every group and serve their engines; then re-resolve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            config = self.state.config
            if config.engine_groups:
                try:
                    await self.fleet.refresh("dns")
                except ConfigError as err:  # resolved again every resolve_every_s
                    log.error("engine groups: %s", err)
            self.follow(config)
            task_status.started()
            await trio.sleep_forever()

    async def _watch(self, watch: _Watch) -> None:
        group = watch.group
        with watch.scope:
            while True:
                await trio.sleep(group.resolve_every_s)
                try:
                    addresses = await resolve_group(group, self.state.config.engine.connect_timeout_s)
                except OSError as exc:
                    if self.errors.get(group.name) is None:
                        log.warning("engine group %s: cannot resolve %r: %s (keeping %d engines)",
                                    group.name, group.host, exc, len(self.addresses.get(group.name, ())))  # fmt: skip
                    self.errors[group.name] = str(exc)
                    continue
                self.errors.pop(group.name, None)
                if addresses == self.addresses.get(group.name):
                    continue
                log.info("engine group %s: %s resolves to %s", group.name, group.host, ", ".join(addresses) or "nothing")
                previous = self.addresses.get(group.name, ())
                self.addresses[group.name] = addresses
                try:
                    await self.fleet.refresh(f"dns:{group.name}")
                except ConfigError as err:  # tried again at the next resolution
                    self.addresses[group.name] = previous
                    log.error("engine group %s: the change was refused: %s", group.name, err)
