"""Workloads: arrival processes, length distributions, traces and prompts.

A schedule is a list of :class:`ScheduledRequest` (start offset, prompt length or
text, output length), built either from a :class:`Workload` (seeded, so the same
arguments give the same schedule) or from a JSON-lines trace.

Arrivals: the first request starts at offset 0 and the gaps that follow are
exponential (``poisson``), gamma with shape ``burstiness`` and mean ``1/rate``
(``gamma``; 1 is Poisson, below 1 burstier, above 1 more regular) or exactly
``1/rate`` (``constant``). A rate of ``inf`` starts every request at once.

Length specs: ``N`` or ``fixed:N``, ``uniform:LO:HI`` (inclusive), ``normal:MEAN:STD``
and ``lognormal:MEAN:STD`` (mean and standard deviation of the lengths themselves);
samples are rounded and at least 1.

Prompts: ``text`` prompts are whitespace-separated common English words. The
simulated engines count one token per word, so the length is exact there; a real
tokenizer gives about one token per word (most of these words are single tokens in
common BPE vocabularies) but not exactly, and chat templates add tokens of their own:
every record keeps the ``prompt_tokens`` the server reported. ``ids`` prompts (a list
of token ids in ``[1000, 30000)``, completions only) have the exact length on any
engine whose vocabulary is at least 30000 ids.
"""

from __future__ import annotations

import json
import math
import os
import random
from typing import Any, Final, Literal

import attrs

from narwhal.errors import ConfigError

__all__ = [
    "ARRIVALS",
    "Arrival",
    "LengthDist",
    "ScheduledRequest",
    "Workload",
    "arrival_offsets",
    "build_schedule",
    "load_trace",
    "prompt_ids",
    "prompt_text",
]

Arrival = Literal["poisson", "gamma", "constant"]
ARRIVALS: Final[tuple[Arrival, ...]] = ("poisson", "gamma", "constant")

_WORDS: Final = tuple(
    """the of and to in is was for on that with as by at from his her he it an be are this
    which or had not but have were they their one all there been has when who more would
    will about after can two other out into only time first new some could these may over
    also then than like its what people years made used such most so him state many up
    between during through city world well where three both year under day part way work
    life back still water house game high school long left each four since end number
    found name same five film much best play later while group early even last small
    great place known own line area music power side war team family book king night
    light old open point road story young age air art car field food form hand head home
    land law level man money month order paper party peace plan price river room sea sound
    start street term town tree view voice week wind word""".split()
)

_ID_LOW: Final = 1000
_ID_HIGH: Final = 30000


# --------------------------------------------------------------------------- lengths


@attrs.frozen
class LengthDist:
    """A distribution of token lengths, parsed from a compact spec (module docstring)."""

    kind: Literal["fixed", "uniform", "normal", "lognormal"]
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """Parse ``N``, ``fixed:N``, ``uniform:LO:HI``, ``normal:M:S`` or ``lognormal:M:S``.

        Raises:
            ValueError: the spec is malformed (the message says how).
        """
        parts = spec.strip().split(":")
        kind = parts[0].lower()
        if len(parts) == 1 and kind.isdigit():
            kind, parts = "fixed", ["fixed", parts[0]]
        want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
        if kind not in want:
            raise ValueError(
                f"length spec {spec!r}: expected N, fixed:N, uniform:LO:HI, normal:MEAN:STD "
                "or lognormal:MEAN:STD"
            )
        args = parts[1:]
        if len(args) != want[kind]:
            raise ValueError(f"length spec {spec!r}: {kind} takes {want[kind]} number(s)")
        try:
            values = [float(x) for x in args]
        except ValueError:
            raise ValueError(f"length spec {spec!r}: {':'.join(args)} is not numeric") from None
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"length spec {spec!r}: values must be finite")
        if kind in ("fixed", "uniform"):
            if not all(v == int(v) and v >= 1 for v in values):
                raise ValueError(f"length spec {spec!r}: lengths must be integers >= 1")
            if kind == "uniform" and values[0] > values[1]:
                raise ValueError(f"length spec {spec!r}: LO must not exceed HI")
        else:
            if values[0] < 1 or values[1] < 0:
                raise ValueError(f"length spec {spec!r}: MEAN must be >= 1 and STD >= 0")
        return cls(kind, values[0], values[1] if len(values) > 1 else 0.0)  # type: ignore[arg-type]

    @property
    def spec(self) -> str:
        """The canonical spec string."""
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"

    def sample(self, rng: random.Random) -> int:
        """One length (>= 1)."""
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            sigma2 = math.log1p((self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return max(1, round(value))


# --------------------------------------------------------------------------- schedule


@attrs.frozen
class ScheduledRequest:
    """One request of a schedule.

    Attributes:
        index: position in the schedule, from 0.
        offset_s: scheduled start, seconds after the run starts.
        output_len: output tokens to ask for.
        prompt_len: prompt tokens to generate (None when ``prompt`` is given).
        prompt: the prompt text a trace gave, if any.
        stream: the stream of a mix it belongs to (:mod:`narwhal.bench.mix`), by index.
    """

    index: int
    offset_s: float
    output_len: int
    prompt_len: int | None = None
    prompt: str | None = None
    stream: int | None = None


@attrs.frozen
class Workload:
    """A generated workload (the CLI's ``--rate``, ``--arrival``, ... arguments).

    Attributes:
        rate: requests per second (``math.inf``: all at once).
        arrival: the arrival process.
        burstiness: the gamma shape (``gamma`` only).
        num_requests: stop after this many requests (None: no count limit).
        duration_s: schedule requests that start before this offset (None: no limit).
        input_len: prompt length distribution.
        output_len: output length distribution.
        seed: seed of every random choice.
    """

    rate: float
    arrival: Arrival = "poisson"
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    input_len: LengthDist = attrs.field(factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = attrs.field(factory=lambda: LengthDist("fixed", 128))
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError("the request rate must be > 0")
        if not self.burstiness > 0 or not math.isfinite(self.burstiness):
            raise ValueError("the burstiness must be a finite number > 0")
        if self.num_requests is None and (self.duration_s is None or math.isinf(self.rate)):
            raise ValueError(
                "give a request count" if math.isinf(self.rate) else "give a duration or a request count"
            )
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("the request count must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("the duration must be > 0")

    def to_json(self) -> dict[str, Any]:
        """The workload as recorded in a summary."""
        return {
            "kind": "generated",
            "rate": "inf" if math.isinf(self.rate) else self.rate,
            "arrival": self.arrival,
            "burstiness": self.burstiness,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "input_len": self.input_len.spec,
            "output_len": self.output_len.spec,
            "seed": self.seed,
        }


def _rng(seed: int, stream: str) -> random.Random:
    # One stream per kind of choice: changing one distribution leaves the others alone.
    return random.Random(f"narwhal-bench/{seed}/{stream}")


def arrival_offsets(
    rate: float,
    arrival: Arrival,
    *,
    burstiness: float = 1.0,
    count: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
) -> list[float]:
    """Start offsets of an arrival process, first at 0 (see the module docstring)."""
    if count is None and (duration_s is None or math.isinf(rate)):
        raise ValueError("an unbounded schedule needs a count")
    rng = _rng(seed, "arrivals")
    offsets: list[float] = []
    t = 0.0
    while count is None or len(offsets) < count:
        if duration_s is not None and t >= duration_s:
            break
        offsets.append(t)
        if math.isinf(rate):
            continue
        if arrival == "constant":
            t = len(offsets) / rate  # no accumulated rounding
        elif arrival == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return offsets


def build_schedule(workload: Workload) -> list[ScheduledRequest]:
    """The schedule of a generated workload."""
    offsets = arrival_offsets(
        workload.rate,
        workload.arrival,
        burstiness=workload.burstiness,
        count=workload.num_requests,
        duration_s=workload.duration_s,
        seed=workload.seed,
    )
    inputs = _rng(workload.seed, "input_len")
    outputs = _rng(workload.seed, "output_len")
    return [
        ScheduledRequest(
            index=i,
            offset_s=offset,
            prompt_len=workload.input_len.sample(inputs),
            output_len=workload.output_len.sample(outputs),
        )
        for i, offset in enumerate(offsets)
    ]


# --------------------------------------------------------------------------- traces

_TRACE_KEYS: Final = frozenset({"offset_s", "prompt_len", "prompt", "output_len"})


def _trace_int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"'{key}' must be an integer >= 1", path=f"$.{key}", source=where)
    return value


def load_trace(path: str | os.PathLike[str]) -> list[ScheduledRequest]:
    """Read a JSON-lines trace: ``{"offset_s", "prompt_len" | "prompt", "output_len"}``.

    ``offset_s`` is the start in seconds after the run starts; lines may come in any
    order (the schedule is sorted by offset, ties in file order). Blank lines are skipped.

    Raises:
        ConfigError: the file cannot be read, or a line is invalid (the message names
            the file, the line and the field).
    """
    source = os.fspath(path)
    try:
        with open(source, encoding="utf-8") as fh:
            lines = fh.readlines()
    except OSError as exc:
        raise ConfigError(f"cannot read trace: {exc.strerror}", source=source) from None
    except UnicodeDecodeError:
        raise ConfigError("the trace is not UTF-8 text", source=source) from None
    entries: list[tuple[float, int, ScheduledRequest]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"not JSON ({exc.msg})", source=where) from None
        if not isinstance(obj, dict):
            raise ConfigError("a trace line must be a JSON object", source=where)
        unknown = sorted(set(obj) - _TRACE_KEYS)
        if unknown:
            raise ConfigError(f"unknown field '{unknown[0]}'", path=f"$.{unknown[0]}", source=where)
        for key in ("offset_s", "output_len"):
            if key not in obj:
                raise ConfigError(f"'{key}' is required", path=f"$.{key}", source=where)
        offset = obj["offset_s"]
        if isinstance(offset, bool) or not isinstance(offset, int | float) or not (
            math.isfinite(offset) and offset >= 0
        ):
            raise ConfigError("'offset_s' must be a number >= 0", path="$.offset_s", source=where)
        if ("prompt" in obj) == ("prompt_len" in obj):
            raise ConfigError("give exactly one of 'prompt' and 'prompt_len'", source=where)
        prompt: str | None = None
        prompt_len: int | None = None
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                raise ConfigError("'prompt' must be a non-empty string", path="$.prompt", source=where)
            prompt = obj["prompt"]
        else:
            prompt_len = _trace_int(obj, "prompt_len", where)
        output_len = _trace_int(obj, "output_len", where)
        entries.append((float(offset), number, ScheduledRequest(0, float(offset), output_len, prompt_len, prompt)))
    if not entries:
        raise ConfigError("the trace has no requests", source=source)
    entries.sort(key=lambda e: (e[0], e[1]))
    return [attrs.evolve(req, index=i) for i, (_, _, req) in enumerate(entries)]


# --------------------------------------------------------------------------- prompts


def prompt_text(n_tokens: int, *, seed: int, index: int) -> str:
    """A prompt of ``n_tokens`` words, deterministic in ``(seed, index)``.

    Exact on the simulated engines (one token per word); about one token per word on
    real tokenizers (see the module docstring).
    """
    rng = _rng(seed, f"prompt/{index}")
    return " ".join(rng.choices(_WORDS, k=n_tokens))


def prompt_ids(n_tokens: int, *, seed: int, index: int) -> list[int]:
    """A prompt of exactly ``n_tokens`` token ids, deterministic in ``(seed, index)``."""
    rng = _rng(seed, f"prompt/{index}")
    return [rng.randrange(_ID_LOW, _ID_HIGH) for _ in range(n_tokens)]
