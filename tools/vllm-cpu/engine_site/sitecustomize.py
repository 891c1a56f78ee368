"""Start-up hook of the CPU pair's engines: NIXL's UCX progress thread waits instead of spinning.

``pair.py`` puts this directory on the engines' ``PYTHONPATH`` (so Python imports this
module at start-up in the API server, the engine core and the worker) together with
``NARWHAL_NIXL_PROGRESS_DELAY_US``. Without that variable this module does nothing.

Why: NIXL's Python agent creates its native agent with ``pthrDelay = 0`` (hard-coded in
``nixl_agent.__init__``, not exposed by ``nixl_agent_config`` nor by vLLM's
``kv_connector_extra_config``). The UCX backend's shared progress thread then calls
``poll(fds, n, 0)`` in a loop: each engine with ``NixlConnector`` keeps one core busy
while idle (measured: 80-90% of a core each, two thirds of it system time). With a
delay the thread sleeps in ``poll`` on the UCX workers' event descriptors and wakes when
UCX signals work, or after the delay at the latest: the transfer path is unchanged
(the consumer's worker drives its own reads when it checks a transfer's status), only
the empty polling goes.

How: after ``nixl_cu12._api`` / ``nixl_cu13._api`` / ``nixl_rocm._api`` is imported, its
bindings' ``nixlAgent`` constructor is wrapped so that a config with the progress thread
on and ``pthrDelay == 0`` gets the delay given here. Nothing else of NIXL or vLLM
changes. Standard library only.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_ENV = "NARWHAL_NIXL_PROGRESS_DELAY_US"
_TARGETS = frozenset({"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"})


def _patch(module: ModuleType, delay_us: int) -> None:
    bindings = getattr(module, "nixlBind", None)
    agent = getattr(bindings, "nixlAgent", None)
    if bindings is None or agent is None or getattr(agent, "_narwhal_wrapped", False):
        return

    def nixl_agent(name: str, config: Any, *rest: Any) -> Any:
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = delay_us
        return agent(name, config, *rest)

    nixl_agent._narwhal_wrapped = True  # type: ignore[attr-defined]
    bindings.nixlAgent = nixl_agent


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self.inner = inner
        self.delay_us = delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module, self.delay_us)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.delay_us)
                return spec
        return None


def _install() -> None:
    raw = os.environ.get(_ENV)
    if not raw:
        return
    try:
        delay_us = int(raw)
    except ValueError:
        print(
            f"sitecustomize: {_ENV}={raw!r} is not an integer; NIXL left as it is", file=sys.stderr
        )
        return
    if delay_us <= 0:
        return
    for name in _TARGETS & sys.modules.keys():
        _patch(sys.modules[name], delay_us)
    sys.meta_path.insert(0, _Finder(delay_us))


_install()
