"""The preflight package's public surface: its facade re-exports what its modules define."""

from __future__ import annotations

import inspect
import types

import attrs

import narwhal.check
from narwhal.check import checks, cli, gate, probes, record, results, simulate, suggest

MODULES = (checks, gate, probes, record, results, simulate, suggest)


def test_documented_imports() -> None:
    from narwhal.check.checks import CheckReport, CheckResult, run_check
    from narwhal.check.cli import main
    from narwhal.check.record import DeploymentRecord, load_record, record_matches

    assert CheckResult is narwhal.check.CheckResult and CheckReport is narwhal.check.CheckReport
    assert run_check is narwhal.check.run_check and load_record is narwhal.check.load_record
    assert record_matches is narwhal.check.record_matches
    assert DeploymentRecord is narwhal.check.DeploymentRecord
    assert inspect.signature(main).parameters["argv"].default is None
    assert list(inspect.signature(run_check).parameters) == ["fleet", "transport"]
    assert [f.name for f in attrs.fields(CheckResult)] == [
        "name",
        "engine",
        "ok",
        "measured",
        "limit",
        "message",
        "detail",
    ]


def test_facade_all_matches_its_exports() -> None:
    exported = set(narwhal.check.__all__)
    assert len(exported) == len(narwhal.check.__all__)
    public = {
        name
        for name, value in vars(narwhal.check).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert exported == public


def test_facade_reexports_every_module_public_name() -> None:
    for module in MODULES:
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
            assert getattr(narwhal.check, name) is getattr(module, name), (module.__name__, name)
    assert cli.__all__ == ["PROG", "amain", "main"]
