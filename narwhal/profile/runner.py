"""One profiling run: every selected engine in turn, then the profile pair.

Engines are profiled one at a time (each on an otherwise idle fleet) in fleet order.
Per engine: its generation (``EngineClient.identity``), what it reports (context
limit, cache configuration), the prefill sweep and TTFT fit (a rejected curve stops
that engine before any decode profiling), the decode cohort sweep and NNLS fit, the KV
capacity, and its generation again: an engine that restarted mid-sweep has samples
from two processes and is failed. An engine that fails or is rejected keeps its
samples in the sidecar; the others go on.
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import attrs
import httpx
import trio

from narwhal import __version__
from narwhal.config import EngineConfig, FleetConfig, ProfilesConfig, converter
from narwhal.engines.client import EngineClient
from narwhal.errors import ConfigError, EngineError
from narwhal.profile.burst import burst_probe, median_gap, queue_verdict
from narwhal.profile.cohort import StreamLimits
from narwhal.profile.derive import (
    decode_cells,
    derive_cached,
    derive_decode,
    derive_profile,
    derive_ttft,
    kv_capacity,
    prefill_repeats,
    prefix_repeats,
    ttft_curve,
)
from narwhal.profile.fit import (
    DEFAULT_MAX_MEAN_ERROR,
    DEFAULT_MAX_WORST_ERROR,
    MIN_PREFILL_LENGTHS,
)
from narwhal.profile.progress import Progress
from narwhal.profile.store import (
    SAMPLES_KIND,
    SCHEMA_VERSION,
    EngineProfile,
    Profiles,
    SamplesRef,
    TTFTCurve,
    file_sha256,
    load_profiles,
    pair_paths,
    read_json,
    write_json,
)
from narwhal.profile.sweep import (
    CODE_TOKENS,
    EngineFacts,
    PromptFactory,
    SweepRejected,
    bounded,
    cell_summary,
    decode_sweep,
    plan_prefix_cells,
    prefill_sweep,
    prefix_sweep,
    probe_engine,
)

__all__ = [
    "EngineOutcome",
    "ProfileRun",
    "ProfileSettings",
    "check_output",
    "run_profile",
    "select_engines",
    "software_identity",
]

Status = Literal["ok", "rejected", "failed"]


# The validators' factories run once, when the class is defined; their checks are
# module functions so that what each check does is tested (and mutated) on every call.
def _lens(minimum: int, what: str, floor: int) -> Any:
    return lambda _inst, _attr, value: _check_lens(value, minimum, what, floor)  # pragma: no mutate (unreachable: runs at class definition, before a mutant is active; the check is tested)


def _check_lens(value: tuple[int, ...], minimum: int, what: str, floor: int) -> None:
    if len(set(value)) < minimum:
        raise ValueError(f"{what} needs at least {minimum} distinct values")
    if any(v < floor for v in value):
        raise ValueError(f"{what} values must be at least {floor}")


def _fractions(_inst: Any, _attr: attrs.Attribute[Any], value: tuple[float, ...]) -> None:
    if any(not 0 < f < 1 for f in value):
        raise ValueError("prefix-fractions values must lie strictly between 0 and 1")


def _burst(_inst: Any, _attr: attrs.Attribute[Any], value: int) -> None:
    if value == 1 or value < 0:
        raise ValueError("queue-burst must be 0 (no burst probe) or at least 2")


def _shared_prefix(inst: ProfileSettings, _attr: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise ValueError("decode-shared-prefix must be 0 (prompts unique from their start) or more")
    shortest = min(inst.decode_input_lens)
    if value and value > shortest - CODE_TOKENS:
        raise ValueError(f"decode-shared-prefix {value} leaves the shortest decode input ({shortest} tokens) "
                         f"fewer than {CODE_TOKENS} tokens of its own")  # fmt: skip


def _at_least(floor: int) -> Any:
    return lambda _inst, attr, value: _check_at_least(value, floor, attr)  # pragma: no mutate (unreachable: runs at class definition, before a mutant is active; the check is tested)


def _check_at_least(value: int, floor: int, attr: attrs.Attribute[Any]) -> None:
    if value < floor:
        raise ValueError(f"{attr.name.replace('_', '-')} must be at least {floor}")


@attrs.frozen(kw_only=True)
class ProfileSettings:
    """What to sweep and where to write (the CLI's options).

    Attributes:
        prefill_lens: prompt lengths of the prefill sweep (at least four: every
            leave-one-length-out fold keeps three for the three coefficients).
        decode_input_lens: prompt lengths of the decode sweep (at least two).
        decode_concurrency: streams per decode cell (at least two values).
        repeats: measured prefill requests per length.
        warmup: unrecorded prefill requests per length before measuring.
        decode_tokens: decode steps each cell aims to keep the whole cohort resident.
        min_window_steps: fewest steps with the whole cohort resident for a cell to count.
        engines: engine names to profile (None: all, in fleet order).
        out: the profiles file; its sidecar is written beside it.
        overwrite: replace an existing pair.
        max_mean_error / max_worst_error: TTFT fit bounds.
        seed: seed of the prompts (None: random, recorded in the sidecar).
        accept_rejected_cells: an engine some of whose decode cells were rejected still
            counts as a success (the rejected cells stay listed in the sidecar).
        prefix_fractions: the cached-prefix sweep's cached share of each prefill length
            (rounded down to whole blocks), on engines that report prefix caching; empty
            skips that sweep.
        queue_burst: prompts sent at once in each of ``repeats`` bursts to a prefilling
            engine, to tell whether it computes its waiting prompts together
            (:mod:`narwhal.profile.burst`); 0 skips the probe.
        decode_shared_prefix: on engines that report prefix caching, every prompt of a
            decode cell starts with the same this many tokens (computed once before the
            cohort), so that the sweep reaches the resident KV of streams that share a
            prefix, beyond what the engine holds; 0: prompts unique from their start.
    """

    prefill_lens: tuple[int, ...] = attrs.field(
        converter=tuple, validator=_lens(MIN_PREFILL_LENGTHS, "prefill-lens", CODE_TOKENS)
    )
    decode_input_lens: tuple[int, ...] = attrs.field(
        converter=tuple, validator=_lens(2, "decode-input-lens", CODE_TOKENS)
    )
    decode_concurrency: tuple[int, ...] = attrs.field(
        converter=tuple, validator=_lens(2, "decode-concurrency", 1)
    )
    repeats: int = attrs.field(default=5, validator=_at_least(1))
    warmup: int = attrs.field(default=1, validator=_at_least(0))
    decode_tokens: int = attrs.field(default=32, validator=_at_least(2))
    min_window_steps: int = attrs.field(default=8, validator=_at_least(1))
    engines: tuple[str, ...] | None = None
    out: str = "runs/profiles.json"
    overwrite: bool = False
    max_mean_error: float = DEFAULT_MAX_MEAN_ERROR
    max_worst_error: float = DEFAULT_MAX_WORST_ERROR
    seed: int | None = None
    accept_rejected_cells: bool = False
    prefix_fractions: tuple[float, ...] = attrs.field(default=(0.25, 0.5, 0.875), converter=tuple,
                                                      validator=_fractions)
    queue_burst: int = attrs.field(default=4, validator=_burst)
    decode_shared_prefix: int = attrs.field(default=0, validator=_shared_prefix)


@attrs.frozen
class EngineOutcome:
    """How one engine's profiling ended.

    Attributes:
        rejected_cells: decode cells measured but rejected, with the reason (the profile
            was fitted without them).
        accepted: whether the outcome counts as a success (``ok`` and either no rejected
            cells or ``accept_rejected_cells``).
    """

    name: str
    status: Status
    reason: str | None = None
    profile: EngineProfile | None = None
    rejected_cells: tuple[str, ...] = ()
    accepted: bool | None = None

    @property
    def success(self) -> bool:
        return self.accepted if self.accepted is not None else self.status == "ok"


@attrs.frozen
class ProfileRun:
    """The pair written and each engine's outcome.

    Attributes:
        wrote_profiles: whether the profiles file was written: not when no engine has a
            profile (the samples alone were, with what failed), since serve and check
            have nothing to use.
    """

    profiles_path: Path
    samples_path: Path
    outcomes: tuple[EngineOutcome, ...]
    wrote_profiles: bool = True

    @property
    def ok(self) -> bool:
        return self.wrote_profiles and all(o.success for o in self.outcomes)


def software_identity() -> dict[str, str]:
    """Versions of the profiler and the libraries its numbers depend on."""
    out = {"narwhal": __version__, "python": platform.python_version()}
    for package in ("numpy", "scipy", "trio", "httpx"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:  # pragma: no cover - installed with narwhal
            out[package] = "unknown"  # pragma: no mutate (unreachable: installed with narwhal, as the line above says)
    return out


def calibration_problem(concurrency: Sequence[int]) -> str | None:
    """Why these decode concurrency points fall short of the seed's production
    calibration rule (at least three points, including 1), or None."""
    points = sorted(set(concurrency))
    if len(points) < 3 or points[0] != 1:
        return (f"decode concurrency {','.join(map(str, points))}: production calibration "
                "needs at least three concurrency points including 1 (the seed's rule)")  # fmt: skip
    return None


def decode_fit_warnings(fit_mape: float, cv_mape: float, limits: ProfilesConfig) -> list[str]:
    """The decode fit's errors beyond the limits narwhal check applies (at a limit passes)."""
    out = []
    if fit_mape > limits.max_decode_fit_mape:
        out.append(f"decode fit MAPE {fit_mape:.1%} exceeds profiles.max_decode_fit_mape "
                   f"{limits.max_decode_fit_mape:.1%}; narwhal check will refuse it")  # fmt: skip
    if cv_mape > limits.max_decode_cv_mape:
        out.append(f"leave-one-cell-out MAPE {cv_mape:.1%} exceeds profiles.max_decode_cv_mape "
                   f"{limits.max_decode_cv_mape:.1%}; narwhal check will refuse it")  # fmt: skip
    return out


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def select_engines(config: FleetConfig, names: Sequence[str] | None) -> list[EngineConfig]:
    """The engines to profile, in fleet order.

    Raises:
        ConfigError: a name is not in the fleet.
    """
    if names is None:
        return list(config.engines)
    known = {e.name for e in config.engines}
    for name in names:
        if name not in known:
            raise ConfigError(f"no engine named {name!r} in the fleet (engines: "
                              f"{', '.join(sorted(known))})", path="$.engines")  # fmt: skip
    return [e for e in config.engines if e.name in set(names)]


def check_output(out: str | os.PathLike[str], *, overwrite: bool) -> tuple[Path, Path]:
    """The pair's paths; refuses an existing pair unless ``overwrite``.

    Raises:
        ConfigError: a file of the pair exists and ``overwrite`` is false.
    """
    profiles, samples = pair_paths(out)
    if not overwrite:
        existing = [str(p) for p in (profiles, samples) if p.exists()]
        if existing:
            raise ConfigError(f"{' and '.join(existing)} already exist; pass --overwrite to "
                              "write a new pair")  # fmt: skip
    return profiles, samples


#: Bits of a random prompt seed (recorded in the sidecar, so any width reproduces alike).
_SEED_BITS = 32

#: How the sidecar's ``wall_clock`` stamps are taken.
SWEEP_CLOCK = "Unix seconds: the wall clock read once, advanced by the run's own clock"
_EPOCH: trio.lowlevel.RunVar[float] = trio.lowlevel.RunVar("narwhal_sweep_epoch")


def sweep_clock() -> float:
    """Unix time on the run's clock: the wall clock read at the first call of this
    Trio run, advanced by Trio's clock since (monotonic in production, so a wall-clock
    step during a sweep does not skew it; virtual in tests, where the simulated engines'
    process start times follow virtual time too)."""
    try:
        epoch = _EPOCH.get()
    except LookupError:
        epoch = time.time() - trio.current_time()
        _EPOCH.set(epoch)
    return epoch + trio.current_time()


class _EngineRun:
    """Profiles one engine, recording into its sidecar entry as it goes."""

    def __init__(self, client: EngineClient, config: FleetConfig, settings: ProfileSettings,
                 record: dict[str, Any], seed: int, progress: Progress,
                 roles: Sequence[str] = ("prefill", "decode")) -> None:  # fmt: skip
        self.client, self.config, self.settings = client, config, settings
        self.record, self.seed, self.progress = record, seed, progress
        self.roles = tuple(roles)
        self.rejected_cells: list[str] = []

    def warn(self, text: str) -> None:
        self.record["warnings"].append(text)
        self.progress.warn(self.client.name, text)

    async def run(self) -> EngineProfile:
        client, settings, record, name = self.client, self.settings, self.record, self.client.name
        timeouts = self.config.engine
        limit = timeouts.request_timeout_s
        record["wall_clock"] = {"started_at": sweep_clock(), "clock": SWEEP_CLOCK}
        identity = await bounded(client, limit, "its identity", client.identity)
        record["identity"] = attrs.asdict(identity)
        if identity.process_start_time is None:
            self.warn("the engine exports no process_start_time_seconds (Prometheus multiprocess "
                      "mode drops process_* metrics): its generation is unknown, and narwhal "
                      "check will refuse to bind this profile to it")  # fmt: skip
        facts = await bounded(client, limit, "/tokenize and /metrics", probe_engine, client)
        record["engine"] = facts.as_dict()
        if facts.metrics_error is not None:
            self.warn(f"/metrics unreadable ({facts.metrics_error}); KV capacity and prefix "
                      "caching unknown")  # fmt: skip
        prompt = PromptFactory(
            client, seed=self.seed, tokens_per_word=facts.tokens_per_word, timeout_s=limit
        )

        prefill: dict[str, Any] = {}
        record["prefill"] = prefill
        await prefill_sweep(
            client, facts, settings.prefill_lens, prefill, repeats=settings.repeats,
            warmup=settings.warmup, prompt=prompt, timeout_s=timeouts.request_timeout_s,
            progress=self.progress, engine_time=facts.metrics_error is None,
        )  # fmt: skip
        ttft = derive_ttft(prefill_repeats(record, f"$.engines.{name}"))  # pragma: no mutate (equivalent: the path names a malformed record in an error; the runner reads back its own)
        tfit = ttft.fit
        prefill["fit"] = tfit.as_dict()
        prefill["intervals"] = ttft.intervals.as_dict()
        rejection = ttft.rejection(max_mean_error=settings.max_mean_error,
                                   max_worst_error=settings.max_worst_error)  # fmt: skip
        if rejection is not None:
            prefill["rejection"] = rejection
            raise SweepRejected(f"TTFT fit rejected before decode profiling: {rejection}")
        self.progress.line(name, f"prefill fit: TTFT = {tfit.a:.4g} + {tfit.b:.4g}*L + "
                                 f"{tfit.c:.4g}*L^2 s (mean error {tfit.mean_error:.1%}, "
                                 f"worst {tfit.worst_error:.1%}; leave-one-length-out mean "
                                 f"{tfit.loo_mean_error:.1%}, worst {tfit.loo_worst_error:.1%})")  # fmt: skip

        await self._queue(ttft_curve(ttft), prompt)
        await self._prefix(facts, prompt)

        if "decode" in self.roles:
            await self._decode(facts, prompt)
        else:
            record["decode"] = {"skipped": "the engine's roles do not include decode"}
            self.progress.line(name, "decode: skipped (prefill-only engine)")

        after = await bounded(client, limit, "its identity", client.identity)
        record["identity_after"] = attrs.asdict(after)
        record["wall_clock"]["finished_at"] = sweep_clock()
        if after != identity:
            changed = (f"engine {name} changed generation during the sweep ({identity} -> {after}); "
                       "its samples span two processes")  # fmt: skip
            raise EngineError(changed, engine=name, leg="profile")  # pragma: no mutate (equivalent: the run reads only the error's message)
        # The profile is derived from the recorded samples, exactly as narwhal check
        # derives it again: one path from raw data to figures.
        try:
            profile = derive_profile(record, name)
        except ConfigError as exc:
            raise SweepRejected(f"the samples give no profile: {exc}") from None
        record["profile"] = converter.unstructure(profile)
        return profile

    async def _queue(self, curve: TTFTCurve, prompt: PromptFactory) -> None:
        """The burst probe (:mod:`narwhal.profile.burst`) at the shortest swept length,
        on an engine that prefills."""
        client, settings, record, name = self.client, self.settings, self.record, self.client.name
        if "prefill" not in self.roles:
            record["prefill_queue"] = {"skipped": "the engine's roles do not include prefill"}
            return
        if settings.queue_burst == 0:
            record["prefill_queue"] = {"skipped": "no --queue-burst"}
            return
        length = curve.min_length
        queue: dict[str, Any] = {}
        record["prefill_queue"] = queue
        await burst_probe(client, length, queue, prompts=settings.queue_burst, bursts=settings.repeats,
                          prompt=prompt, timeout_s=self.config.engine.request_timeout_s,
                          progress=self.progress)  # fmt: skip
        gap, one = median_gap(queue["bursts"]), curve.predict(length)
        self.progress.line(name, f"prefill queue: {queue_verdict(queue['bursts'], one)} (answers of "
                                 f"{settings.queue_burst} {length}-token prompts sent at once came a "
                                 f"median {gap * 1e3:.2f} ms apart; one prefill takes {one * 1e3:.2f} ms)")  # fmt: skip

    def _prefix_cells(self, facts: EngineFacts) -> tuple[int, list[tuple[int, int]]] | str:
        """The block size and the ``(length, cached)`` cells of the cached-prefix sweep,
        or why the sweep is skipped."""
        settings = self.settings
        if facts.prefix_caching is not True:
            return "the engine does not report prefix caching enabled"
        if facts.block_size is None:
            return "the engine reports no block_size in vllm:cache_config_info"
        if "prefill" not in self.roles:
            return "the engine's roles do not include prefill"
        if not settings.prefix_fractions:
            return "no --prefix-fractions"
        cells = plan_prefix_cells(settings.prefill_lens, settings.prefix_fractions,
                                  block_size=facts.block_size, max_model_len=facts.max_model_len)  # fmt: skip
        if not cells:
            return f"no prefill length holds a cached prefix of whole {facts.block_size}-token blocks"
        return facts.block_size, cells

    async def _prefix(self, facts: EngineFacts, prompt: PromptFactory) -> None:
        """The cached-prefix sweep and fit, on an engine that reports prefix caching.

        A rejected fit (or one the cells cannot support) leaves the engine profiled
        without a cached-prefix model: placement then prices hits from the TTFT curve.
        """
        client, settings, record, name = self.client, self.settings, self.record, self.client.name
        plan = self._prefix_cells(facts)
        if isinstance(plan, str):
            record["prefix"] = {"skipped": plan}
            if facts.prefix_caching:
                self.warn(f"the engine reports prefix caching enabled but its cached-prefix sweep "
                          f"was skipped ({plan}): placement prices its hits from the TTFT "
                          "curve alone")  # fmt: skip
            return
        block_size, cells = plan
        prefix: dict[str, Any] = {"block_size": block_size,
                                  "fractions": list(settings.prefix_fractions)}  # fmt: skip
        record["prefix"] = prefix
        await prefix_sweep(client, cells, prefix, repeats=settings.repeats, prompt=prompt,
                           timeout_s=self.config.engine.request_timeout_s, progress=self.progress,
                           engine_time=facts.metrics_error is None)  # fmt: skip
        # Fitted from what the sweep recorded, as narwhal check fits it again.
        where = f"$.engines.{name}"  # pragma: no mutate (equivalent: the path names a malformed record in an error; the runner reads back its own)
        recorded = prefix_repeats(record, where)  # pragma: no mutate (equivalent: likewise)
        assert recorded is not None
        try:
            derived = derive_cached(prefill_repeats(record, where), recorded[1], block_size)  # pragma: no mutate (equivalent: the path likewise; the block size reaches only the stored model, which derive_profile builds)
        except ValueError as exc:
            prefix["rejection"] = str(exc)
            self.warn(f"cached-prefix fit impossible: {exc}; placement prices hits from the TTFT curve")
            return
        fit = derived.fit
        prefix["fit"] = fit.as_dict()
        prefix["intervals"] = derived.intervals.as_dict()
        rejection = derived.rejection()
        self.progress.line(name, f"prefix fit: TTFT = {fit.a:.4g} + {fit.b:.4g}*(L-k) + "
                                 f"{fit.c:.4g}*(L^2-k^2) + {fit.d:.4g}*k s (mean error "
                                 f"{fit.mean_error:.1%}, worst {fit.worst_error:.1%}; "
                                 f"leave-one-cell-out mean {fit.loo_mean_error:.1%}, worst "
                                 f"{fit.loo_worst_error:.1%})")  # fmt: skip
        if rejection is not None:
            prefix["rejection"] = rejection
            self.warn(f"cached-prefix fit rejected ({rejection}); placement prices hits from the "
                      "TTFT curve")  # fmt: skip

    async def _decode(self, facts: EngineFacts, prompt: PromptFactory) -> None:
        client, settings, record, name = self.client, self.settings, self.record, self.client.name
        timeouts = self.config.engine
        decode: dict[str, Any] = {}
        record["decode"] = decode
        calibration = calibration_problem(settings.decode_concurrency)
        if calibration is not None:
            self.warn(calibration)
        # A silence deadline of 0 means none (as on the router's decode leg): the request
        # deadline bounds the wait between tokens.
        silence = timeouts.decode_read_timeout_s or timeouts.request_timeout_s
        limits = StreamLimits(first_token_s=timeouts.first_token_timeout_s,
                              between_tokens_s=silence)  # fmt: skip
        shared = settings.decode_shared_prefix
        if shared and not facts.prefix_caching:
            self.warn(f"--decode-shared-prefix {shared}: the engine does not report prefix caching; "
                      "its decode cells use prompts unique from their start")  # fmt: skip
            shared = 0
        await decode_sweep(
            client, facts, settings.decode_input_lens, settings.decode_concurrency, decode,
            decode_tokens=settings.decode_tokens, min_window_steps=settings.min_window_steps,
            prompt=prompt, limits=limits, progress=self.progress, shared_prefix=shared,
        )  # fmt: skip
        decode["cell_medians"] = cell_summary(decode["cells"])
        rejected = [c for c in decode["cells"] if not c["kept"]]
        if rejected:
            self.rejected_cells = [f"input {c['input_len']} x {c['concurrency']} streams: "
                                   f"{c['reason']}" for c in rejected]  # fmt: skip
        for c in decode["cells"]:
            if c.get("saturation"):
                self.warn(f"decode cell input {c['input_len']} x {c['concurrency']} streams: "
                          f"{c['saturation']}")  # fmt: skip
        # Fitted from the recorded cells, as narwhal check fits them again.
        try:
            derived = derive_decode(decode_cells(record, f"$.engines.{name}"))  # pragma: no mutate (equivalent: the path names a malformed record in an error; the runner reads back its own)
        except ValueError as exc:  # the kept cells cannot support a fit
            decode["rejection"] = str(exc)
            raise SweepRejected(f"decode fit impossible: {exc}; select shorter "
                                "--decode-input-lens or fewer streams") from None  # fmt: skip
        dfit = derived.fit
        decode["fit"] = dfit.as_dict()
        decode["intervals"] = derived.intervals.as_dict()
        self.progress.line(name, f"decode fit: TPOT = {dfit.c0:.4g} + {dfit.c1:.4g}*active + "
                                 f"{dfit.c2:.4g}*kv s (fit MAPE {dfit.fit_mape:.1%}, "
                                 f"leave-one-cell-out {dfit.cv_mape:.1%})")  # fmt: skip
        for text in decode_fit_warnings(dfit.fit_mape, dfit.cv_mape, self.config.profiles):
            self.warn(text)
        record["kv_capacity_inputs"] = {"tpot_target_s": self.config.controller.slo.tpot_s}
        capacity = kv_capacity(facts.kv_cache_size_tokens, dfit, measured_kv_max=derived.kv_max,
                               tpot_target_s=self.config.controller.slo.tpot_s)  # fmt: skip
        record["kv_capacity"] = converter.unstructure(capacity)
        if capacity.source == "measured":
            self.warn(f"KV capacity unknown: the engine reports no kv_cache_size_tokens and no "
                      f"TPOT target bounds it; {capacity.tokens} tokens is only the largest "
                      "resident KV measured (placement prices beyond it conservatively)")  # fmt: skip


def _clients(
    stack: AsyncExitStack,
    config: FleetConfig,
    engines: Sequence[EngineConfig],
    transport: httpx.AsyncBaseTransport | None,
) -> dict[str, EngineClient]:
    connect = config.engine.connect_timeout_s
    shared: httpx.AsyncClient | None = None
    if transport is not None:
        # The caller owns the transport: one client over it, never closed here.
        shared = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(None, connect=connect)
        )
    out: dict[str, EngineClient] = {}
    for e in engines:
        client = EngineClient(e.url, name=e.name, model=e.model, connector=e.connector,
                              api_key=e.api_key, http_client=shared,
                              connect_timeout_s=connect)  # fmt: skip
        if shared is None:
            stack.push_async_callback(client.aclose)
        out[e.name] = client
    return out


def sweep_settings(settings: ProfileSettings, seed: int) -> dict[str, Any]:
    """What was swept, as the sidecar records it (per run and per engine)."""
    sweep = attrs.asdict(settings) | {"seed": seed}
    for key in ("out", "overwrite", "engines"):
        sweep.pop(key)
    return sweep


def _samples_doc(config_source: str | None, settings: ProfileSettings, seed: int,
                 engines: dict[str, Any], profiles_name: str) -> dict[str, Any]:  # fmt: skip
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": SAMPLES_KIND,
        "created_at": now_iso(),
        "software": software_identity(),
        "fleet": {"source": config_source, "engines": list(engines)},
        "sweep": sweep_settings(settings, seed) | {"clock": "seconds on the profiler's monotonic clock"},
        "profiles": profiles_name,
        "engines": engines,
    }


def write_pair(profiles_path: Path, samples_path: Path, samples: dict[str, Any],
               outcomes: Sequence[EngineOutcome], *, refit_of: str | None = None) -> bool:  # fmt: skip
    """Write the sidecar, then the profiles file naming it with its SHA-256; returns
    whether the profiles file was written.

    When no engine has a profile, only the sidecar is written (what was measured, and
    why each engine failed) and a profiles file already at ``profiles_path`` (one an
    overwrite replaces: it names the sidecar written over) is removed: a profiles file
    with no profile would price nothing, and serve and check refuse one.
    """
    write_json(samples_path, samples)
    if not any(o.profile is not None for o in outcomes):
        profiles_path.unlink(missing_ok=True)
        return False
    doc = Profiles(
        schema_version=SCHEMA_VERSION,
        created_at=samples["created_at"],
        software=software_identity(),
        samples=SamplesRef(path=samples_path.name, sha256=file_sha256(samples_path)),
        engines={o.name: o.profile for o in outcomes if o.profile is not None},
        excluded={o.name: f"{o.status}: {o.reason}" for o in outcomes if o.profile is None},
        refit_of=refit_of,
    )
    write_json(profiles_path, doc.to_json())
    return True


async def run_profile(
    config: FleetConfig,
    settings: ProfileSettings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Progress | None = None,
    config_source: str | None = None,
) -> ProfileRun:
    """Profile the selected engines and write the pair.

    Args:
        config: the fleet document.
        settings: what to sweep and where to write.
        transport: an httpx transport to reach the engines (tests: a simulated fleet's
            in-memory transport); real sockets when omitted.
        progress: where progress goes (default: stderr).
        config_source: the fleet document's name, recorded in the sidecar.

    Raises:
        ConfigError: an unknown engine, or an existing pair without ``overwrite``.
    """
    progress = progress if progress is not None else Progress()
    selected = select_engines(config, settings.engines)
    profiles_path, samples_path = pair_paths(settings.out)
    merging = (settings.engines is not None and not settings.overwrite
               and (profiles_path.exists() or samples_path.exists()))  # fmt: skip
    kept: dict[str, Any] = {}
    kept_outcomes: list[EngineOutcome] = []
    merged_from: dict[str, Any] | None = None
    if merging:
        kept, kept_outcomes, merged_from = _existing_pair(profiles_path, {e.name for e in selected})
    else:
        check_output(settings.out, overwrite=settings.overwrite)
    seed = settings.seed if settings.seed is not None else secrets.randbits(_SEED_BITS)
    records: dict[str, Any] = dict(kept)
    outcomes: list[EngineOutcome] = []

    def samples_doc() -> dict[str, Any]:
        doc = _samples_doc(config_source, settings, seed, records, profiles_path.name)
        if merged_from is not None:
            doc["merged"] = merged_from
        return doc

    async with AsyncExitStack() as stack:
        clients = _clients(stack, config, selected, transport)
        for i, e in enumerate(selected, 1):
            # "running" is a placeholder that keeps the keys' order: the finally below sets
            # the status before the record is written.
            record: dict[str, Any] = {"name": e.name, "url": e.url, "roles": list(e.roles),
                                      "status": "running", "reason": None, "warnings": [],  # pragma: no mutate (equivalent: the status and reason are set before the record is written; the key order is tested)
                                      "sweep": sweep_settings(settings, seed + i)}  # fmt: skip
            records[e.name] = record
            progress.engine(e.name, i, len(selected), e.url)
            run = _EngineRun(clients[e.name], config, settings, record, seed + i, progress,
                             roles=e.roles)  # fmt: skip
            status: Status = "failed"
            reason: str | None = "interrupted"
            profile: EngineProfile | None = None
            try:
                profile = await run.run()
                status, reason = "ok", None
            except SweepRejected as exc:
                status, reason = "rejected", str(exc)
            except EngineError as exc:
                status, reason = "failed", str(exc)
            finally:
                record["status"], record["reason"] = status, reason
                record["rejected_cells"] = list(run.rejected_cells)
                # Completed engines' data reaches the disk before the next engine starts.
                write_json(samples_path, samples_doc())
            rejected = tuple(run.rejected_cells)
            accepted = status == "ok" and (not rejected or settings.accept_rejected_cells)
            outcomes.append(EngineOutcome(e.name, status, reason, profile, rejected, accepted))
            if reason is not None:
                progress.warn(e.name, f"{status}: {reason}")
            elif rejected:
                progress.warn(e.name, f"profiled without {len(rejected)} rejected decode cell(s)"
                              + ("" if settings.accept_rejected_cells
                                 else "; pass --accept-rejected-cells to accept it"))  # fmt: skip
            else:
                progress.line(e.name, "profiled")
    progress.close()
    by_name = {o.name: o for o in [*kept_outcomes, *outcomes]}
    ordered = [by_name[e.name] for e in config.engines if e.name in by_name]
    ordered += [o for name, o in by_name.items() if name not in {e.name for e in config.engines}]
    wrote = write_pair(profiles_path, samples_path, samples_doc(), ordered)
    return ProfileRun(profiles_path, samples_path, tuple(outcomes), wrote)


def _existing_pair(
    profiles_path: Path, replaced: set[str]
) -> tuple[dict[str, Any], list[EngineOutcome], dict[str, Any]]:
    """The entries and outcomes of an existing pair's engines that are not re-profiled.

    Raises:
        ConfigError: the existing pair does not load (mixed up, hand-edited sidecar).
    """
    existing = load_profiles(profiles_path)  # checks the sidecar's SHA-256
    samples_path = profiles_path.with_name(existing.samples.path)
    old = read_json(samples_path, "samples file")
    entries = old.get("engines") if isinstance(old, dict) else None
    if not isinstance(entries, dict):
        raise ConfigError("the existing samples hold no engines; pass --overwrite to replace the "
                          "pair", path="$.engines", source=str(samples_path))  # fmt: skip
    kept = {name: entry for name, entry in entries.items() if name not in replaced}
    outcomes = []
    for name in kept:
        profile = existing.engines.get(name)
        if profile is not None:
            outcomes.append(EngineOutcome(name, "ok", None, profile))  # pragma: no mutate (equivalent: a kept profile is written as the profile; its outcome's status is not read)
        else:
            outcomes.append(_excluded(name, existing.excluded.get(name)))
    merged = {
        "previous": {"profiles_sha256": file_sha256(profiles_path),
                     "samples_sha256": existing.samples.sha256,
                     "created_at": existing.created_at},
        "replaced": sorted(replaced),
        "kept": sorted(kept),
        "at": now_iso(),
    }  # fmt: skip
    return kept, outcomes, merged


def _excluded(name: str, why: str | None) -> EngineOutcome:
    """The outcome of an engine the pair excludes, from its ``"<status>: <reason>"``
    (as :func:`write_pair` writes it; written again, it must not gain another prefix)."""
    statuses: tuple[Status, ...] = ("rejected", "failed")
    for status in statuses:
        if why is not None and why.startswith(f"{status}: "):
            return EngineOutcome(name, status, why[len(status) + 2 :])
    return EngineOutcome(name, "rejected", why)
