"""The OpenAI-compatible HTTP layer in-process: FastAPI TestClient + FakeEngine (no Ray)."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from serving.openai_api import DEFAULT_CHAT_TEMPLATE, OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)


def make(engine=None, tokenizer=TOK, **settings):
    engine = engine or FakeEngine(script=lambda r: OUT, eos_token_id=0)
    server = OpenAIServer(engine, tokenizer, ServerSettings(**{"max_context": 256, **settings}))
    return engine, server, TestClient(build_fastapi_app(server))


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def sse(response):
    """The data payloads of an SSE body, checking the framing on the way."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "", "the body must end with a blank line"
    payloads = []
    for ev in events[:-1]:
        assert ev.startswith("data: "), ev
        payloads.append(ev[len("data: "):])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def completion(client, **body):
    return client.post("/v1/completions", json={"model": "specflash", "prompt": "hi", **body})


def test_completion_text_usage_and_finish_reason():
    engine, _, client = make()
    r = completion(client, max_tokens=20, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "specflash"
    (choice,) = body["choices"]
    assert choice["text"] == decode(OUT[:20]) and choice["finish_reason"] == "length"
    u = body["usage"]
    assert u["prompt_tokens"] == len(TOK.encode("hi")) and u["completion_tokens"] == 20
    assert u["total_tokens"] == u["prompt_tokens"] + 20
    assert u["drafted_tokens"] > 0 and 0 < u["accepted_tokens"] < 20
    assert "token_ids" not in choice
    (req,) = engine.requests
    assert req.sampling.max_tokens == 20 and req.sampling.temperature == 0.0
    assert req.prompt_token_ids == TOK.encode("hi")
    ids = completion(client, max_tokens=20, return_token_ids=True).json()["choices"][0]["token_ids"]
    assert ids == OUT[:20]


def test_streamed_pieces_concatenate_to_non_streamed_text():
    _, _, client = make()
    whole = completion(client, max_tokens=60).json()["choices"][0]["text"]
    chunks = sse(completion(client, max_tokens=60, stream=True))
    assert len(chunks) > 5
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole == decode(OUT[:60])
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all("\ufffd" not in c["choices"][0]["text"] for c in chunks)


def test_stream_include_usage_sends_a_usage_chunk_last():
    _, _, client = make()
    chunks = sse(completion(client, max_tokens=7, stream=True,
                            stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7


def test_eos_finishes_with_stop():
    engine = FakeEngine(script=lambda r: TOK.encode("abc") + [0] + OUT, eos_token_id=0)
    _, _, client = make(engine)
    choice = completion(client, max_tokens=50).json()["choices"][0]
    assert choice == {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop"}
    engine2 = FakeEngine(script=lambda r: TOK.encode("abc") + [0] + OUT, eos_token_id=0)
    _, _, client2 = make(engine2)
    r = completion(client2, max_tokens=10, ignore_eos=True).json()
    assert r["usage"]["completion_tokens"] == 10 and engine2.requests[0].sampling.ignore_eos


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_truncate_and_abort_the_engine(stream):
    engine, _, client = make()
    full = decode(OUT[:100])
    stop = "café"
    expected = full[:full.index(stop)]
    r = completion(client, max_tokens=100, stop=[stop, "never-there"], stream=stream)
    if stream:
        chunks = sse(r)
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
    assert text == expected and reason == "stop"
    assert engine.aborted == [engine.requests[0].request_id]


def test_chat_default_template_and_stream_format():
    engine, server, client = make()
    assert server.chat_template is DEFAULT_CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hé"}, {"type": "text", "text": "llo"}]}]
    r = client.post("/v1/chat/completions", json={"model": "specflash", "messages": msgs,
                                                  "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": decode(OUT[:12])}
    expected_prompt = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n"
                       "<|im_start|>assistant\n")
    assert engine.requests[0].prompt_token_ids == TOK.encode(expected_prompt)
    chunks = sse(client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12,
                                                           "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == decode(OUT[:12])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_uses_the_tokenizers_template_and_default_max_tokens_fills_context():
    tok = tiny_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}>"
    engine, _, client = make(tokenizer=tok)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200, r.text
    req = engine.requests[0]
    assert req.prompt_token_ids == tok.encode("[user]x>")
    assert req.sampling.max_tokens == 256 - len(req.prompt_token_ids)


def test_token_id_prompts_batches_n_seeds_and_speculation():
    engine, _, client = make()
    r = completion(client, prompt=[[5, 6, 7], [8, 9]], n=2, seed=11, max_tokens=4,
                   temperature=0.7, top_p=0.9, top_k=5,
                   speculation={"mode": "tree", "spec_len": 4, "tree_width": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == 5
    assert sorted(tuple(q.prompt_token_ids) for q in engine.requests) == [(5, 6, 7)] * 2 + [(8, 9)] * 2
    assert sorted(q.sampling.seed for q in engine.requests) == [11, 12, 13, 14]
    q = engine.requests[0]
    assert (q.sampling.top_k, q.sampling.top_p, q.sampling.temperature) == (5, 0.9, 0.7)
    assert (q.speculation.mode, q.speculation.spec_len, q.speculation.tree_width) == ("tree", 4, 2)
    off = completion(client, max_tokens=4, speculation={"mode": "off"}).json()["usage"]
    assert off["drafted_tokens"] == 0 and off["accepted_tokens"] == 0


def test_n_streams_interleave_with_indices():
    _, _, client = make()
    chunks = sse(completion(client, n=3, max_tokens=9, stream=True))
    for i in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(m["text"] for m in mine) == decode(OUT[:9])
        assert mine[-1]["finish_reason"] == "length"


LONG = "x " * 300  # over the 256-token context of these tests

BAD = [
    # (body or raw bytes, status, code, param)
    (b"{not json", 400, "invalid_json", None),
    (b"[1, 2]", 400, "invalid_json", None),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "invalid_type", "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"prompt": 5}, 400, "invalid_type", "prompt"),
    ({"prompt": "hi", "stream": "yes"}, 400, "invalid_type", "stream"),
    ({"max_tokens": 5}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 256}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, 400, "context_length_exceeded", "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "invalid_value", "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "invalid_value", "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "invalid_value", "top_p"),
    ({"prompt": "hi", "n": 0}, 400, "invalid_value", "n"),
    ({"prompt": LONG}, 400, "context_length_exceeded", "prompt"),
    ({"prompt": [1, 2, 10**6]}, 400, "invalid_value", "prompt"),
    ({"prompt": ""}, 400, "invalid_value", "prompt"),
    ({"prompt": "hi", "speculation": {"mode": "sideways"}}, 400, "invalid_value", "speculation.mode"),
    ({"prompt": "hi", "speculation": {"spec_len": 99}}, 400, "invalid_value", "speculation.spec_len"),
    ({"prompt": "hi", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    ({"prompt": "hi", "echo": "yes"}, 400, "invalid_type", "echo"),
    ({"prompt": "hi", "best_of": 3, "n": 4}, 400, "invalid_value", "best_of"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, 400, "invalid_value", "best_of"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model_not_found", "model"),
]


@pytest.mark.parametrize("body,status,code,param", BAD)
def test_bad_input_matrix(body, status, code, param):
    engine, _, client = make()
    if isinstance(body, bytes):
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    assert err["code"] == code and err.get("param") == param
    assert err["type"] == ("invalid_request_error")
    assert engine.requests == []


def test_bad_chat_messages():
    _, _, client = make()
    for body in ({"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": "hello"}):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages" or \
            r.json()["error"]["param"].startswith("messages"), r.text


def test_queue_full_is_429_with_retry_after():
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05)
    _, server, client = make(engine, max_queue=2)
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "a", "max_tokens": 50, "stream": True, "n": 2}) as r1:
        assert r1.status_code == 200
        assert server.outstanding == 2
        r2 = completion(client, max_tokens=2)
        assert r2.status_code == 429 and r2.headers["retry-after"] == "1"
        assert r2.json()["error"]["code"] == "queue_full"
    assert len(engine.requests) == 2
    r3 = completion(client, max_tokens=2)
    assert r3.status_code == 200 and server.outstanding == 0


def test_overloaded_engine_is_503_with_retry_after():
    engine = FakeEngine(script=lambda r: OUT, fail_with="KV cache full (retryable)")
    _, _, client = make(engine)
    r = completion(client, max_tokens=4)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "engine_overloaded"
    r = completion(client, max_tokens=4, stream=True)
    assert r.status_code == 503
    engine.fail_with = "weights exploded"
    r = completion(client, max_tokens=4)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_aborts(stream):
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05, chunk_size=1)
    _, server, client = make(engine, request_timeout_s=0.3)
    r = completion(client, max_tokens=200, stream=stream)
    if stream:
        chunks = sse(r)
        assert chunks[-1]["error"]["code"] == "request_timeout"
    else:
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    assert engine.aborted == [engine.requests[0].request_id] and server.outstanding == 0


def test_health_models_and_metrics():
    engine, _, client = make()
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["speculation"] is True
    assert client.get("/v1/models").json()["data"][0]["id"] == "specflash"
    completion(client, max_tokens=10)
    sse(completion(client, max_tokens=10, stream=True))
    completion(client, max_tokens=0)
    text = client.get("/metrics").text
    assert 'specflash_requests_total{endpoint="/v1/completions",status="200"} 2.0' in text
    assert 'specflash_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    assert "specflash_time_to_first_token_seconds_count 2.0" in text
    # Per token after the first chunk (3 tokens here): 2 requests x (10 - 3).
    assert "specflash_inter_token_latency_seconds_count 14.0" in text
    assert "specflash_generation_tokens_total 20.0" in text
    assert "specflash_queue_depth 0.0" in text
    assert "specflash_spec_acceptance_rate 0.75" in text
    assert "specflash_spec_mean_accepted_length 3.25" in text
    assert "specflash_spec_verifier_idle_fraction 0.125" in text
    assert "specflash_engine_kv_blocks_free 64.0" in text
    engine.ready = False
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "unavailable"


@pytest.fixture
def live_server():
    """The app under a real uvicorn (TestClient cannot drop a connection mid-stream)."""
    import socket
    import threading
    import time

    import uvicorn

    engine = FakeEngine(script=lambda r: OUT * 50, delay_s=0.02, chunk_size=1)
    server = OpenAIServer(engine, TOK, ServerSettings(max_context=100_000, disconnect_poll_s=0.05))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_fastapi_app(server), port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield engine, server, f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(10)


def wait_for(predicate, timeout=5.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_generation(live_server, stream):
    import httpx

    engine, server, url = live_server
    body = {"prompt": "hi", "max_tokens": 5000, "stream": stream, "ignore_eos": True}
    if stream:
        with httpx.Client(timeout=10) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
    assert wait_for(lambda: len(engine.aborted) == 1), "the engine was never told"
    rid = engine.requests[0].request_id
    assert engine.aborted == [rid] and rid not in engine.active and rid not in engine.finished
    assert wait_for(lambda: server.outstanding == 0)


def test_api_key_guards_v1_routes_but_not_health():
    _, _, client = make(api_key="s3cret")
    r = completion(client, max_tokens=2)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert client.post("/v1/completions", json={"prompt": "hi"}, headers=wrong).status_code == 401
    ok = {"Authorization": "Bearer s3cret"}
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers=ok).status_code == 200
    assert client.get("/v1/models", headers=ok).status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
