#!/usr/bin/env python3
"""Mutation testing of the modules that carry the execution rules, one module at a time.

Runs ``mutmut`` (``pip install mutmut``; configured in setup.cfg's ``[mutmut]`` section)
on each module with the tests that exercise it, in a scratch copy of the working tree
(mutmut writes a ``mutants/`` tree beside the code), and prints the score per module:
killed (a test failed, or hung past mutmut's timeout) over every mutant generated.
Mutants no test reaches count as survivors.

    python3 tools/mutation.py                      # every module below
    python3 tools/mutation.py narwhal/router/breaker.py --survivors
    python3 tools/mutation.py --tree /elsewhere    # score another checkout

A run over every module takes tens of minutes on two cores; one module takes a few.
``--only`` narrows a run to some functions (mutant names are ``module.x_function__mutmut_N``
or ``module.xǁClassǁmethod__mutmut_N``), to confirm that new tests kill what they aim at;
``--tests`` runs a part of the module's tests instead (a mutant they kill is killed by the
whole selection too: a quick confirmation, and a lower bound of the score).

Equivalent mutants. A surviving mutant is either a missing test (write one that asserts
the behaviour: the error's status, message and fields, the journal's record, the log
line an operator reads) or equivalent: no input can tell it from the original. An
equivalent mutant is removed where the code can say the same thing without it (a dead
branch or argument deleted, a literal moved to a module constant, which mutmut does not
mutate); otherwise its line carries ``# pragma: no mutate (equivalent: <why>)``, which
keeps mutmut from generating any mutant of that statement: keep such a statement to the
equivalent part where the code allows (where it does not, the comment says so and that
the statement's other mutants were killed in a run without the pragma).
``grep -rn "pragma: no mutate" narwhal`` lists every one with its argument.

The exit status is 1 when mutmut fails (its statistics run or the clean run of the tests
failed: its output is printed) or a module has no mutant checked; a score never decides
it. CI runs one small module's mutants, seconds::

    python3 tools/mutation.py narwhal/router/promptlen.py
"""

from __future__ import annotations

import argparse
import ast
import configparser
import difflib
import fnmatch
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Module -> the tests that exercise its rules, files or single tests (``file::test``);
#: mutmut runs, for each mutant, those of them that reach the mutated function.
MODULES: dict[str, tuple[str, ...]] = {
    # The simulated engine's scheduler: what every timing test measures against.
    "narwhal/testing/scheduler.py": ("tests/test_sim_engine.py", "tests/test_sim_prefix_cache.py", "tests/test_sim_handoff.py",
                                     "tests/test_engine_time.py"),  # its own time histograms
    "narwhal/router/breaker.py": ("tests/test_breaker.py", "tests/test_router_recovery.py"),
    # The fault matrix exercises probes too, but its 200-odd cases per mutant are too slow here.
    "narwhal/router/probe.py": ("tests/test_readmission.py", "tests/test_readiness.py", "tests/test_router_recovery.py"),
    "narwhal/router/placement.py": ("tests/test_breaker.py", "tests/test_router_basic.py", "tests/test_router_recovery.py"),
    "narwhal/router/retry.py": ("tests/test_breaker.py", "tests/test_router_recovery.py"),
    # Client and admin keys, the admin listener's loopback rule.
    "narwhal/router/keys.py": ("tests/test_security.py", "tests/test_tenants.py"),
    # Resuming a broken stream: what is resumed, the continuation, the rewritten events.
    "narwhal/router/resume.py": ("tests/test_resume_ledger.py", "tests/test_resume.py"),
    # Its 600-odd mutants each rerun the router tests that reach them: these files keep
    # a run of the request path's functions (--only) under an hour on two cores.
    "narwhal/router/lifecycle.py": (
        "tests/test_lifecycle_rules.py", "tests/test_router_failures.py", "tests/test_router_basic.py",
        "tests/test_multimodel.py",  # placement by the request's model
        # A busy prefix copied by the prompt's token ids.
        "tests/test_prefix_replication.py::test_a_prefix_queued_on_the_fast_producer_is_copied_to_the_slow_one",
        # The attempt's prefix-cache predictions (the file's fast tests: a second each).
        *(
            f"tests/test_prefix_placement.py::test_{name}" for name in (
                "the_engine_holding_the_prefix_wins_over_a_faster_cold_one",
                "the_consumer_learns_the_prompt_it_pulled",
                "among_equal_consumers_the_one_holding_the_prefix_decodes",
                "a_same_worker_attempt_has_no_consumer_prediction",
                "prefix_cache_off_prices_no_hit",
                "an_engine_without_prefix_caching_gets_no_view",
                "a_producer_the_index_does_not_see_has_no_predicted_hit",
            )
        ),
    ),
    "narwhal/engines/stream.py": ("tests/test_decode_stream.py", "tests/test_engine_client.py"),
    "narwhal/engines/connector.py": ("tests/test_connector.py", "tests/test_engine_client.py"),
    "narwhal/errors.py": ("tests/test_errors.py", "tests/test_engine_client.py", "tests/test_router_failures.py"),
    # The load-level comparisons (hundreds of requests each, half a minute a run) prove
    # that pricing pays off; the rules themselves are held by the quick tests.
    "narwhal/router/batching.py": ("tests/test_queue_models.py",),
    # The reserved prefills and the queue ahead of a new one, as pricing reads them.
    "narwhal/router/prefillqueue.py": (
        "tests/test_queue_models.py", "tests/test_pricing_rules.py", "tests/test_priced_placement.py",
        "tests/test_prefix_replication.py",
        "--deselect=tests/test_priced_placement.py::test_priced_placement_holds_the_slo_for_more_requests",
        "--deselect=tests/test_prefix_replication.py::test_hit_aware_placement_carries_more_than_the_fast_producer_alone",
    ),
    # How a producer queues prompts: the probe against simulated engines in virtual
    # time, the verdict's rule, and the sidecar's record as check and refit read it.
    "narwhal/profile/burst.py": ("tests/test_profile_burst.py",),
    # The sweeps' plans and runs against simulated engines (the decode cells of one prefix
    # in the prefix tests).
    "narwhal/profile/sweep.py": (
        "tests/test_profile_sweep.py", "tests/test_profile_sweep_rules.py", "tests/test_profile_prefix.py",
    ),
    "narwhal/profile/derive.py": ("tests/test_profile_derive.py", "tests/test_profile_burst.py",
                                  "tests/test_engine_time.py"),
    # The engine's own time of a probe prefill, and the fit of the time outside its steps.
    "narwhal/profile/enginetime.py": ("tests/test_engine_time.py",),
    "narwhal/router/pricing.py": (
        "tests/test_pricing_rules.py", "tests/test_priced_placement.py", "tests/test_prefix_placement.py",
        "tests/test_prefix_replication.py", "tests/test_reactive.py", "tests/test_queue_models.py",
        "tests/test_shared_kv.py",
        "--deselect=tests/test_priced_placement.py::test_priced_placement_holds_the_slo_for_more_requests",
        "--deselect=tests/test_prefix_placement.py::test_hit_aware_pricing_carries_a_shared_prefix_load_hit_blind_refuses",
        "--deselect=tests/test_prefix_replication.py::test_hit_aware_placement_carries_more_than_the_fast_producer_alone",
    ),
    # The prompt blocks a consumer's streams share: its own tests and pricing's KV room.
    "narwhal/router/sharedkv.py": ("tests/test_shared_kv.py",),
    # Prompt sizes and the learned tokens-per-byte ratio: pure functions, direct tests.
    "narwhal/router/promptlen.py": ("tests/test_promptlen.py",),
    # The poll's loop against stand-in engine clients (the replica tests' end-to-end runs
    # of several routers are too slow per mutant).
    "narwhal/router/loadpoll.py": ("tests/test_loadpoll.py",),
    # What an engine's /metrics may say (its gauges' ranges, how cores combine), rule by
    # rule, and the client that reads it; how a fault is counted and logged.
    "narwhal/engines/metrics.py": ("tests/test_metrics_rules.py", "tests/test_engine_client.py"),
    "narwhal/engines/badinput.py": ("tests/test_engine_input.py::test_bad_input_is_counted_every_time_and_logged_once_a_minute",),
    # The token relay: streams through its loops and without it over loopback, every
    # hand-back cause, held to the same bytes and records; its C loop on socket pairs.
    "narwhal/router/relay.py": ("tests/test_token_relay.py", "tests/test_crelay.py"),
    # Request parsing and the answer's shapes, directly (the router tests that also reach
    # them take a minute a mutant).
    "narwhal/router/requests.py": ("tests/test_request_parsing.py", "tests/test_response_shapes.py"),
    # The live fleet's rules on a document's settings (changed paths, restart-only ones,
    # refusals naming the JSON path), directly; applying documents to a running router
    # by the reload suite's quick tests (not its load-level ones: a minute a mutant).
    "narwhal/router/fleet.py": (
        "tests/test_fleet_settings.py", "tests/test_fleet_reload.py",
        # What an engine's readiness, its leaving and new settings ask of the router's parts.
        "tests/test_fleet_engines.py",
        # All or nothing, make before break, per-model roles, linear work.
        "tests/test_fleet_reload_hostile.py", "tests/test_fleet_replace.py", "tests/test_fleet_scale.py",
        # What runs before and after a document is applied (DNS discovery's resolutions).
        "tests/test_discovery.py::test_a_reload_brings_a_group_and_refuses_one_that_cannot_resolve",
        "tests/test_discovery.py::test_a_failed_lookup_keeps_the_engines_and_an_empty_name_keeps_the_role",
        "tests/test_discovery.py::test_a_priced_router_follows_its_groups",
        "tests/test_discovery.py::test_the_router_does_not_wait_for_a_group_engine_whose_first_probe_failed",
        "--deselect=tests/test_fleet_reload.py::test_reload_under_load_drains_the_engine_serving_streams_and_adds_two",
        "--deselect=tests/test_fleet_reload.py::test_replacing_the_only_producer_under_load",
    ),
    # The background prefix copies against stand-ins (the end-to-end copy is one test).
    "narwhal/router/replicate.py": (
        "tests/test_replicate.py",
        "tests/test_prefix_replication.py::test_a_prefix_queued_on_the_fast_producer_is_copied_to_the_slow_one",
    ),
    # The index's own tests, the KV-event views' and the router's that price from it
    # (without the load-level comparison, twenty seconds a run).
    "narwhal/router/prefix.py": (
        "tests/test_prefix_index.py", "tests/test_kvevents.py", "tests/test_kvevents_stale.py",
        "tests/test_prefix_placement.py", "tests/test_prefix_replication.py", "tests/test_shared_kv.py",
        "--deselect=tests/test_prefix_placement.py::test_hit_aware_pricing_carries_a_shared_prefix_load_hit_blind_refuses",
        "--deselect=tests/test_prefix_replication.py::test_hit_aware_placement_carries_more_than_the_fast_producer_alone",
    ),
    # The cache plan's modules: their rules' unit tests, then the views block for block
    # against the simulated pool (the end-to-end runs of tests/test_cache_plan.py take
    # minutes each: left out).
    "narwhal/router/chains.py": ("tests/test_cache_views.py", "tests/test_prefix_index.py"),
    "narwhal/router/cacheviews.py": ("tests/test_cache_views.py", "tests/test_prefix_index.py"),
    "narwhal/router/cacheplan.py": ("tests/test_cache_plan_rules.py",),
    "narwhal/router/cachegroups.py": ("tests/test_cache_plan_rules.py",),
    "narwhal/router/choice.py": ("tests/test_cache_plan_rules.py",),
    "narwhal/router/cachecal.py": ("tests/test_cache_calibration.py", "tests/test_cache_plan_rules.py"),
    "narwhal/router/handoff.py": ("tests/test_cache_plan_rules.py",),
    "narwhal/router/quotes.py": ("tests/test_cache_plan_rules.py", "tests/test_prefix_placement.py::test_the_consumers_cached_blocks_only_break_ties"),
    # The router's prefix-cache tests: views made, dropped and cleared from the engines'
    # metrics, KV-event subscribers, stale streams (without the load-level comparisons).
    "narwhal/router/prefixwatch.py": (
        "tests/test_prefix_watch.py", "tests/test_prefix_placement.py", "tests/test_kvevents_stale.py",
        "tests/test_prefix_replication.py",
        "--deselect=tests/test_prefix_placement.py::test_hit_aware_pricing_carries_a_shared_prefix_load_hit_blind_refuses",
        "--deselect=tests/test_prefix_replication.py::test_hit_aware_placement_carries_more_than_the_fast_producer_alone",
    ),
    # The KV-event subscriber: the wire format, sequence following, replays and probes
    # (on the real clock: ZeroMQ delivers on its own thread).
    "narwhal/engines/kvevents.py": ("tests/test_kvevents.py", "tests/test_kvevents_stale.py"),
    # The reactive controller's rules directly (corrections, demand, the pressure model,
    # the decisions and their file), and end to end behind a router.
    "narwhal/router/controller.py": ("tests/test_controller_rules.py", "tests/test_reactive.py"),
    # DNS-discovered engine groups: resolution, expansion, fleet changes, max_engines.
    "narwhal/router/discovery.py": (
        "tests/test_discovery.py",
        "tests/test_fleet_scale.py::test_an_answer_larger_than_max_engines_adds_its_first_addresses",
    ),
    # What a document changes (settings diff with secrets redacted, restart-only paths).
    "narwhal/router/fleetdiff.py": ("tests/test_fleet_settings.py", "tests/test_fleet_reload_hostile.py"),
    # Who a request is (keys, the gateway's header, the class header), and admission: limits,
    # the queue's order, its deadlines (end to end on the simulated fleet).
    "narwhal/router/tenants.py": ("tests/test_tenants.py", "tests/test_admission.py"),
    "narwhal/router/admission.py": ("tests/test_admission.py", "tests/test_store_redis.py"),
    # The limits store's client: RESP replies read bounded, numbers only finite ones.
    "narwhal/router/store.py": ("tests/test_store_redis.py",),
    # The router's families fed from records and transitions, and the live gauges read at
    # scrape time, in direct tests; the admin surface's /metrics end to end.
    "narwhal/router/metrics.py": ("tests/test_observability.py",),
    # The client listener's routes: keys, /health, /v1/models, /metrics there when asked,
    # 404 and 405 (each a router in memory; not the whole router suite that reaches them).
    "narwhal/router/app.py": (
        "tests/test_security.py::test_api_keys", "tests/test_security.py::test_every_key_is_compared_in_constant_time",
        "tests/test_security.py::test_admin_routes_are_not_on_the_client_listener",
        "tests/test_router_basic.py::test_models_and_health", "tests/test_router_basic.py::test_bad_bodies_are_400",
        "tests/test_readiness.py::test_an_engine_down_at_start_is_named_and_health_says_unavailable",
        "tests/test_multimodel.py::test_a_model_is_listed_with_the_smallest_limit_of_its_engines",
        "tests/test_service.py::test_metrics_on_the_api_port_only_when_asked",
        "tests/test_service.py::test_metrics_on_the_api_port_take_the_api_key",
    ),
    # The state's own tests, and the router's that read it (readiness, models, counting).
    "narwhal/router/state.py": (
        "tests/test_router_state.py", "tests/test_readiness.py", "tests/test_multimodel.py",
        "tests/test_router_basic.py",
    ),
    # The writer's own rules (batching, overflow, close, the record's fields) in direct
    # tests; the router's journaling of requests by the ownership tests.
    "narwhal/router/journal.py": ("tests/test_journal.py", "tests/test_router_lifecycle.py"),
    # The combined admin surface of ``--workers N`` over loopback with stand-in workers,
    # and the combining rules' own tests (not the whole supervisor's: a process start each).
    "narwhal/router/fanin.py": (
        "tests/test_fanin.py",
        "tests/test_workers.py::test_expositions_combine_by_sum_except_the_state_gauges",
        "tests/test_kvevents_stale.py::test_workers_combine_a_stale_stream_as_stale",
        "tests/test_multimodel.py::test_workers_combine_the_model_gauges_as_states_not_sums",
    ),
    # Starting, reloading and stopping a router: its direct tests, the ownership tests and
    # the reload's refusals (the reload suite's load-level tests take a minute a run).
    "narwhal/router/service.py": (
        "tests/test_service.py", "tests/test_router_lifecycle.py",
        "tests/test_fleet_reload.py::test_a_document_that_fails_changes_nothing_and_says_where",
        "tests/test_fleet_reload.py::test_fleet_records_go_beside_the_journal",
    ),
    # The hub's fan-out in direct tests, and the admin surface's delivery of its events.
    "narwhal/router/events.py": (
        "tests/test_events.py",
        "tests/test_observability.py::test_events_deliver_a_record_and_a_breaker_transition",
    ),
    # Each admin route's answer (status, type, body, log line) in direct tests, and the
    # live events' and reload refusals' end-to-end tests.
    "narwhal/router/admin.py": (
        "tests/test_admin.py",
        "tests/test_observability.py::test_events_deliver_a_record_and_a_breaker_transition",
        "tests/test_observability.py::test_events_requires_websocket",
        "tests/test_fleet_reload.py::test_a_document_that_fails_changes_nothing_and_says_where",
    ),
}  # fmt: skip

#: mutmut's statuses that count as a killed mutant.
KILLED = ("killed", "timeout", "caught by type check")


def _copy_tree(source: Path, dest: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=source, check=True, capture_output=True, text=True
    ).stdout.split("\n")
    # and the extensions built in place (ignored by git): the token relay's C loop, so
    # that its tests run it rather than skip to the Python loop.
    built = [str(p.relative_to(source)) for p in source.glob("narwhal/**/*.so")]
    for name in filter(None, [*files, *built]):
        src = source / name
        if src.is_file() or src.is_symlink():
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out, follow_symlinks=False)


def _configure(tree: Path, module: str, tests: tuple[str, ...]) -> None:
    cfg = configparser.ConfigParser()
    cfg.read(tree / "setup.cfg")
    if not cfg.has_section("mutmut"):
        cfg.add_section("mutmut")
    cfg.set("mutmut", "source_paths", "narwhal")
    cfg.set("mutmut", "only_mutate", "\n" + module)
    cfg.set("mutmut", "also_copy", "\nconfig\nfixtures")
    # Test files or tests (``FILE::TEST``) of files present, and pytest options
    # (``--deselect=FILE::TEST`` keeps a slow test of a selected file out of every mutant's run).
    present = [t for t in tests if t.startswith("-") or (tree / t.split("::")[0]).exists()]
    cfg.set("mutmut", "pytest_add_cli_args_test_selection", "\n" + "\n".join(present))
    with open(tree / "setup.cfg", "w") as f:
        cfg.write(f)


def _results(tree: Path, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    statuses = {}
    for line in out.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            statuses[name] = status
    return statuses


def _diffs(tree: Path, module: str, names: list[str]) -> dict[str, str]:
    """Each mutant's changed lines, read from mutmut's mutated copy of the module (one
    ``mutmut show`` per mutant costs seconds of start-up)."""
    source = (tree / "mutants" / module).read_text()
    # Sliced by line numbers: ast.get_source_segment rescans the source for each of
    # the module's hundreds of functions (minutes for lifecycle.py's).
    lines = source.splitlines()
    functions = {
        node.name: "\n".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    out = {}
    for name in names:
        short = name.rsplit(".", 1)[-1]
        orig_name = short.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
        # The def lines differ by the function's name: blank it, so that a mutated
        # default argument still shows.
        original = functions.get(orig_name, "").replace(orig_name, "…", 1).splitlines()
        mutant = functions.get(short, "").replace(short, "…", 1).splitlines()
        out[name] = "\n".join(
            line for line in difflib.unified_diff(original, mutant, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        )
    return out


def run_module(
    source: Path, module: str, children: int, survivors: bool, only: tuple[str, ...] = (),
    tests: tuple[str, ...] = (),
) -> tuple[int, int, float, str | None]:
    """Mutate one module (only the mutants whose names match a glob of ``only``, when
    given) with its tests (or ``tests``, when given); (killed, total, seconds, why the
    run failed or None)."""
    with tempfile.TemporaryDirectory(prefix="narwhal-mutation-") as scratch:
        tree = Path(scratch)
        _copy_tree(source, tree)
        _configure(tree, module, tests or MODULES[module])
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(tree)
        t0 = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *only],
            cwd=tree, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        elapsed = time.monotonic() - t0
        statuses = {
            n: st for n, st in _results(tree, env).items() if not only or any(fnmatch.fnmatch(n, g) for g in only)
        }
        diffs = _diffs(tree, module, [n for n, st in statuses.items() if survivors and st not in KILLED])
    counts = Counter(statuses.values())
    killed = sum(counts[s] for s in KILLED)
    total = sum(counts[s] for s in counts if s not in ("skipped", "not checked"))
    failure = None
    if run.returncode != 0:
        failure = f"mutmut run exited {run.returncode}:\n{(run.stdout + run.stderr)[-3000:]}"
    elif not total:
        failure = f"no mutant checked ({len(statuses)} generated{', matching --only' if only else ''})"
    detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    print(f"{module}: {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%) in {elapsed:.0f} s [{detail}]", flush=True)
    by_function: dict[str, list[int]] = {}
    for name, status in statuses.items():
        if status not in ("skipped", "not checked"):
            tally = by_function.setdefault(name.rsplit(".", 1)[-1].rsplit("__mutmut_", 1)[0], [0, 0])
            tally[0] += status in KILLED
            tally[1] += 1
    for function, (k, t) in sorted(by_function.items()):
        print(f"    {function}: {k}/{t}")
    if survivors:
        for name, status in sorted(statuses.items()):
            if status not in KILLED:
                print(f"    {status}: {name}")
                for line in diffs.get(name, "").splitlines():
                    print(f"        {line}")
    return killed, total, elapsed, failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help=f"modules to mutate (default: {', '.join(MODULES)})")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the checkout to mutate (default: this one)")
    parser.add_argument("--children", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--survivors", action="store_true", help="list every mutant not killed")
    parser.add_argument(
        "--only", action="append", default=[], metavar="GLOB",
        help="mutate only the functions whose mutant names match (e.g. '*_may_retry*'); repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--tests", action="append", default=[], metavar="PATH",
        help="run these tests instead of the module's selection (a part of it: a mutant they "
             "kill, the whole selection kills too); repeatable",
    )  # fmt: skip
    args = parser.parse_args(argv)
    modules = args.modules or list(MODULES)
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        parser.error(f"no test selection for {', '.join(unknown)} (known: {', '.join(MODULES)})")
    killed = total = 0
    failed: list[str] = []
    for module in modules:
        k, t, _, failure = run_module(args.tree.resolve(), module, args.children, args.survivors, tuple(args.only),
                                      tuple(args.tests))  # fmt: skip
        killed += k
        total += t
        if failure is not None:
            failed.append(f"{module}: {failure}")
    if len(modules) > 1:
        print(f"all: {killed}/{total} killed ({100 * killed / max(total, 1):.1f}%)")
    for line in failed:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
