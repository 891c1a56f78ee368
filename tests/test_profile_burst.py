"""The burst probe: how a producer queues prompts (narwhal/profile/burst.py), measured
against simulated engines in virtual time, derived again from the sidecar, and bound
into placement."""

from __future__ import annotations

import copy
import io
import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from narwhal.config import converter, parse_as
from narwhal.engines.client import EngineClient
from narwhal.errors import ConfigError, EngineError
from narwhal.profile.burst import BATCHED_GAP, burst_probe, median_gap, queue_verdict
from narwhal.profile.derive import derive_profile, prefill_queue
from narwhal.profile.progress import Progress
from narwhal.profile.refit import refit_pair
from narwhal.profile.store import EngineProfile, load_profiles
from narwhal.profile.sweep import CODE_TOKENS, PromptFactory
from narwhal.testing import open_sim_fleet
from tests.profilekit import PREFILL, Recording, Wrapper, engine, fleet, profile, samples, settings

#: The simulated engines' TTFT at the sweep's shortest length (128 tokens).
SHORTEST = 128
ONE_PREFILL_S = PREFILL["a"] + PREFILL["b"] * SHORTEST + PREFILL["c"] * SHORTEST**2


def test_verdict_reads_the_median_gap_against_one_prefill() -> None:
    serial = [[0.1, 0.2, 0.3, 0.4]]
    together = [[0.1, 0.101, 0.102, 0.103]]
    assert median_gap(serial) == pytest.approx(0.1)
    assert queue_verdict(serial, 0.1) == "serial"
    assert queue_verdict(together, 0.1) == "batched"
    # The median over every gap of every burst: two bursts together, one not.
    assert median_gap([[0.0, 0.3, 0.31], [0.0, 0.01, 0.02]]) == pytest.approx(0.01)
    # At the threshold exactly: serial (a gap of half a prefill is no shared step).
    assert queue_verdict([[0.0, BATCHED_GAP * 0.2]], 0.2) == "serial"
    assert queue_verdict([[0.0, BATCHED_GAP * 0.2 - 1e-9]], 0.2) == "batched"
    # A burst of one answer has no gap; with no gap at all there is no verdict.
    assert median_gap([[0.5], [0.0, 0.2]]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"^no burst has two answers$"):
        queue_verdict([[0.5], []], 0.1)


@pytest.mark.parametrize(
    ("sim", "expected"),
    [({}, "serial"), ({"max_num_batched_tokens": 2048}, "batched")],
    ids=["one-prompt-a-step", "chunked-prefill"],
)
async def test_the_probe_tells_a_batching_engine_from_a_serial_one(
    autojump_clock: trio.abc.Clock, tmp_path: Path, sim: dict[str, Any], expected: str
) -> None:
    config = fleet(engine("e0", 8101, **sim))
    async with open_sim_fleet(config) as fleet_:
        recording = Recording(fleet_.transport)
        run, output = await profile(config, recording, settings(tmp_path))
    assert run.ok
    # The probe's prompts: new (no shared first block, no cache hit possible), each
    # tokenized first, the four of a burst all before the first of them is sent.
    seen = recording.seen
    completions = [i for i, r in enumerate(seen) if r.path == "/v1/completions"]
    heads = [tuple(seen[i].body["prompt"][:CODE_TOKENS]) for i in completions]
    assert len(set(heads)) == len(heads)
    probe = [i for i in completions if len(seen[i].body["prompt"]) == SHORTEST][-12:]
    for start in range(0, 12, 4):
        burst = probe[start : start + 4]
        assert burst == list(range(burst[0], burst[0] + 4))  # sent together
        assert [r.path for r in seen[burst[0] - 4 : burst[0]]] == ["/tokenize"] * 4
        assert all(seen[i].body["max_tokens"] == 1 and not seen[i].body.get("stream") for i in burst)
    p = run.outcomes[0].profile
    assert p is not None and p.prefill_queue == expected
    record = samples(run)["engines"]["e0"]["prefill_queue"]
    assert record["length"] == SHORTEST and record["prompts"] == 4
    assert len(record["bursts"]) == 3  # the settings' repeats
    gaps = [b - a for times in record["bursts"] for a, b in itertools.pairwise(times)]
    if expected == "serial":
        # One prompt a step: each answer one prefill after the one before it.
        assert gaps == pytest.approx([ONE_PREFILL_S] * 9, rel=1e-3)
    else:
        # A step computes the waiting prompts together: most are answered at the same
        # moment (the first of a burst may start a step alone, as on vLLM, when the
        # others reach the engine after its step began) and each step pays the fixed
        # cost once: the last answer comes at least two fixed costs before a serial
        # engine's.
        assert sum(g == pytest.approx(0.0, abs=1e-6) for g in gaps) >= 6
        last = [times[-1] for times in record["bursts"]]
        assert max(last) <= 4 * ONE_PREFILL_S - 2 * PREFILL["a"] + 1e-6
    assert f"prefill queue: {expected} (answers of 4 128-token prompts sent at once" in output
    # The profile on disk says the same, and the preflight derives it again.
    assert load_profiles(run.profiles_path).engines["e0"].prefill_queue == expected
    assert derive_profile(samples(run)["engines"]["e0"], "e0") == p


async def test_no_probe_leaves_the_queue_unsaid(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101, max_num_batched_tokens=2048))
    async with open_sim_fleet(config) as fleet_:
        run, output = await profile(config, fleet_.transport, settings(tmp_path, queue_burst=0))
    assert run.ok and run.outcomes[0].profile is not None
    assert run.outcomes[0].profile.prefill_queue is None
    assert samples(run)["engines"]["e0"]["prefill_queue"] == {"skipped": "no --queue-burst"}
    assert "prefill queue" not in output


async def test_a_decode_only_engine_is_not_probed(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    decoder = engine("d0", 8102) | {"roles": ["decode"]}
    config = fleet(engine("p0", 8101), decoder)
    async with open_sim_fleet(config) as fleet_:
        run, _ = await profile(config, fleet_.transport, settings(tmp_path, engines=("d0",)))
    assert run.ok and run.outcomes[0].profile is not None
    assert run.outcomes[0].profile.prefill_queue is None
    assert samples(run)["engines"]["d0"]["prefill_queue"] == {
        "skipped": "the engine's roles do not include prefill"
    }


@pytest.mark.parametrize("value", [1, -1])
def test_a_burst_of_one_prompt_is_refused(tmp_path: Path, value: int) -> None:
    with pytest.raises(ValueError, match=r"queue-burst must be 0 \(no burst probe\) or at least 2"):
        settings(tmp_path, queue_burst=value)
    assert settings(tmp_path, queue_burst=2).queue_burst == 2


@pytest.fixture(scope="module")
def batched_entry(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The sidecar entry of a chunked-prefill engine's profile (measured once)."""
    config = fleet(engine("e0", 8101, max_num_batched_tokens=2048))
    out = tmp_path_factory.mktemp("batched")

    async def measure() -> dict[str, Any]:
        async with open_sim_fleet(config) as fleet_:
            run, _ = await profile(config, fleet_.transport, settings(out))
        entry: dict[str, Any] = samples(run)["engines"]["e0"]
        return entry

    return trio.run(measure, clock=trio.testing.MockClock(autojump_threshold=0))


TIMES = "expected the answers' times in seconds (numbers >= 0, in order)"


@pytest.mark.parametrize(
    ("edit", "path", "message"),
    [
        (lambda r: r.update(length=0), "$.engines.e0.prefill_queue.length", "expected an integer > 0"),
        (lambda r: r.update(length="128"), "$.engines.e0.prefill_queue.length", "expected an integer > 0"),
        (lambda r: r.update(bursts={}), "$.engines.e0.prefill_queue.bursts", "expected a list of bursts"),
        (lambda r: r["bursts"].__setitem__(1, [0.2, 0.1]), "$.engines.e0.prefill_queue.bursts[1]", TIMES),
        (lambda r: r["bursts"].__setitem__(2, [-0.1, 0.1]), "$.engines.e0.prefill_queue.bursts[2]", TIMES),
        (lambda r: r["bursts"].__setitem__(0, [0.1, True]), "$.engines.e0.prefill_queue.bursts[0]", TIMES),
        (lambda r: r["bursts"].__setitem__(0, "0.1"), "$.engines.e0.prefill_queue.bursts[0]", TIMES),
        (lambda r: r["bursts"].__setitem__(0, [float("nan")]), "$.engines.e0.prefill_queue.bursts[0]", TIMES),
        (lambda r: r.update(bursts=[[0.1]]), "$.engines.e0.prefill_queue.bursts", "no burst has two answers"),
    ],
    ids=["zero-length", "text-length", "bursts-not-a-list", "out-of-order", "negative", "bool", "text",
         "nan", "no-gap"],
)  # fmt: skip
def test_a_malformed_record_names_its_path(
    batched_entry: dict[str, Any], edit: Any, path: str, message: str
) -> None:
    entry = copy.deepcopy(batched_entry)
    edit(entry["prefill_queue"])
    with pytest.raises(ConfigError) as caught:
        derive_profile(entry, "e0")
    assert (caught.value.reason, caught.value.path) == (message, path)


def test_the_smallest_valid_record(batched_entry: dict[str, Any]) -> None:
    """A one-token length and an answer at the burst's first send are valid."""
    entry = copy.deepcopy(batched_entry)
    entry["prefill_queue"] |= {"length": 1, "bursts": [[0.0, 0.0]]}
    assert derive_profile(entry, "e0").prefill_queue == "batched"


def test_the_record_is_not_a_mapping(batched_entry: dict[str, Any]) -> None:
    entry = copy.deepcopy(batched_entry) | {"prefill_queue": [1, 2]}
    with pytest.raises(ConfigError) as caught:
        derive_profile(entry, "e0")
    assert (caught.value.reason, caught.value.path) == ("expected the burst probe's record", "$.engines.e0.prefill_queue")


def test_an_edited_burst_changes_the_derived_verdict(batched_entry: dict[str, Any]) -> None:
    """The verdict is derived from the answers, not stored: spread them one prefill
    apart and the same sidecar says serial."""
    entry = copy.deepcopy(batched_entry)
    curve = derive_profile(entry, "e0").ttft
    assert prefill_queue(entry, "$.engines.e0", curve) == "batched"
    one = curve.predict(SHORTEST)
    entry["prefill_queue"]["bursts"] = [[one * i for i in range(1, 5)] for _ in range(3)]
    assert prefill_queue(entry, "$.engines.e0", curve) == "serial"
    assert derive_profile(entry, "e0").prefill_queue == "serial"
    # Absent (a sidecar written before the probe): unsaid.
    del entry["prefill_queue"]
    assert prefill_queue(entry, "$.engines.e0", curve) is None


async def test_a_refit_derives_the_verdict_again(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    config = fleet(engine("e0", 8101, max_num_batched_tokens=2048))
    async with open_sim_fleet(config) as fleet_:
        run, _ = await profile(config, fleet_.transport, settings(tmp_path))
    assert run.outcomes[0].profile is not None and run.outcomes[0].profile.prefill_queue == "batched"
    # Spread the recorded answers one prefill apart: the refit's verdict follows them.
    doc = json.loads(run.samples_path.read_text())
    record = doc["engines"]["e0"]["prefill_queue"]
    record["bursts"] = [[ONE_PREFILL_S * i for i in range(1, 5)] for _ in record["bursts"]]
    edited = tmp_path / "edited.samples.json"
    edited.write_text(json.dumps(doc))
    refit = refit_pair(config, edited, tmp_path / "refit.json")
    assert refit.ok
    assert refit.outcomes[0].profile is not None and refit.outcomes[0].profile.prefill_queue == "serial"
    assert load_profiles(refit.profiles_path).engines["e0"].prefill_queue == "serial"
    # A malformed record refuses the refit, naming the sidecar's path.
    record["bursts"] = "none"
    edited.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="expected a list of bursts for engine 'e0'") as caught:
        refit_pair(config, edited, tmp_path / "refit2.json")
    assert caught.value.path == "$.engines.e0.prefill_queue.bursts"


class _FailOne(Wrapper):
    """Answers the ``which``-th completion request (0-based) with a 500."""

    def __init__(self, inner: httpx.AsyncBaseTransport, which: int) -> None:
        super().__init__(inner)
        self.which, self.completions = which, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            n, self.completions = self.completions, self.completions + 1
            if n == self.which:
                return httpx.Response(500, json={"error": {"message": "boom"}})
        return await self.inner.handle_async_request(request)


async def test_the_probe_shows_each_burst_and_a_failed_request_ends_it(autojump_clock: trio.abc.Clock) -> None:
    config = fleet(engine("e0", 8101))
    async with open_sim_fleet(config) as sim, httpx.AsyncClient(transport=_FailOne(sim.transport, 6)) as http:
        client = EngineClient(config.engines[0].url, name="e0", http_client=http)
        terminal = io.StringIO()
        record: dict[str, Any] = {}
        with pytest.raises(EngineError, match="500") as caught:
            await burst_probe(client, 64, record, prompts=4, bursts=3, prompt=PromptFactory(client, seed=1),
                              timeout_s=60, progress=Progress(terminal, tty=True))  # fmt: skip
    # The burst of the failed request (its third of four) raised that request's error,
    # after the burst ended; the burst before it is kept.
    assert caught.value.engine == "e0"
    assert record["length"] == 64 and record["prompts"] == 4 and len(record["bursts"]) == 1
    assert len(record["bursts"][0]) == 4
    shown = terminal.getvalue()
    assert "e0: prefill queue: burst 1/3 of 4 64-token prompts" in shown
    assert "e0: prefill queue: burst 2/3 of 4 64-token prompts" in shown
    assert "burst 3/3" not in shown


def test_a_profile_naming_another_queue_is_refused(batched_entry: dict[str, Any]) -> None:
    stored = converter.unstructure(derive_profile(batched_entry, "e0"))
    assert stored["prefill_queue"] == "batched"
    with pytest.raises(ConfigError) as caught:
        parse_as(EngineProfile, stored | {"prefill_queue": "chunky"})
    assert (caught.value.reason, caught.value.path) == ("expected one of 'batched', 'serial'", "$.prefill_queue")
    # Written before the probe: no verdict, which placement learns from traffic.
    assert parse_as(EngineProfile, {k: v for k, v in stored.items() if k != "prefill_queue"}).prefill_queue is None
