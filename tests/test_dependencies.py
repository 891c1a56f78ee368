"""The test extra is bounded: a fresh ``pip install -e '.[test]'`` gets tools that pass.

pytest 9.2 refused what 9.0 accepted (a nested ``pytest.approx``), so the README's test
command failed on a fresh install the day it came out. Every tool of the ``test``
extra whose new release can fail the suite or CI's lint has an upper bound, and the
installed tools fall within the bounds (the suite runs on what the extra allows).
"""

from __future__ import annotations

import configparser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent

#: The tools that run the suite and CI's checks: their releases change what passes.
BOUNDED = ("pytest", "pytest-trio", "hypothesis", "mypy", "ruff", "mutmut")


def _test_extra() -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.extras_require"]["test"].strip().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip()]
    return {r.name.lower(): r for r in requirements}


@pytest.mark.parametrize("name", BOUNDED)
def test_each_test_tool_has_an_upper_bound_the_installed_one_meets(name: str) -> None:
    requirement = _test_extra()[name]
    uppers = [s for s in requirement.specifier if s.operator in ("<", "<=", "==", "~=")]
    assert uppers, f"setup.cfg's test extra: {requirement} has no upper bound"
    installed = metadata.version(name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is installed, outside the test extra's {requirement}"
    )
