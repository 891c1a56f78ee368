"""The router's execution path (issue rules 3 and 4, journal fields of a success)."""

from __future__ import annotations

import json
import time

import pytest
import trio

from narwhal.config import FaultSpec

from .routerkit import engine, fleet_doc, open_stack

PROMPT = " ".join(f"w{i}" for i in range(100))  # exactly 100 tokens
PREFILL_S = 0.010 + 1e-4 * 100  # the SIM latency model of routerkit
STEP_S = 0.005


async def test_streamed_completion_and_journal(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        t0 = trio.current_time()
        status, events = await stack.stream(
            {"model": "sim-llama", "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True}
        )
        assert status == 200
        assert events[-1] == "[DONE]"
        token_events = [e for e in events[:-1] if e.get("choices")]
        ids = [t for e in token_events for t in e["choices"][0]["token_ids"]]
        assert len(ids) == 8
        assert trio.current_time() - t0 == pytest.approx(PREFILL_S + 8 * STEP_S, abs=1e-6)
    [rec] = stack.records
    assert rec["terminal_class"] == "ok"
    assert rec["status"] == 200
    assert rec["prompt_tokens"] == 100
    assert rec["requested_output_len"] == 8
    assert rec["output_len"] == 8
    assert rec["producer"] == "p0" and rec["consumer"] == "d0"
    assert rec["ttft_s"] == pytest.approx(PREFILL_S, abs=1e-6)
    assert rec["first_byte_s"] == pytest.approx(PREFILL_S + STEP_S, abs=1e-6)
    # TPOT: prefill completion to final decode token over output_len - 1.
    assert rec["tpot_s"] == pytest.approx(8 * STEP_S / 7, abs=1e-6)
    assert [a["outcome"] for a in rec["attempts"]] == ["ok"]
    assert rec["stream"] is True


async def test_non_streaming_completion(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        resp = await stack.complete({"prompt": PROMPT, "max_tokens": 5, "return_token_ids": True})
        assert resp.status_code == 200
        body = resp.json()
        assert body["object"] == "text_completion"
        assert len(body["choices"][0]["token_ids"]) == 5
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
    assert stack.records[0]["output_len"] == 5
    assert stack.records[0]["stream"] is False


async def test_chat_streaming_and_not(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        messages = [{"role": "user", "content": "tell me a story"}]
        status, events = await stack.stream(
            {"messages": messages, "max_tokens": 4, "return_token_ids": True}, path="/v1/chat/completions"
        )
        assert status == 200 and events[-1] == "[DONE]"
        ids = [t for e in events[:-1] for c in e.get("choices", []) for t in (c.get("token_ids") or [])]
        assert len(ids) == 4
        resp = await stack.client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
        assert resp.status_code == 200
        assert resp.json()["object"] == "chat.completion"
        assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    assert [r["route"] for r in stack.records] == ["chat", "chat"]


async def test_request_id_is_honoured_and_backend_ids_are_fresh(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        for _ in range(2):
            resp = await stack.complete({"prompt": "a b c", "max_tokens": 2}, headers={"x-request-id": "client-42"})
            assert resp.headers["x-request-id"] == "client-42"
    assert [r["request_id"] for r in stack.records] == ["client-42", "client-42"]
    backend_ids = [a[k] for r in stack.records for a in r["attempts"] for k in ("prefill_request_id", "decode_request_id")]
    assert len(set(backend_ids)) == 4
    assert all(i.startswith("client-42-") for i in backend_ids)
    # The engines saw exactly those ids, each once, on the leg the journal names.
    by_engine = {name: stack.engine(name).request_ids_seen for name in ("p0", "d0")}
    assert by_engine == {
        "p0": [a["prefill_request_id"] for r in stack.records for a in r["attempts"]],
        "d0": [a["decode_request_id"] for r in stack.records for a in r["attempts"]],
    }


async def test_prompt_over_context_is_400_before_engine_work(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"], max_model_len=64),
        engine("d0", 8102, ["decode"], max_model_len=64),
        controller={"prompt_tokens": "tokenize"},
    )
    async with open_stack(doc) as stack:
        resp = await stack.complete({"prompt": " ".join(["x"] * 60), "max_tokens": 5})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert "64" in resp.json()["error"]["message"]
        generation = [b for e in ("p0", "d0") for b in stack.engine(e).requests_seen if "prompt" in b or "messages" in b]
        assert generation == []
    assert stack.records[0]["terminal_class"] == "invalid_request"
    assert stack.records[0]["status"] == 400


async def test_estimated_prompt_over_context_is_the_producers_400(autojump_clock: trio.abc.Clock) -> None:
    # An estimate never refuses a request; the producer's exact count does, before any
    # decode work starts. A prompt the producer itself cannot take gets vLLM's own 400.
    doc = fleet_doc(engine("p0", 8101, ["prefill"], max_model_len=64), engine("d0", 8102, ["decode"], max_model_len=64))
    async with open_stack(doc) as stack:
        resp = await stack.complete({"prompt": " ".join(["x"] * 60), "max_tokens": 5})
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["type"] == "invalid_request_error"
        assert "maximum context length is 64" in error["message"]
        assert stack.engine("p0").stats.calls.get("/tokenize", 0) == 0
        assert not [b for b in stack.engine("d0").requests_seen if "prompt" in b]
        resp = await stack.complete({"prompt": " ".join(["x"] * 70), "max_tokens": 5})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 64" in resp.json()["error"]["message"]
        assert not [b for b in stack.engine("d0").requests_seen if "prompt" in b]
    assert [r["terminal_class"] for r in stack.records] == ["invalid_request"] * 2
    assert [r["status"] for r in stack.records] == [400, 400]
    assert stack.records[0]["prompt_tokens"] == 60


async def test_context_length_message_is_the_same_whichever_check_fires(autojump_clock: trio.abc.Clock) -> None:
    # Three checks can refuse a prompt over max_model_len: the router's exact count before
    # any engine work, its check of the producer's count after the prefill leg, and the
    # producer's own 400 (the prefill leg asks it for one token). All three count the
    # client's max_tokens and say it in one message.
    def doc(**controller: str) -> dict[str, object]:
        engines = (engine("p0", 8101, ["prefill"], max_model_len=64), engine("d0", 8102, ["decode"], max_model_len=64))
        return fleet_doc(*engines, controller=controller) if controller else fleet_doc(*engines)

    def expected(prompt: int, output: int) -> str:
        return (
            f"this model's maximum context length is 64 tokens; the request has {prompt} prompt tokens "
            f"and asks for {output} output tokens"
        )

    seen: dict[str, list[dict[str, object]]] = {}
    for name, fleet in (("exact", doc(prompt_tokens="tokenize")), ("estimated", doc())):
        async with open_stack(fleet) as stack:
            bodies = []
            for words, max_tokens in ((60, 5), (70, 5), (64, 1)):
                resp = await stack.complete({"prompt": " ".join(["x"] * words), "max_tokens": max_tokens})
                assert resp.status_code == 400, (name, resp.text)
                bodies.append(resp.json())
            # Chat without max_tokens: the output vLLM would default to.
            messages = [{"role": "user", "content": " ".join(["x"] * 80)}]
            resp = await stack.client.post("/v1/chat/completions", json={"messages": messages})
            assert resp.status_code == 400, (name, resp.text)
            bodies.append(resp.json())
        assert [r["terminal_class"] for r in stack.records] == ["invalid_request"] * 4
        seen[name] = bodies
    assert seen["estimated"] == seen["exact"]
    chat_prompt = seen["exact"][3]["error"]["message"].split("has ")[1].split(" ")[0]  # the chat template's count
    assert [b["error"] for b in seen["exact"]] == [
        {"message": expected(60, 5), "type": "invalid_request_error", "code": "context_length_exceeded"},
        {"message": expected(70, 5), "type": "invalid_request_error", "code": "context_length_exceeded"},
        {"message": expected(64, 1), "type": "invalid_request_error", "code": "context_length_exceeded"},
        {"message": expected(int(chat_prompt), 1), "type": "invalid_request_error", "code": "context_length_exceeded"},
    ]


async def test_estimated_prompt_lengths_learn_the_engines_counts(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(fleet_doc()) as stack:
        assert not stack.router.state.exact_prompt_counts
        for n in (10, 40, 80):
            resp = await stack.complete({"prompt": " ".join(["word"] * n), "max_tokens": 2})
            assert resp.status_code == 200
        # Chat without max_tokens: the output limit follows the exact count.
        resp = await stack.client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello there"}]}
        )
        assert resp.status_code == 200
        assert stack.engine("p0").stats.calls.get("/tokenize", 0) == 0
        lengths = stack.router.state.prompt_lengths
    assert lengths.observations["completions"] == 3
    # The journal carries the producer's exact counts, whatever the estimate was.
    assert [r["prompt_tokens"] for r in stack.records[:3]] == [10, 40, 80]
    size = len(" ".join(["word"] * 40))
    assert abs(lengths.estimate("completions", size) - 40) <= 2


async def test_priced_placement_tokenizes_by_default(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack(fleet_doc(), priced=True) as stack:
        assert stack.router.state.exact_prompt_counts
        resp = await stack.complete({"prompt": "a b c", "max_tokens": 2})
        assert resp.status_code == 200
        assert stack.engine("p0").stats.calls.get("/tokenize", 0) == 1


async def test_client_kv_transfer_params_never_reach_an_engine(autojump_clock: trio.abc.Clock) -> None:
    evil = {"do_remote_prefill": True, "remote_engine_id": "evil", "remote_block_ids": [[1]],
            "remote_request_id": "x", "remote_host": "evil.example", "remote_port": 1}
    async with open_stack() as stack:
        resp = await stack.complete({"prompt": "a b c", "max_tokens": 2, "kv_transfer_params": evil})
        assert resp.status_code == 200
        bodies = stack.engine("p0").requests_seen + stack.engine("d0").requests_seen
    for body in bodies:
        params = body.get("kv_transfer_params")
        assert params is None or params.get("remote_engine_id") != "evil"
        assert "evil.example" not in repr(body)
    decode_bodies = [b for b in bodies if b.get("stream")]
    assert decode_bodies and all(b["kv_transfer_params"]["remote_host"] == "p0.kv.test" for b in decode_bodies)


async def test_prefill_is_one_token_and_decode_gets_descriptor_and_sampling(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        await stack.complete({"prompt": "a b c", "max_tokens": 7, "temperature": 0.3, "top_p": 0.9, "stream": False})
        [prefill] = [b for b in stack.engine("p0").requests_seen if "prompt" in b]
        [decode] = [b for b in stack.engine("d0").requests_seen if "prompt" in b]
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert decode["prompt"] == "a b c" and decode["max_tokens"] == 7
    assert decode["temperature"] == 0.3 and decode["top_p"] == 0.9
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert decode["kv_transfer_params"]["remote_host"] == "p0.kv.test"


async def test_same_worker_decode_strips_every_transfer_parameter(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(engine("both", 8101, ["prefill", "decode"]))
    async with open_stack(doc) as stack:
        resp = await stack.complete(
            {"prompt": "a b c", "max_tokens": 3, "kv_transfer_params": {"do_remote_prefill": True}}
        )
        assert resp.status_code == 200
        bodies = [b for b in stack.engine("both").requests_seen if "prompt" in b]
    assert len(bodies) == 2
    assert all("kv_transfer_params" not in b for b in bodies)
    [rec] = stack.records
    assert rec["attempts"][0]["same_worker"] is True


async def test_models_and_health(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        listed = await stack.client.get("/v1/models")
        assert listed.headers["content-type"] == "application/json"
        models = listed.json()
        [entry] = models["data"]
        created = entry["created"]
        assert isinstance(created, int) and abs(created - time.time()) < 3600
        # The OpenAI list shape, compact; the context limit the engines reported.
        assert listed.content == json.dumps({"object": "list", "data": [
            {"id": "sim-llama", "object": "model", "created": created, "owned_by": "narwhal", "max_model_len": 4096}
        ]}, separators=(",", ":")).encode()  # fmt: skip
        health = await stack.client.get("/health")
        assert health.status_code == 200
        assert health.headers["content-type"] == "application/json"
        assert health.content == b'{"status":"ready","engines":{"p0":"ok","d0":"ok"}}'
        resp = await stack.complete({"model": "nope", "prompt": "a", "max_tokens": 1})
        assert resp.status_code == 404
        assert resp.json()["error"]["type"] == "not_found_error"


async def test_health_names_each_engines_breaker_state(autojump_clock: trio.abc.Clock) -> None:
    doc = fleet_doc(
        engine("p0", 8101, ["prefill"]), engine("d0", 8102, ["decode"]), engine("d1", 8103, ["decode"]),
        recovery={"eject_after": 1, "probe_interval_s": 1000.0},
    )
    async with open_stack(doc) as stack:
        for name in ("d0", "d1"):
            stack.engine(name).inject(FaultSpec(kind="http_error", on="decode", status=500))
        assert (await stack.complete({"prompt": "a", "max_tokens": 1})).status_code == 502
        health = await stack.client.get("/health")
        assert health.status_code == 200
        assert health.json()["engines"] == {"p0": "ok", "d0": "ejected", "d1": "ok"}
        # The last decode engine fails too: ejected all the same, so the router cannot
        # decode until a probe readmits one of them.
        assert (await stack.complete({"prompt": "a", "max_tokens": 1})).status_code == 502
        health = await stack.client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": "no engine can decode now",
                                 "engines": {"p0": "ok", "d0": "ejected", "d1": "ejected"}}  # fmt: skip


async def test_bad_bodies_are_400(autojump_clock: trio.abc.Clock) -> None:
    async with open_stack() as stack:
        for body, fragment in [
            (b"not json", "not valid JSON"),
            (b"[]", "JSON object"),
            (b'{"max_tokens": 3}', "'prompt' is required"),
            (b'{"prompt": "a", "max_tokens": "3"}', "'max_tokens' must be an integer"),
            (b'{"prompt": "a", "max_tokens": -1}', "'max_tokens' must be >= 1"),
            (b'{"prompt": "a", "n": 2}', "'n' > 1"),
            (b'{"prompt": 5}', "'prompt' must be"),
        ]:
            resp = await stack.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert resp.status_code == 400, body
            assert fragment in resp.json()["error"]["message"], (body, resp.json())
        resp = await stack.client.get("/v1/completions")
        assert resp.status_code == 405
        assert resp.json()["error"]["message"] == "GET is not allowed on /v1/completions"
        resp = await stack.client.put("/v1/chat/completions")
        assert resp.status_code == 405
        assert resp.json()["error"]["message"] == "PUT is not allowed on /v1/chat/completions"
        resp = await stack.client.get("/nope")
        assert resp.status_code == 404
        assert resp.json()["error"]["message"] == "no route for GET /nope"
    assert all(r["terminal_class"] == "invalid_request" for r in stack.records)
