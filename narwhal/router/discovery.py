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
takes traffic once its readiness probe passes; a vanished one drains.

A group's name must exist when the group is brought (at start, or by a reload): one
that does not (NXDOMAIN, a typo more often than not) is refused, naming
``$.engine_groups[i].host``, as is any failed lookup then. Later, a name that no longer
exists or has no address has no engines (Kubernetes answers NXDOMAIN for a headless
Service with no ready pod), though a role is never emptied; a resolution that fails
otherwise (a timeout, a server failure) keeps the addresses last resolved, and
``/fleet`` on the admin port says so. An answer of more than the group's
``max_engines`` addresses keeps the first ``max_engines`` in sorted order.
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
#: The one of them that says the name does not exist at all (NXDOMAIN).
_NO_NAME = getattr(socket, "EAI_NONAME", None)

#: Engines built between two checkpoints (thousands of addresses keep requests flowing).
_BATCH = 64


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


async def resolve_group(group: EngineGroupConfig, timeout_s: float, *, must_exist: bool = False) -> tuple[str, ...]:
    """The addresses ``group.host`` resolves to now, sorted (empty: the name has none).

    Args:
        group: the group.
        timeout_s: how long the lookup may take.
        must_exist: a name that does not exist (NXDOMAIN) is a failure, not "no address"
            (a group being brought).

    Raises:
        OSError: the resolution failed (not "no such name", unless ``must_exist``), or
            took over ``timeout_s``.
    """
    try:
        with trio.fail_after(timeout_s):
            infos = await trio.socket.getaddrinfo(group.host, group.port, type=socket.SOCK_STREAM)
    except trio.TooSlowError:
        raise OSError(errno.ETIMEDOUT, f"no answer within {timeout_s:g} s (engine.connect_timeout_s)") from None
    except socket.gaierror as exc:
        if must_exist and exc.errno == _NO_NAME:
            raise OSError(exc.errno, f"the name does not exist (NXDOMAIN: {exc.strerror})") from None
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
        #: group name -> why its last resolution failed (the addresses above are kept), or
        #: that its answer had more addresses than its ``max_engines``.
        self.errors: dict[str, str] = {}
        #: group name -> (the group, its addresses, their engines): built once per answer,
        #: with checkpoints, not at every document applied.
        self._built: dict[str, tuple[EngineGroupConfig, tuple[str, ...], list[EngineConfig]]] = {}
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
            addresses = self.addresses.get(group.name, ())
            built = self._built.get(group.name)
            if built is not None and built[:2] == (group, addresses):
                members = built[2]
            else:
                members = group_engines(group, addresses)
            for e in members:
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
            same = ("host", "port", "max_engines")
            if watch is not None and all(getattr(watch.group, f) == getattr(group, f) for f in same):
                await self._build(group, self.addresses.get(group.name, ()))  # its other settings may have changed
                continue
            try:
                found = await resolve_group(group, timeout, must_exist=True)
            except OSError as exc:
                raise ConfigError(f"cannot resolve {group.host!r}: {exc}", path=f"$.engine_groups[{i}].host") from None
            await self._build(group, self._capped(group, found))

    def _capped(self, group: EngineGroupConfig, found: tuple[str, ...]) -> tuple[str, ...]:
        """The first ``max_engines`` of the addresses a lookup found (it succeeded: its
        error, if any, goes; an answer over the cap is noted, and logged when it changes)."""
        addresses = found[: group.max_engines]
        if len(found) == len(addresses):
            self.errors.pop(group.name, None)
            return addresses
        note = f"{group.host} answered {len(found)} addresses: the first {len(addresses)} kept (max_engines)"
        if self.errors.get(group.name) != note:
            log.warning("engine group %s: %s", group.name, note)
        self.errors[group.name] = note
        return addresses

    async def _build(self, group: EngineGroupConfig, addresses: tuple[str, ...]) -> None:
        """Keep ``addresses`` as the group's and build their engines, a batch between two
        checkpoints (expanding a document then takes them as built)."""
        self.addresses[group.name] = addresses
        built = self._built.get(group.name)
        if built is not None and built[:2] == (group, addresses):
            return
        engines: list[EngineConfig] = []
        for start in range(0, len(addresses), _BATCH):
            engines += group_engines(group, addresses[start : start + _BATCH])
            await trio.lowlevel.checkpoint()
        self._built[group.name] = (group, addresses, engines)

    def follow(self, config: FleetConfig) -> None:
        """Resolve the document's groups periodically from now on (and no others)."""
        wanted = {g.name: g for g in config.engine_groups}
        for name in list(self._watches):
            if wanted.get(name) != self._watches[name].group:
                self._watches.pop(name).scope.cancel()
                if name not in wanted:
                    self.addresses.pop(name, None)
                    self.errors.pop(name, None)
                    self._built.pop(name, None)
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
                    if self.errors.get(group.name) != str(exc):  # said once (again when it changes)
                        log.warning("engine group %s: cannot resolve %r: %s (keeping %d engines)",
                                    group.name, group.host, exc, len(self.addresses.get(group.name, ())))  # fmt: skip
                    self.errors[group.name] = str(exc)
                    continue
                previous = self.addresses.get(group.name)
                kept = self._capped(group, addresses)
                if kept == previous:
                    continue
                shown = ", ".join(kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
                log.info("engine group %s: %s resolves to %s", group.name, group.host, shown or "nothing")
                await self._build(group, kept)
                try:
                    await self.fleet.refresh(f"dns:{group.name}")
                except ConfigError as err:  # tried again at the next resolution
                    self.addresses[group.name] = previous or ()
                    log.error("engine group %s: the change was refused: %s", group.name, err)
