"""The sweeps of one engine: what it reports, prompts, the prefill sweep, the decode sweep.

Every probe prompt is tokenised by the engine before it is sent: the profiler writes a
text of ordinary words, asks the engine's ``/tokenize`` for its token ids, and sends
exactly the first L of those ids as the prompt (vLLM's ``/tokenize`` takes text only,
and a token-id prompt reaches the model exactly as given, with no BOS added). The
completion's own ``usage.prompt_tokens`` confirms the length again afterwards. The
first :data:`CODE_TOKENS` words of every text encode a serial number unique within
the run, starting at a random offset, so no two prompts share a first KV block and a
prefix cache cannot serve one.

Every function here records what it measured into a caller-owned ``dict`` as it goes,
so that when an engine fails midway, the samples taken so far stay in the sidecar.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import attrs
import trio

from narwhal.engines.client import EngineClient
from narwhal.engines.metrics import Sample
from narwhal.errors import EngineError, EngineTimeout
from narwhal.profile.cohort import CellResult, StreamLimits, run_cell
from narwhal.profile.enginetime import engine_seconds, read_clock
from narwhal.profile.progress import Progress

__all__ = [
    "CODE_TOKENS",
    "WORDS",
    "EngineFacts",
    "PromptFactory",
    "SweepRejected",
    "bounded",
    "cell_summary",
    "decode_sweep",
    "measure_prefill",
    "plan_cells",
    "plan_prefix_cells",
    "prefill_sweep",
    "prefix_sweep",
    "probe_engine",
]

T = TypeVar("T")

#: Leading words of every prompt that make it unique.
CODE_TOKENS: Final = 4
#: The words probe prompts are written with (distinct, common, one or two tokens each
#: in the usual tokenizers).
WORDS: Final = tuple(dict.fromkeys((
    "the quick brown fox jumps over a lazy dog while seven bright stars watch "
    "from far above quiet green hills and deep blue rivers that wind through old "
    "forests where small birds sing morning songs to every passing cloud people "
    "walk along narrow paths carrying baskets of ripe apples fresh bread warm milk "
    "honey cheese wild flowers gathered near the stone bridge by mill children "
    "laugh play run jump climb trees build castles in soft yellow sand under "
    "golden light until evening brings cool wind gentle rain silver moon"
).split()))  # fmt: skip
_TOKENIZE_TRIES: Final = 4
#: Tries of a cached-prefix repeat whose warm prefix the engine did not serve from cache.
_PREFIX_TRIES: Final = 3


class SweepRejected(Exception):
    """The engine's measurements cannot give an acceptable profile (not an engine fault)."""


async def bounded(
    client: EngineClient,
    seconds: float,
    what: str,
    fn: Callable[..., Awaitable[T]],
    *args: Any,
) -> T:
    """``await fn(*args)`` within ``seconds``; an engine that takes longer has failed.

    Raises:
        EngineTimeout: the deadline passed.
    """
    with trio.move_on_after(seconds):
        return await fn(*args)
    raise EngineTimeout(
        f"engine {client.name} did not answer {what} within {seconds:g} s",
        engine=client.name,
        leg="profile",
    )


@attrs.frozen
class EngineFacts:
    """What an engine reports about itself before the sweep.

    Attributes:
        max_model_len: the live context limit, from ``/tokenize``.
        tokens_per_word: how many tokens the engine's tokenizer makes of a probe word.
        prefix_caching: ``enable_prefix_caching`` of ``cache_config_info``.
        kv_cache_size_tokens: ``kv_cache_size_tokens`` of ``cache_config_info``, only
            when the engine reports that label.
        metrics_error: why ``/metrics`` could not be read, if it could not.
        block_size: ``block_size`` of ``cache_config_info``, when reported.
    """

    max_model_len: int
    tokens_per_word: float
    prefix_caching: bool | None
    kv_cache_size_tokens: int | None
    metrics_error: str | None = None
    block_size: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_model_len_source": "/tokenize",
            "tokens_per_word": self.tokens_per_word,
            "prefix_caching": self.prefix_caching,
            "kv_cache_size_tokens": self.kv_cache_size_tokens,
            "metrics_error": self.metrics_error,
            "block_size": self.block_size,
        }


def _reported_kv_tokens(infos: Sequence[Sample]) -> int | None:
    """``kv_cache_size_tokens`` summed over the engine's cores; None when any lacks it.

    Deliberately not ``num_gpu_blocks * block_size``, which is wrong for hybrid models.
    """
    total = 0
    for info in infos:
        raw = info.label("kv_cache_size_tokens")
        try:
            value = float(raw) if raw is not None else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            return None
        total += int(value)
    return total or None


async def probe_engine(client: EngineClient) -> EngineFacts:
    """Read the live context limit, the tokenizer's density and the cache configuration.

    Raises:
        EngineError: the engine did not answer.
        SweepRejected: it reports no ``max_model_len`` or no token ids on ``/tokenize``.
    """
    text = await client.tokenize(" ".join(WORDS))
    if text.max_model_len is None:
        raise SweepRejected(f"engine {client.name} reports no max_model_len on /tokenize")
    if len(text.ids) != text.count or not text.ids:
        raise SweepRejected(f"engine {client.name}'s /tokenize returns no token ids")
    prefix: bool | None = None
    kv: int | None = None
    block: int | None = None
    error: str | None = None
    try:
        metrics = await client.metrics()
    except EngineError as exc:
        error = str(exc)
    else:
        prefix = metrics.prefix_caching
        kv = _reported_kv_tokens(metrics.get("vllm:cache_config_info"))
        block = metrics.block_size
    return EngineFacts(text.max_model_len, text.count / len(WORDS), prefix, kv, error, block)


class PromptFactory:
    """Prompts of an exact token length, tokenised by the engine, unique from their start."""

    def __init__(
        self,
        client: EngineClient,
        *,
        seed: int,
        tokens_per_word: float = 1.0,
        timeout_s: float = 600.0,
    ) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._space = len(WORDS) ** CODE_TOKENS
        self._rng = random.Random(seed)
        self._serial = self._rng.randrange(self._space)
        self._density = max(tokens_per_word, 0.25)
        self.made = 0

    def _text(self, words: int) -> str:
        n, base = self._serial, len(WORDS)
        code = []
        for _ in range(CODE_TOKENS):
            n, digit = divmod(n, base)
            code.append(WORDS[digit])
        return " ".join(code + [self._rng.choice(WORDS) for _ in range(words - CODE_TOKENS)])

    async def __call__(self, length: int) -> list[int]:
        """A new prompt of exactly ``length`` token ids (``length >= CODE_TOKENS``).

        Raises:
            EngineError: ``/tokenize`` failed.
            SweepRejected: the engine's tokenizer would not give ``length`` tokens.
        """
        if length < CODE_TOKENS:
            raise ValueError(f"prompts need at least {CODE_TOKENS} tokens")
        words = max(CODE_TOKENS, math.ceil(length / self._density) + 2)
        for _ in range(_TOKENIZE_TRIES):
            text = self._text(words)
            tokenized = await bounded(
                self._client, self._timeout_s, "/tokenize", self._client.tokenize, text
            )
            if tokenized.count >= length and len(tokenized.ids) == tokenized.count:
                self._serial = (self._serial + 1) % self._space
                self.made += 1
                return list(tokenized.ids[:length])
            words = max(words + 1, math.ceil(words * length / max(tokenized.count, 1)) + 2)
        raise SweepRejected(
            f"engine {self._client.name}'s /tokenize did not give {length} token ids for a probe text"
        )


async def measure_prefill(
    client: EngineClient, ids: list[int], timeout_s: float, *, engine_time: bool = False
) -> dict[str, Any]:
    """One prefill of exactly the prompt ``ids``: its TTFT and when it was sent;
    ``engine_time``, also the engine's own seconds of it (``engine_s``, None where the
    engine's histograms do not tell them: :mod:`narwhal.profile.enginetime`).

    Raises:
        EngineTimeout: no answer within ``timeout_s``.
        EngineError: the request failed.
        SweepRejected: the engine processed another number of prompt tokens.
    """
    before = await read_clock(client) if engine_time else None
    with trio.move_on_after(timeout_s) as scope:
        result = await client.prefill({"prompt": ids, "temperature": 0.0}, transfer=False)
    if scope.cancelled_caught:
        raise EngineTimeout(
            f"engine {client.name} took over {timeout_s:g} s for a {len(ids)}-token prefill",
            engine=client.name,
            leg="prefill",
        )
    if result.prompt_tokens is not None and result.prompt_tokens != len(ids):
        raise SweepRejected(
            f"engine {client.name} processed {result.prompt_tokens} prompt tokens for an "
            f"exact {len(ids)}-token prompt"
        )
    sample = {
        "length": len(ids),
        "ttft_s": result.completed_at - result.started_at,
        "started_at": result.started_at,
        "prompt_tokens": result.prompt_tokens,
        "reported_cached": result.cached_tokens,
    }
    if engine_time:
        sample["engine_s"] = None if before is None else await engine_seconds(client, before)
    return sample


async def prefill_sweep(
    client: EngineClient,
    facts: EngineFacts,
    lengths: Sequence[int],
    record: dict[str, Any],
    *,
    repeats: int,
    warmup: int,
    prompt: PromptFactory,
    timeout_s: float,
    progress: Progress,
    engine_time: bool = False,
) -> dict[int, float]:
    """Measure TTFT at each usable length; returns the median per exact length.

    ``record`` receives the requested, effective and dropped lengths, the warm-up
    requests, every repeat and the medians, as they are measured; ``engine_time``: each
    repeat with the engine's own seconds of it (:func:`measure_prefill`).

    Raises:
        EngineError: a request failed.
        SweepRejected: fewer than three lengths fit, or a length did not check out.
    """
    name, limit = client.name, facts.max_model_len
    effective = [n for n in sorted(set(lengths)) if n + 1 <= limit]
    dropped = [
        {"length": n, "reason": f"{n} prompt tokens + 1 output token exceed max_model_len {limit}"}
        for n in sorted(set(lengths)) if n + 1 > limit
    ]  # fmt: skip
    record.update(requested_lens=list(lengths), effective_lens=effective, dropped_lens=dropped,
                  warmup=[], repeats=[], medians=[])  # fmt: skip
    for d in dropped:
        progress.line(name, f"prefill: dropped length {d['length']}: {d['reason']}")
    if len(effective) < 3:
        raise SweepRejected(
            f"only {len(effective)} prefill lengths fit max_model_len {limit}; at least 3 are needed"
        )
    for n in effective:  # warm every shape first; these are not recorded as samples
        for _ in range(warmup):
            progress.status(name, f"prefill: warming up at {n} tokens")
            record["warmup"].append(await measure_prefill(client, await prompt(n), timeout_s))
    medians: dict[int, float] = {}
    for n in effective:
        times = []
        for r in range(repeats):
            progress.status(name, f"prefill: {n} tokens, repeat {r + 1}/{repeats}")
            sample = await measure_prefill(client, await prompt(n), timeout_s, engine_time=engine_time)
            record["repeats"].append(sample | {"repeat": r})
            times.append(sample["ttft_s"])
        medians[n] = float(statistics.median(times))
        record["medians"].append({"length": n, "ttft_s": medians[n], "repeats": len(times)})
        progress.line(name, f"prefill: {n} tokens: median TTFT {medians[n] * 1e3:.2f} ms "
                            f"over {len(times)} repeats")  # fmt: skip
    return medians


def plan_prefix_cells(
    lengths: Sequence[int], fractions: Sequence[float], *, block_size: int, max_model_len: int
) -> list[tuple[int, int]]:
    """The cached-prefix cells ``(L, k)``: for every prompt length L that fits, a cached
    prefix of ``fraction * L`` tokens rounded down to whole blocks (a cache holds whole
    blocks), at least one block and short of the last prompt token (always computed)."""
    cells: set[tuple[int, int]] = set()
    for n in sorted(set(lengths)):
        if n + 1 > max_model_len:
            continue  # pragma: no mutate (equivalent to break: the lengths are sorted, none after it fits)
        most = (n - 1) // block_size * block_size
        for f in fractions:
            k = min(int(f * n) // block_size * block_size, most)
            if k >= block_size:
                cells.add((n, k))
    return sorted(cells)


async def prefix_sweep(
    client: EngineClient,
    cells: Sequence[tuple[int, int]],
    record: dict[str, Any],
    *,
    repeats: int,
    prompt: PromptFactory,
    timeout_s: float,
    progress: Progress,
    engine_time: bool = False,
) -> None:
    """Measure prefill with a cached prefix at every cell ``(L, k)``.

    Each repeat takes a new prompt of L tokens (unique from its first block, like every
    probe prompt), warms its first k tokens with a prefill of its own, then measures
    the whole prompt, whose first k tokens the engine now serves from its cache. Before
    every cell the engine's prefix cache is reset where the engine offers
    ``POST /reset_prefix_cache`` (vLLM in development mode), so that the cells'
    prompts do not evict one another mid-cell; where it does not, the unique prompts
    alone keep the cells apart. The engine's own count of cached tokens
    (``prompt_tokens_details.cached_tokens``), where it reports one, must equal k: a
    repeat whose warm prefix was evicted is measured again (up to three times).

    ``record`` receives the cells, whether the cache was reset, every warm-up prefill
    (``warm``) and every measured repeat (``repeats``: ``length``, ``cached``,
    ``ttft_s``, ``reported_cached``, and with ``engine_time`` the engine's own seconds
    ``engine_s``), as they are measured.

    Raises:
        EngineError: a request failed.
        SweepRejected: the engine kept reporting a cached count other than k.
    """
    name = client.name
    record.update(cells=[{"length": n, "cached": k} for n, k in cells], warm=[], repeats=[],
                  mismatched=[])  # fmt: skip
    offered = True  # until the engine refuses the reset
    for i, (n, k) in enumerate(cells, 1):
        if offered:
            offered = await bounded(client, timeout_s, "POST /reset_prefix_cache",
                                    client.reset_prefix_cache)  # fmt: skip
            if offered:
                record["reset"] = "POST /reset_prefix_cache before every cell"
            elif i == 1:
                record["reset"] = ("not offered (POST /reset_prefix_cache refused): unique "
                                   "prompts only")  # fmt: skip
            else:
                record["reset"] = (f"POST /reset_prefix_cache before cells 1-{i - 1}, refused "
                                   f"from cell {i} on: unique prompts only there")  # fmt: skip
        times = []
        for r in range(repeats):
            progress.status(name, f"prefix: cell {i}/{len(cells)}: {n} tokens, {k} cached, "
                                  f"repeat {r + 1}/{repeats}")  # fmt: skip
            for _attempt in range(_PREFIX_TRIES):
                ids = await prompt(n)
                record["warm"].append(await measure_prefill(client, ids[:k], timeout_s))
                sample = await measure_prefill(client, ids, timeout_s, engine_time=engine_time) | {
                    "cached": k, "repeat": r}
                reported = sample["reported_cached"]
                if reported is None or reported == k:
                    break
                record["mismatched"].append(sample)
            else:
                raise SweepRejected(f"engine {name} served {reported} cached tokens of a "
                                    f"{n}-token prompt whose first {k} were just prefilled, "
                                    f"{_PREFIX_TRIES} times (is its cache under other load?)")  # fmt: skip
            record["repeats"].append(sample)
            times.append(sample["ttft_s"])
        progress.line(name, f"prefix: {n} tokens, {k} cached: median TTFT "
                            f"{statistics.median(times) * 1e3:.2f} ms over {len(times)} repeats")  # fmt: skip


def plan_cells(
    input_lens: Sequence[int],
    concurrency: Sequence[int],
    *,
    decode_tokens: int,
    max_model_len: int,
    kv_cache_size_tokens: int | None,
    shared_prefix: int,
    block_size: int | None,
) -> tuple[list[tuple[int, int, int]], list[dict[str, Any]]]:
    """The cells ``(input_len, concurrency, max_tokens)`` that fit, and those dropped.

    Each stream asks for ``decode_tokens + concurrency`` tokens: the cohort's prefills
    take turns with decode steps, so the first stream emits about ``concurrency``
    tokens before the last one starts, and the window still needs ``decode_tokens``.
    ``shared_prefix``: leading prompt tokens every stream of a cell shares in the
    engine's prefix cache, which holds their whole blocks (of ``block_size`` tokens)
    once for the cohort; with no block size known, nothing counts as held once.
    """
    held_once = shared_prefix // block_size * block_size if block_size else 0
    cells: list[tuple[int, int, int]] = []
    dropped: list[dict[str, Any]] = []
    for n in sorted(set(input_lens)):
        for c in sorted(set(concurrency)):
            out = decode_tokens + c
            reason = None
            if n + out > max_model_len:
                reason = (f"input {n} + requested output {out} = {n + out} tokens exceed the "
                          f"live context limit {max_model_len}")  # fmt: skip
            elif kv_cache_size_tokens is not None and held_once + c * (n + out - held_once) > kv_cache_size_tokens:
                shared = f" ({held_once} of each a prefix held once)" if held_once else ""
                reason = (f"{c} streams of {n + out} tokens need {held_once + c * (n + out - held_once)} KV "
                          f"tokens{shared}; the engine holds {kv_cache_size_tokens}")  # fmt: skip
            if reason is None:
                cells.append((n, c, out))
            else:
                dropped.append({"input_len": n, "concurrency": c, "max_tokens": out,
                                "reason": reason})  # fmt: skip
    return cells, dropped


async def decode_sweep(
    client: EngineClient,
    facts: EngineFacts,
    input_lens: Sequence[int],
    concurrency: Sequence[int],
    record: dict[str, Any],
    *,
    decode_tokens: int,
    min_window_steps: int,
    prompt: PromptFactory,
    limits: StreamLimits,
    progress: Progress,
    shared_prefix: int = 0,
) -> list[CellResult]:
    """Run every cell that fits; returns the kept ones.

    ``record`` receives the plan, the dropped cells and every cell's result as it ends.
    ``shared_prefix`` (on an engine that caches prefixes): every prompt of a cell starts
    with the same ``shared_prefix`` tokens, new to the cell and computed once before
    the cohort starts, so that every stream hits it in the engine's cache: the cohort's
    streams then read more KV (each sequence's whole context) than the engine holds, as
    streams of one shared prefix do in service.

    Raises:
        EngineError: a stream's request failed.
    """
    name = client.name
    cells, dropped = plan_cells(
        input_lens,
        concurrency,
        decode_tokens=decode_tokens,
        max_model_len=facts.max_model_len,
        kv_cache_size_tokens=facts.kv_cache_size_tokens,
        shared_prefix=shared_prefix,
        block_size=facts.block_size,
    )
    record.update(
        requested_cells=[
            {"input_len": n, "concurrency": c} for n in input_lens for c in concurrency
        ],
        dropped_cells=dropped,
        cells=[],
        shared_prefix=shared_prefix,
    )
    for d in dropped:
        progress.line(name, f"decode: dropped cell input {d['input_len']} x {d['concurrency']} "
                            f"streams: {d['reason']}")  # fmt: skip
    kept: list[CellResult] = []
    for i, (n, c, out) in enumerate(cells, 1):
        progress.status(name, f"decode: cell {i}/{len(cells)}: input {n} x {c} streams")
        if shared_prefix:
            head = await prompt(shared_prefix)
            # Computed alone first: streams that arrive together would each compute it.
            await measure_prefill(client, head, limits.first_token_s)
            prompts = [head + await prompt(n - shared_prefix) for _ in range(c)]
        else:
            prompts = [await prompt(n) for _ in range(c)]
        cell = await run_cell(
            client, prompts, max_tokens=out, limits=limits, min_window_steps=min_window_steps
        )
        record["cells"].append(cell.as_dict())
        if cell.kept:
            assert cell.tpot_s is not None and cell.kv_tokens is not None  # pragma: no mutate (equivalent: a kept cell has both figures; the assert informs the type checker)
            kept.append(cell)
            progress.line(name, f"decode: cell input {n} x {c} streams: median TPOT "
                                f"{cell.tpot_s * 1e3:.3f} ms at {cell.kv_tokens:.0f} resident KV "
                                f"tokens ({len(cell.intervals)} intervals)")  # fmt: skip
        else:
            progress.warn(name, f"decode: cell input {n} x {c} streams rejected: {cell.reason}")
    return kept


def cell_summary(cells: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The cell medians, one row per kept cell (the decode fit's input)."""
    return [
        {"input_len": c["input_len"], "concurrency": c["concurrency"], "active": c["active"],
         "kv_tokens": c["kv_tokens"], "tpot_s": c["tpot_s"], "intervals": len(c["intervals"])}
        for c in cells if c["kept"]
    ]  # fmt: skip
