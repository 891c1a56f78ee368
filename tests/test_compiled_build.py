"""The optional compiled build (setup.py): what keeps both builds alike.

``NARWHAL_EXPECT_COMPILED=1`` (set by .ci/run's compiled stage) makes the suite prove
it runs the compiled modules, ``=0`` (its pure-Python stage) that it runs none.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

from narwhal.errors import BadRequest, caused

ROOT = Path(__file__).resolve().parent.parent


def compiled_modules() -> list[str]:
    """The paths setup.py compiles (its ``COMPILED`` list)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets
        ):
            paths = ast.literal_eval(node.value)
            assert isinstance(paths, list) and paths
            return [str(p) for p in paths]
    raise AssertionError("setup.py has no COMPILED list")


def test_compiled_modules_chain_errors_without_raise_from() -> None:
    # mypyc compiles `raise X from Y` as `raise X`: the cause would be lost only in the
    # compiled build.
    found = []
    for path in compiled_modules():
        tree = ast.parse((ROOT / path).read_text())
        found += [
            f"{path}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and node.cause is not None
        ]
    assert found == [], f"`raise ... from` in a compiled module (use errors.caused): {found}"


def test_caused_chains_as_raise_from_does() -> None:
    cause = ValueError("bad byte")
    with pytest.raises(BadRequest) as info:
        try:
            raise cause
        except ValueError as exc:
            raise caused(BadRequest("not UTF-8"), exc)  # noqa: B904
    assert info.value.__cause__ is cause and info.value.__suppress_context__
    with pytest.raises(BadRequest) as info:
        try:
            raise cause
        except ValueError:
            raise caused(BadRequest("not JSON"), None)  # noqa: B904
    err = info.value
    assert err.__cause__ is None and err.__suppress_context__ and err.__context__ is cause


def test_the_build_under_test_is_the_one_expected() -> None:
    expected = os.environ.get("NARWHAL_EXPECT_COMPILED")
    if expected not in ("0", "1"):
        pytest.skip("NARWHAL_EXPECT_COMPILED is not set (.ci/run sets it per stage)")
    loaded = {}
    for path in compiled_modules():
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        loaded[path] = str(module.__file__)
        assert loaded[path].startswith(str(ROOT / "narwhal")), loaded[path]
    suffix = ".so" if expected == "1" else ".py"
    wrong = {p: f for p, f in loaded.items() if not f.endswith(suffix)}
    assert wrong == {}, f"expected every module to load from a {suffix} file"
