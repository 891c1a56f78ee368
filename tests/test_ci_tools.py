"""Every tool under tools/ that a doc or a closing note quotes runs in CI, so it cannot rot unseen.

CI (``.ci/run``) runs each one's short form for seconds; a helper that only runs under
another tool (the floor relay, the load generator) runs with the tool that drives it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: A tool named in prose or a command line (the vLLM pair's scripts under tools/vllm-cpu/
#: belong to the real-engine stage, which runs them).
QUOTED = re.compile(r"tools/([a-z_]+\.py)")

#: Helpers CI runs through another tool: helper -> the tool CI runs that drives it.
DRIVEN = {"floor_relay.py": "bench_overhead.py", "loadgen.py": "bench_overhead.py"}


def _quoted(*paths: Path) -> set[str]:
    return {name for path in paths for name in QUOTED.findall(path.read_text())}


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _ci_runs() -> set[str]:
    return _quoted(ROOT / ".ci" / "run")


def test_every_quoted_tool_is_there_and_runs_in_ci() -> None:
    in_docs = _quoted(*_docs())
    gone = sorted(name for name in in_docs if not (ROOT / "tools" / name).is_file())
    assert not gone, f"the docs quote tools that are not under tools/: {gone}"
    # The changelog's entries are the closing notes; a tool they name that has since gone is not run.
    in_notes = {n for n in _quoted(ROOT / "CHANGELOG.md") if (ROOT / "tools" / n).is_file()}
    not_run = sorted((in_docs | in_notes) - _ci_runs() - set(DRIVEN))
    assert not not_run, f".ci/run runs no short form of {not_run}"


def test_a_helper_runs_under_a_tool_ci_runs() -> None:
    for helper, tool in DRIVEN.items():
        assert tool in _ci_runs()
        assert helper in (ROOT / "tools" / tool).read_text(), f"tools/{tool} no longer drives {helper}"
