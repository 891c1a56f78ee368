"""Mutation testing of the profiler and the preflight (``narwhal/profile``, ``narwhal/check``).

Runs mutmut (3.x) on a throw-away copy of the repository, one module at a time, with
a configuration written into that copy only (the repository's own ``setup.cfg`` is
never changed), and prints the score of each module: killed / (killed + survived),
with timeouts counted as killed and mutants no test reaches listed apart.

    python3 tools/mutation_profile.py                      # every module of both packages
    python3 tools/mutation_profile.py narwhal/profile/fit.py --children 2
    python3 tools/mutation_profile.py --survivors          # also print each survivor's diff

Each module is tested by the test files that exercise it (``TESTS`` below); a module
not listed uses every ``tests/test_profile_*.py`` and ``tests/test_check_*.py`` file.
The run writes ``mutation-profile.json`` (scores and surviving mutant names) into
``--out`` (default: the current directory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
    # The fits' own unit tests: fast enough to mutate on a small machine (the
    # profiling runs of test_check_verify.py reach fit.py too, at ~20 s a mutant).
    "narwhal/profile/fit.py": ["tests/test_profile_fit.py"],
    "narwhal/profile/derive.py": ["tests/test_check_verify.py", "tests/test_profile_fit.py",
                                  "tests/test_profile_store.py"],
    "narwhal/profile/stability.py": ["tests/test_profile_attacks.py"],
    "narwhal/check/gate.py": ["tests/test_check_gate.py", "tests/test_check_verify.py",
                              "tests/test_profile_attacks.py"],
    "narwhal/check/checks.py": ["tests/test_check_gate.py", "tests/test_check_verify.py",
                                "tests/test_check_api.py", "tests/test_profile_attacks.py"],
}


def _modules(given: list[str]) -> list[str]:
    if given:
        return given
    out = []
    for package in PACKAGES:
        out += sorted(str(p.relative_to(ROOT)) for p in (ROOT / package).glob("*.py")
                      if p.name != "__init__.py")
    return out


def _tests_for(module: str) -> list[str]:
    chosen = TESTS.get(module) or (_PROFILE_TESTS if "/profile/" in module else _CHECK_TESTS)
    return [t for t in chosen if (ROOT / t).is_file()]


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        src = ROOT / name
        if src.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)


def _configure(work: Path, module: str, tests: list[str]) -> None:
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
        "pytest_add_cli_args=-q\n    -x\n    -p\n    no:cacheprovider\n"
    )
    cfg.write_text(text)


def _results(work: Path) -> dict[str, list[str]]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=work,
                         capture_output=True, text=True)  # fmt: skip
    by_status: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        if ":" not in line:
            continue
        name, status = (part.strip() for part in line.rsplit(":", 1))
        by_status.setdefault(status, []).append(name)
    return by_status


def run_module(module: str, *, children: int, survivors: bool) -> dict[str, object]:
    tests = _tests_for(module)
    with tempfile.TemporaryDirectory(prefix="narwhal-mutation-") as tmp:
        work = Path(tmp)
        _copy_repo(work)
        _configure(work, module, tests)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children",
                               str(children)], cwd=work, capture_output=True, text=True)  # fmt: skip
        seconds = time.monotonic() - started
        by_status = _results(work)
        killed = len(by_status.get("killed", [])) + len(by_status.get("timeout", []))
        survived = sorted(by_status.get("survived", []))
        untested = sorted(by_status.get("no tests", []))
        diffs: dict[str, str] = {}
        if survivors:
            for name in survived:
                shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work,
                                       capture_output=True, text=True)  # fmt: skip
                diffs[name] = shown.stdout
    total = killed + len(survived)
    return {
        "module": module,
        "tests": tests,
        "killed": killed,
        "survived": len(survived),
        "no_tests": len(untested),
        "other": {k: len(v) for k, v in by_status.items()
                  if k not in ("killed", "timeout", "survived", "no tests")},
        "score": killed / total if total else None,
        "seconds": round(seconds, 1),
        "survivors": survived,
        "survivor_diffs": diffs,
        "mutmut_rc": proc.returncode,
        "mutmut_tail": proc.stdout[-400:] + proc.stderr[-400:] if not by_status else "",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("modules", nargs="*", help="modules to mutate (default: every module)")
    p.add_argument("--children", type=int, default=2, help="parallel test processes")
    p.add_argument("--survivors", action="store_true", help="print each surviving mutant")
    p.add_argument("--out", default=".", help="folder for mutation-profile.json")
    args = p.parse_args(argv)
    rows = []
    for module in _modules(args.modules):
        row = run_module(module, children=args.children, survivors=args.survivors)
        rows.append(row)
        score = f"{row['score']:.1%}" if row["score"] is not None else "n/a"
        print(f"{module}: score {score} (killed {row['killed']}, survived {row['survived']}, "
              f"no tests {row['no_tests']}) in {row['seconds']} s", flush=True)  # fmt: skip
        if row["mutmut_tail"]:
            print(f"  mutmut: {row['mutmut_tail']}", flush=True)
        for name in row["survivors"]:  # type: ignore[attr-defined]
            print(f"  survived: {name}")
            if args.survivors:
                print(row["survivor_diffs"][name])  # type: ignore[index]
    killed = sum(int(r["killed"]) for r in rows)  # type: ignore[call-overload]
    survived = sum(int(r["survived"]) for r in rows)  # type: ignore[call-overload]
    if killed + survived:
        print(f"total: score {killed / (killed + survived):.1%} (killed {killed}, "
              f"survived {survived})")  # fmt: skip
    Path(args.out, "mutation-profile.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
