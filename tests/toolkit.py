"""Loading a script of ``tools/`` in a test: by its path, with ``tools/`` on ``sys.path``
while it imports (the scripts import their siblings: ``proctools``, ``bench_overhead``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["TOOLS", "load_tool"]

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(filename: str) -> ModuleType:
    """The module of ``tools/<filename>``, under a private name."""
    sys.path.insert(0, str(TOOLS))
    try:
        spec = importlib.util.spec_from_file_location(f"_{Path(filename).stem}", TOOLS / filename)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(TOOLS))
