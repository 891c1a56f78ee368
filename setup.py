"""Build script: the optional compiled hot path (mypyc).

Metadata lives in setup.cfg. This file only decides whether the modules on the
per-request and per-token path are compiled to C extensions with mypyc:

- unset or ``auto`` (the default): compiled when mypyc (it ships with mypy) and a C
  compiler are present and the compile succeeds, pure Python otherwise.
- ``NARWHAL_MYPYC=0``: pure Python, always.
- ``NARWHAL_MYPYC=1``: compiled, or the build fails and says why.

Editable installs (``pip install -e``) stay pure Python unless ``NARWHAL_MYPYC=1``:
compiled modules would sit beside the sources and hide every edit until the next build.

mypyc type-checks the package as it compiles, so the build needs mypy and the
runtime dependencies: ``pip install --no-build-isolation`` in an environment that has
them (an isolated build has neither, and installs pure Python). The compiled modules
behave as the pure-Python ones (the default test suite passes on both); the
pure-Python package works everywhere.
``python3 -c "import narwhal.engines.wire as m; print(m.__file__)"`` shows which one is
loaded (``.so`` when compiled).

In a compiled module annotations are enforced at run time, module functions cannot be
monkeypatched, its classes cannot be subclassed from interpreted code, and an attrs
class body cannot give an int, float, bool or list field an ``attrs.field(...)`` or
``attrs.Factory(...)`` value (mypyc checks the class-body value against the annotation).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import setup

# The request and token path, from the socket to the journal line. Kept out:
# modules that run once per process or per reload (config, cli, serving), the
# profiler, check and bench, narwhal.testing; http/server.py (once per connection;
# HTTPServer is subclassed by narwhal.testing, and an interpreted class cannot derive
# from a compiled one); engines/client.py (EngineClient is public API whose methods
# callers introspect with inspect.signature and replace per instance to inject faults,
# neither of which a compiled class allows); router/placement.py and pricing.py
# (PricedPlacement derives from Placement, so both or neither, and pricing chains an
# error with `raise ... from`, see narwhal.errors.caused); router/metrics.py (its
# collectors derive from prometheus_client's Collector, an interpreted class).
COMPILED = [
    "narwhal/netio.py",
    "narwhal/http/connection.py",
    "narwhal/http/delayed.py",
    "narwhal/http/messages.py",
    "narwhal/http/parser.py",
    "narwhal/engines/wire.py",
    "narwhal/engines/sse.py",
    "narwhal/engines/stream.py",
    "narwhal/engines/connector.py",
    "narwhal/router/app.py",
    "narwhal/router/lifecycle.py",
    "narwhal/router/requests.py",
    "narwhal/router/journal.py",
    "narwhal/router/state.py",
    "narwhal/router/prefix.py",
    "narwhal/router/breaker.py",
]

_ENV = "NARWHAL_MYPYC"


def _editable() -> bool:
    return any(arg in ("editable_wheel", "develop") for arg in sys.argv[1:])


def _builds() -> bool:
    """Whether this run builds the package (metadata-only runs need no compile)."""
    commands = ("build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install")
    return any(arg in commands for arg in sys.argv[1:])


def _no_compiler() -> str | None:
    """Why no C compiler can be run, or None when one can."""
    cc = sysconfig.get_config_var("CC") or "cc"
    name = os.environ.get("CC", cc).split()[0]
    if shutil.which(name) is None:
        return f"no C compiler ({name} is not on PATH)"
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"no Python headers ({include}/Python.h is missing)"
    return None


def _extensions() -> list[object]:
    mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        sys.exit(f"{_ENV}={mode!r}: expected 0 (pure Python), 1 (compiled) or auto")
    if mode == "0" or not _builds():
        return []
    required = mode == "1"
    if not required and _editable():
        print(f"narwhal: editable install, pure Python ({_ENV}=1 compiles)", file=sys.stderr)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        why = f"mypyc is not available ({exc})"
    else:
        why = _no_compiler() or ""
        if not why:
            # -O3 (mypyc's default) and asserts kept: the compiled build behaves as
            # the pure-Python one, assertions included.
            try:
                return list(mypycify(COMPILED, opt_level="3", group_name="narwhal"))
            except SystemExit as exc:  # mypyc reports type errors (a missing dependency) so
                if required:
                    raise
                why = f"mypyc could not compile the package (exit status {exc.code})"
    if required:
        sys.exit(f"{_ENV}=1 but the hot path cannot be compiled: {why}")
    print(f"narwhal: pure Python build: {why} ({_ENV}=1 makes this an error)", file=sys.stderr)
    return []


setup(ext_modules=_extensions())
