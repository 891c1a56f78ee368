"""The preflight (``narwhal check``): is this fleet ready to serve, and what can it hold?

:func:`run_check` checks the fleet document, every engine's reachability and the
pinned engine contract, that every model has a reachable producer and consumer, Gate F and the decode fit limits of the profile pair, and a
KV transfer for every role-permitted (producer, consumer) pair of one model; it returns a
:class:`CheckReport` of :class:`CheckResult`\\ s. :func:`write_record` retains a
passing report as a deployment record, :func:`load_record` reads one back verified,
and :func:`record_matches` tells whether it was made for a given fleet document.
:func:`suggest_slo` prices prefill/decode splits for a workload from the profiles::

    report = await run_check("config/fleet.json")
    if report.ok:
        write_record(report, "runs/deployment/record")
    for failure in report.failures:
        print(failure.line())
"""

from __future__ import annotations

from narwhal.check.checks import (
    FleetInput,
    check_contract,
    check_stable,
    load_fleet_input,
    open_clients,
    read_identities,
    run_check,
)
from narwhal.check.gate import (
    MIN_AXIS_POINTS,
    GateOutcome,
    axis_points,
    check_fit_limits,
    check_margin,
    find_refit_original,
    gate_f,
    load_pair,
    reprofile_hint,
    verify_samples,
)
from narwhal.check.pools import check_pools, engine_models
from narwhal.check.probes import pair_name, probe_pair, probe_transfers, role_pairs
from narwhal.check.record import (
    INDEX,
    RECORD_KIND,
    RECORD_SCHEMA,
    DeploymentRecord,
    RecordError,
    fleet_sha256,
    load_record,
    record_matches,
    write_record,
)
from narwhal.check.results import (
    FLEET,
    CheckReport,
    CheckResult,
    ProfilePair,
    format_value,
    jsonable,
)
from narwhal.check.simulate import SimulatedRun, simulate_split, ttft_of
from narwhal.check.suggest import (
    Pressures,
    SLOSuggestion,
    SuggestWorkload,
    decode_tier,
    load_workload,
    prefill_tier,
    suggest_slo,
)

__all__ = [
    "FLEET",
    "INDEX",
    "MIN_AXIS_POINTS",
    "RECORD_KIND",
    "RECORD_SCHEMA",
    "CheckReport",
    "CheckResult",
    "DeploymentRecord",
    "FleetInput",
    "GateOutcome",
    "Pressures",
    "ProfilePair",
    "RecordError",
    "SLOSuggestion",
    "SimulatedRun",
    "SuggestWorkload",
    "axis_points",
    "check_contract",
    "check_fit_limits",
    "check_margin",
    "check_pools",
    "check_stable",
    "decode_tier",
    "engine_models",
    "find_refit_original",
    "fleet_sha256",
    "format_value",
    "gate_f",
    "jsonable",
    "load_fleet_input",
    "load_pair",
    "load_record",
    "load_workload",
    "open_clients",
    "pair_name",
    "prefill_tier",
    "probe_pair",
    "probe_transfers",
    "read_identities",
    "record_matches",
    "reprofile_hint",
    "role_pairs",
    "run_check",
    "simulate_split",
    "suggest_slo",
    "ttft_of",
    "verify_samples",
    "write_record",
]
