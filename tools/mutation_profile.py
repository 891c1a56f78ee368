"""Mutation testing of the profiler and the preflight (``narwhal/profile``, ``narwhal/check``).

Runs mutmut (3.x) on a throw-away copy of the repository, one module at a time, with
a configuration written into that copy only (the repository's own ``setup.cfg`` is
never changed), and prints the score of each module: killed / (killed + survived),
with timeouts counted as killed and mutants no test reaches listed apart.

    python3 tools/mutation_profile.py                      # every module of both packages
    python3 tools/mutation_profile.py narwhal/profile/fit.py --children 2
    python3 tools/mutation_profile.py --survivors          # also print each survivor's diff

Each module is tested by its fast unit tests (``TESTS`` below), not by the end-to-end
profiling runs that also reach it: mutmut then runs, for each mutant, only those of the
listed tests that call the mutated function. A module not listed uses every
``tests/test_profile_*.py`` and ``tests/test_check_*.py`` file.

On a small machine, work one function at a time (globs over mutant names, as for
``tools/mutation.py``), at low priority:

    nice -n 19 python3 tools/mutation_profile.py narwhal/check/gate.py --only '*x_gate_f__*' --survivors

A mutant shown to be equivalent (no test can tell it from the original) is marked in the
source with ``# pragma: no mutate`` and the argument after it, e.g.
``# pragma: no mutate (equivalent: ...)``; mutmut does not generate mutants on that line,
and the run reports how many such lines each module carries.
Several ``--only`` globs in one run share mutmut's start-up; the counts are then also
printed per function. The run writes ``mutation-profile.json`` (scores, per-function
counts and surviving mutant names) into
``--out`` (default: the current directory).

The exit status is 1 when mutmut fails (its statistics run or the clean run of the tests
failed: its output is printed) or a module has no mutant checked; a score never decides
it. CI runs one small module's mutants, seconds::

    python3 tools/mutation_profile.py narwhal/profile/progress.py --out /tmp
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from mutation import _copy_tree, _results  # noqa: E402  (one copy and reader for both tools)

PACKAGES = ("narwhal/profile", "narwhal/check")
_PROFILE_TESTS = [
    "tests/test_profile_fit.py",
    "tests/test_profile_sweep.py",
    "tests/test_profile_store.py",
    "tests/test_profile_attacks.py",
    "tests/test_profile_cli.py",
]
_CHECK_TESTS = [
    "tests/test_check_gate.py",
    "tests/test_check_api.py",
    "tests/test_check_cli.py",
    "tests/test_check_verify.py",
    "tests/test_profile_attacks.py",
]
TESTS: dict[str, list[str]] = {
    # Each module's fast unit tests, fastest file first. The profiling runs and simulated
    # fleets of test_check_verify.py / test_profile_attacks.py reach these modules too,
    # but at ~15 s a surviving mutant on a small machine; their rules are pinned by
    # direct tests in the files below.
    # test_profile_fit_cached.py pins the cached-prefix fit; test_profile_derive.py reaches
    # the fits through the derivation the profiler and the preflight share.
    "narwhal/profile/fit.py": [
        "tests/test_profile_fit.py",
        "tests/test_profile_fit_cached.py",
        "tests/test_profile_derive.py",
    ],
    "narwhal/profile/derive.py": ["tests/test_profile_derive.py", "tests/test_profile_fit.py"],
    "narwhal/profile/refit.py": ["tests/test_profile_refit.py"],
    "narwhal/profile/stability.py": ["tests/test_profile_stability.py"],
    "narwhal/profile/store.py": ["tests/test_profile_store_rules.py"],
    "narwhal/profile/cohort.py": ["tests/test_profile_cohort.py"],
    "narwhal/profile/sweep.py": ["tests/test_profile_sweep_rules.py"],
    "narwhal/profile/progress.py": ["tests/test_profile_cli_rules.py"],
    "narwhal/profile/cli.py": ["tests/test_profile_cli_rules.py"],
    "narwhal/profile/runner.py": ["tests/test_profile_runner_rules.py"],
    "narwhal/check/gate.py": ["tests/test_check_gate_rules.py", "tests/test_check_gate.py"],
    "narwhal/check/checks.py": [
        "tests/test_check_run_rules.py",
        "tests/test_check_gate_rules.py",
        "tests/test_check_gate.py",
        "tests/test_check_api.py",
    ],
    "narwhal/check/pools.py": ["tests/test_check_pools_rules.py", "tests/test_check_pools.py"],
    "narwhal/check/probes.py": ["tests/test_check_probe_rules.py", "tests/test_check_probes.py"],
    # Without the comparison with a run of the simulated engines: ~20 s under mutmut, it made
    # every mutant of the module slow; the targets' rules are pinned by the direct tests.
    "narwhal/check/suggest.py": [
        "tests/test_check_suggest_rules.py",
        "tests/test_check_suggest.py",
        "--deselect=tests/test_check_suggest.py::test_targets_agree_with_a_run_of_the_simulated_engines",
    ],
    "narwhal/check/record.py": ["tests/test_check_record_rules.py", "tests/test_check_record.py"],
    "narwhal/check/results.py": ["tests/test_check_results.py"],
    "narwhal/check/simulate.py": ["tests/test_check_simulate.py"],
    "narwhal/check/cli.py": ["tests/test_check_cli_rules.py", "tests/test_check_cli.py"],
}


def _modules(given: list[str]) -> list[str]:
    if given:
        return given
    out = []
    for package in PACKAGES:
        out += sorted(
            str(p.relative_to(ROOT))
            for p in (ROOT / package).glob("*.py")
            if p.name != "__init__.py"
        )
    return out


def _tests_for(module: str, given: tuple[str, ...] = ()) -> list[str]:
    chosen = (
        list(given)
        or TESTS.get(module)
        or (_PROFILE_TESTS if "/profile/" in module else _CHECK_TESTS)
    )
    # (``--deselect=FILE::TEST`` keeps a slow test of a selected file out of every mutant's run).
    return [t for t in chosen if t.startswith("-") or (ROOT / t).is_file()]


#: CPU seconds one test may take under a mutant (the slowest unit test takes a few).
TEST_CPU_BUDGET_S = 30
# A pytest plugin written into the scratch copy: a test that runs past its CPU budget ends
# the mutant's run with mutmut's exit code for a timeout (36). A mutant that loops forever
# then costs one test's budget, not mutmut's own limit, which grows with the time of every
# test that reaches the function (minutes of a shared machine, for an answer known early).
_CPU_BUDGET_PLUGIN = f"""
import os
import signal

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    signal.signal(signal.SIGVTALRM, lambda *_: os._exit(36))
    signal.setitimer(signal.ITIMER_VIRTUAL, {TEST_CPU_BUDGET_S})
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
"""


def _configure(work: Path, module: str, tests: list[str]) -> None:
    # Beside the tests: mutmut runs them from its own copy, with its own import path.
    (work / "tests" / "_mutation_cpu_budget.py").write_text(_CPU_BUDGET_PLUGIN)
    cfg = work / "setup.cfg"
    text = cfg.read_text() if cfg.exists() else ""
    if "[mutmut]" in text:  # a configuration of the router's, not ours: replace it here
        text = text[: text.index("[mutmut]")]
    text += (
        "\n[mutmut]\n"
        "source_paths=narwhal\n"
        f"only_mutate={module}\n"
        "also_copy=tests\n    fixtures\n    config\n    conftest.py\n    pytest.ini\n"
        "pytest_add_cli_args_test_selection=" + "\n    ".join(tests) + "\n"
        # Plain asserts and no tracebacks: a killed mutant fails at once (pytest's diff of two
        # long lists of result lines can take longer than mutmut's CPU limit, a false timeout).
        "pytest_add_cli_args=-q\n    -x\n    -p\n    no:cacheprovider\n    --assert=plain\n    --tb=no\n"
        "    -p\n    tests._mutation_cpu_budget\n"
    )
    cfg.write_text(text)


def _diffs(work: Path, module: str, names: list[str]) -> dict[str, str]:
    """Each mutant's changed lines, from mutmut's mutated copy of the module. Only the
    functions asked for are cut out of it (by line numbers: the copy holds a function
    per mutant, too many to take each one's source segment)."""
    source = (work / "mutants" / module).read_text()
    lines = source.splitlines()
    short = {n: n.rsplit(".", 1)[-1] for n in names}
    wanted = set(short.values()) | {
        s.rsplit("__mutmut_", 1)[0] + "__mutmut_orig" for s in short.values()
    }
    bodies = {
        node.name: lines[node.lineno : node.end_lineno]  # without the def line (its name differs)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in wanted
    }
    out = {}
    for name, fn in short.items():
        original = bodies.get(fn.rsplit("__mutmut_", 1)[0] + "__mutmut_orig", [])
        changed = difflib.unified_diff(original, bodies.get(fn, []), lineterm="", n=0)
        out[name] = "\n".join(
            x for x in changed if x[:1] in "+-" and not x.startswith(("+++", "---"))
        )
    return out


def _equivalent_lines(module: str) -> int:
    """Lines of the module marked ``# pragma: no mutate`` (mutants shown equivalent)."""
    return sum("# pragma: no mutate" in line for line in (ROOT / module).read_text().splitlines())


def run_module(
    module: str,
    *,
    children: int,
    survivors: bool,
    only: tuple[str, ...] = (),
    tests_given: tuple[str, ...] = (),
) -> dict[str, object]:
    tests = _tests_for(module, tests_given)
    with tempfile.TemporaryDirectory(prefix="narwhal-mutation-") as tmp:
        work = Path(tmp)
        _copy_tree(ROOT, work)
        _configure(work, module, tests)
        # The scratch copy's package, not a checkout named by the caller's PYTHONPATH.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(work)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *only],
                              cwd=work, env=env, capture_output=True, text=True)  # fmt: skip
        seconds = time.monotonic() - started
        statuses = {n: st for n, st in _results(work, env).items()
                    if not only or any(fnmatch.fnmatch(n, g) for g in only)}  # fmt: skip
        by_status: dict[str, list[str]] = {}
        for name, status in statuses.items():
            by_status.setdefault(status, []).append(name)
        killed_statuses = ("killed", "timeout", "caught by type check")
        killed = sum(len(by_status.get(s, [])) for s in killed_statuses)
        by_function: dict[str, dict[str, int]] = {}
        for name, status in statuses.items():
            counts = by_function.setdefault(name.rsplit("__mutmut_", 1)[0], {})
            kind = "killed" if status in killed_statuses else status
            counts[kind] = counts.get(kind, 0) + 1
        survived = sorted(by_status.get("survived", []))
        untested = sorted(by_status.get("no tests", []))
        diffs = _diffs(work, module, survived + untested) if survivors else {}
    total = killed + len(survived)
    return {
        "module": module,
        "only": list(only),
        "tests": tests,
        "killed": killed,
        "survived": len(survived),
        "no_tests": len(untested),
        "equivalent_lines": _equivalent_lines(module),
        "other": {
            k: len(v)
            for k, v in by_status.items()
            if k not in ("killed", "timeout", "caught by type check", "survived", "no tests")
        },
        "score": killed / total if total else None,
        "functions": dict(sorted(by_function.items())),
        "seconds": round(seconds, 1),
        "survivors": survived,
        "untested": untested,
        "survivor_diffs": diffs,
        "mutmut_rc": proc.returncode,
        "mutmut_tail": (proc.stdout[-1500:] + proc.stderr[-1500:]) if proc.returncode or not by_status else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help="modules to mutate (default: every module)")
    p.add_argument("--children", type=int, default=2, help="parallel test processes")
    p.add_argument("--survivors", action="store_true", help="print each surviving mutant")
    p.add_argument("--out", default=".", help="folder for mutation-profile.json")
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="GLOB",
        help="mutate only the functions whose mutant names match (e.g. '*x_gate_f__*'); repeatable",
    )
    p.add_argument(
        "--tests",
        action="append",
        default=[],
        metavar="FILE",
        help="test files to run instead of the module's own (e.g. to score the tests before a change)",
    )
    args = p.parse_args(argv)
    rows = []
    for module in _modules(args.modules):
        row = run_module(
            module,
            children=args.children,
            survivors=args.survivors,
            only=tuple(args.only),
            tests_given=tuple(args.tests),
        )
        rows.append(row)
        score = f"{row['score']:.1%}" if row["score"] is not None else "n/a"
        print(f"{module}: score {score} (killed {row['killed']}, survived {row['survived']}, "
              f"no tests {row['no_tests']}, lines marked equivalent {row['equivalent_lines']}) "
              f"in {row['seconds']} s", flush=True)  # fmt: skip
        if len(row["functions"]) > 1:  # type: ignore[arg-type]
            for function, counts in row["functions"].items():  # type: ignore[attr-defined]
                print(f"  {function}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        if row["mutmut_tail"]:
            print(f"  mutmut: {row['mutmut_tail']}", flush=True)
        for status, key in (("survived", "survivors"), ("no tests", "untested")):
            for name in row[key]:  # type: ignore[attr-defined]
                print(f"  {status}: {name}")
                if args.survivors:
                    for line in row["survivor_diffs"][name].splitlines():  # type: ignore[index]
                        print(f"      {line}")
    killed = sum(int(r["killed"]) for r in rows)  # type: ignore[call-overload]
    survived = sum(int(r["survived"]) for r in rows)  # type: ignore[call-overload]
    if killed + survived:
        print(f"total: score {killed / (killed + survived):.1%} (killed {killed}, "
              f"survived {survived})")  # fmt: skip
    Path(args.out, "mutation-profile.json").write_text(json.dumps(rows, indent=1) + "\n")
    failed = [f"{r['module']}: mutmut run exited {r['mutmut_rc']}" for r in rows if r["mutmut_rc"]]
    failed += [f"{r['module']}: no mutant checked" for r in rows
               if not r["mutmut_rc"] and not int(r["killed"]) + int(r["survived"]) + int(r["no_tests"])]  # type: ignore[call-overload]  # fmt: skip
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
