"""No field a client sends is dropped (issue 24, item 1): every OpenAI field of completions and chat
is implemented, a documented no-op, or a 400 that names it; the smaller gaps of item 6."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_models import NO_OP_FIELDS, REFUSED_CHAT, REFUSED_COMPLETION, is_off
from serving.openai_routes import build_fastapi_app
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def served():
    engine = FakeEngine(script=lambda r: OUT, eos_token_id=0)
    server = OpenAIServer(engine, TOK, ServerSettings(max_context=256))
    return engine, TestClient(build_fastapi_app(server))


def post(client, path, body, **kw):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MSGS}
    return client.post(path, json={**base, "max_tokens": 3, **body}, **kw)


def refused(r, code, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param, err
    assert param.split(".")[-1] in err["message"]


# -- refused and unknown fields ------------------------------------------------------
# One value per refused field that asks for something this server does not do.
ASKING = {"store": True,
          "service_tier": "flex", "suffix": "end",
          "functions": [{"name": "f"}], "function_call": "auto",
          "modalities": ["text", "audio"], "audio": {"voice": "alloy"},
          "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
          "verbosity": "low", "web_search_options": {}}
CASES = [(path, name) for path, table in (("/v1/completions", REFUSED_COMPLETION),
                                          ("/v1/chat/completions", REFUSED_CHAT)) for name in table]


def test_every_refused_field_has_an_asking_value():
    assert {name for _, name in CASES} == set(ASKING)


@pytest.mark.parametrize("path,name", CASES)
def test_a_refused_field_asking_for_something_is_a_400_naming_it(served, path, name):
    engine, client = served
    r = post(client, path, {name: ASKING[name]})
    refused(r, "unsupported_parameter", name)
    assert engine.requests == []


@pytest.mark.parametrize("path,name", CASES)
def test_a_refused_field_at_its_off_value_is_served(served, path, name):
    engine, client = served
    table = REFUSED_COMPLETION if path == "/v1/completions" else REFUSED_CHAT
    for off in table[name].off:
        r = post(client, path, {name: off})
        assert r.status_code == 200, (name, off, r.text)
    assert len(engine.requests) == len(table[name].off)


def test_is_off_compares_type_and_value():
    assert is_off(0, (None, 0.0)) and is_off(1.0, (1,)) and is_off(None, (None,))
    assert not is_off(0, (None, False)) and not is_off(False, (0,)) and not is_off(True, (1,))
    assert is_off({"type": "text"}, ({"type": "text"},))
    assert not is_off({"type": "text", "x": 1}, ({"type": "text"},))


UNKNOWN = [
    ("/v1/completions", {"guided_json": {}}, "guided_json"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"tools": []}, "tools"),                 # a chat field, on completions
    ("/v1/chat/completions", {"prompt": "x"}, "prompt"),        # a completions field, on chat
    ("/v1/chat/completions", {"echo": False}, "echo"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("/v1/completions", {"speculation": {"mode": "off", "depth": 3}}, "speculation.depth"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "tool_calls": []}]},
     "messages.0.tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a", "cache_control": {}}]}]}, "messages.0.content.0.cache_control"),
]


@pytest.mark.parametrize("path,body,param", UNKNOWN)
def test_an_unknown_field_is_a_400_naming_it(served, path, body, param):
    engine, client = served
    refused(post(client, path, body), "unknown_parameter", param)
    assert engine.requests == []


def test_no_op_fields_pass_and_are_type_checked(served):
    engine, client = served
    noop = {"user": "u-1", "metadata": {"team": "a"}, "safety_identifier": "h",
            "prompt_cache_key": "k"}
    assert set(noop) == set(NO_OP_FIELDS)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert post(client, path, noop).status_code == 200
    refused(post(client, "/v1/completions", {"user": 5}), "invalid_type", "user")
    refused(post(client, "/v1/completions", {"metadata": {"a": 1}}), "invalid_type", "metadata.a")


def test_message_name_reaches_the_chat_template():
    tok = tiny_byte_tokenizer()
    tok.chat_template = "{% for m in messages %}[{{ m['name'] or '-' }}]{{ m['content'] }}{% endfor %}"
    engine = FakeEngine(script=lambda r: OUT, eos_token_id=0)
    client = TestClient(build_fastapi_app(OpenAIServer(engine, tok, ServerSettings(max_context=256))))
    r = post(client, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "a", "name": "ann"}, {"role": "user", "content": "b"}]})
    assert r.status_code == 200, r.text
    assert engine.requests[0].prompt_token_ids == tok.encode("[ann]a[-]b")


# -- the sampling transforms (item 3): passed on exactly, bad values refused ------------
def test_penalties_bias_min_p_min_tokens_reach_the_engine(served):
    engine, client = served
    body = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
            "logit_bias": {"7": -100, "3": 2.5}, "min_p": 0.05, "min_tokens": 2}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert post(client, path, body).status_code == 200
    for req in engine.requests:
        sp = req.sampling
        assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.3)
        assert sp.logit_bias == [(3, 2.5), (7, -100.0)] and (sp.min_p, sp.min_tokens) == (0.05, 2)


TRANSFORM_BAD = [
    ({"presence_penalty": 2.5}, "invalid_value", "presence_penalty"),
    ({"frequency_penalty": -3}, "invalid_value", "frequency_penalty"),
    ({"frequency_penalty": "high"}, "invalid_type", "frequency_penalty"),
    ({"repetition_penalty": 0}, "invalid_value", "repetition_penalty"),
    ({"min_p": 1.5}, "invalid_value", "min_p"),
    ({"min_p": True}, "invalid_type", "min_p"),
    ({"min_tokens": -1}, "invalid_value", "min_tokens"),
    ({"min_tokens": 4, "max_tokens": 3}, "invalid_value", "min_tokens"),
    ({"logit_bias": {"5": 101}}, "invalid_value", "logit_bias.5"),
    ({"logit_bias": {"5": "up"}}, "invalid_type", "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "invalid_value", "logit_bias"),
    ({"logit_bias": [1, 2]}, "invalid_type", "logit_bias"),
]


@pytest.mark.parametrize("body,code,param", TRANSFORM_BAD)
def test_bad_transform_values_are_400s(served, body, code, param):
    engine, client = served
    refused(post(client, "/v1/completions", body), code, param)
    assert engine.requests == []


# -- the smaller gaps (item 6) -------------------------------------------------------
def test_get_a_model_by_id(served):
    _, client = served
    listed = client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/specflash")
    assert r.status_code == 200 and r.json() == listed and listed["id"] == "specflash"
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_stream_is_a_400(served, path):
    engine, client = served
    for stream in ({}, {"stream": False}):
        r = post(client, path, {**stream, "stream_options": {"include_usage": True}})
        refused(r, "invalid_value", "stream_options")
    assert post(client, path, {"stream_options": None}).status_code == 200
    assert len(engine.requests) == 1


def test_stop_token_ids_must_be_in_the_vocabulary(served):
    engine, client = served
    vocab = len(TOK)
    refused(post(client, "/v1/completions", {"stop_token_ids": [1, vocab]}), "invalid_value",
            "stop_token_ids")
    refused(post(client, "/v1/chat/completions", {"stop_token_ids": [-1]}), "invalid_value",
            "stop_token_ids")
    assert engine.requests == []
    assert post(client, "/v1/completions", {"stop_token_ids": [vocab - 1]}).status_code == 200
    assert engine.requests[0].sampling.stop_token_ids == [vocab - 1]


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "multipart/form-data; boundary=x"])
def test_a_json_body_needs_a_json_content_type(served, content_type):
    engine, client = served
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}', headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert engine.requests == []
    for ok in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                        headers={"content-type": ok})
        assert r.status_code == 200, (ok, r.text)


def test_return_token_ids_gives_prompt_token_ids(served):
    _, client = served
    r = post(client, "/v1/completions", {"prompt": [[5, 6, 7], [8, 9]], "n": 2,
                                         "return_token_ids": True}).json()
    for c in r["choices"]:
        assert c["prompt_token_ids"] == ([5, 6, 7] if c["index"] < 2 else [8, 9])
        assert c["token_ids"] == OUT[:3]
    events = [c["choices"][0] for c in sse_events(post(
        client, "/v1/completions", {"prompt": [5, 6], "n": 2, "stream": True, "return_token_ids": True}))]
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert mine[0]["prompt_token_ids"] == [5, 6]
        assert all("prompt_token_ids" not in e for e in mine[1:])
        assert sum((e["token_ids"] for e in mine), []) == OUT[:3]
    chat = post(client, "/v1/chat/completions", {"return_token_ids": True}).json()
    prompt = TOK.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat["prompt_token_ids"] == prompt and chat["choices"][0]["token_ids"] == OUT[:3]
    first = sse_events(post(client, "/v1/chat/completions", {"stream": True, "return_token_ids": True}))
    assert first[0]["prompt_token_ids"] == prompt
    assert "prompt_token_ids" not in post(client, "/v1/completions", {}).json()["choices"][0]


def sse_events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    data = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# -- log-probabilities (item 2): the engine's, in OpenAI's shapes, streamed or not ----------
def _text(t: int) -> str:
    return TOK.decode([t])


def test_completion_logprobs_whole_and_streamed(served):
    from serving.testing import fake_logprob

    _, client = served
    for k in (0, 3):
        whole = post(client, "/v1/completions", {"logprobs": k, "max_tokens": 7}).json()["choices"][0]["logprobs"]
        assert whole["tokens"] == [_text(t) for t in OUT[:7]]
        assert whole["token_logprobs"] == [fake_logprob(t, k).logprob for t in OUT[:7]]
        for t, top in zip(OUT[:7], whole["top_logprobs"]):
            lp = fake_logprob(t, k)
            assert top == {**{_text(u): v for u, v in lp.top}, _text(t): lp.logprob}
        assert whole["text_offset"] == [sum(len(x) for x in whole["tokens"][:j]) for j in range(7)]
        events = [c["choices"][0]["logprobs"] for c in sse_events(
            post(client, "/v1/completions", {"logprobs": k, "max_tokens": 7, "stream": True}))]
        joined = {key: sum((e[key] for e in events if e), []) for key in whole}
        assert joined == whole
    assert post(client, "/v1/completions", {}).json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_whole_and_streamed(served):
    from serving.testing import fake_logprob

    _, client = served
    body = {"logprobs": True, "top_logprobs": 2, "max_tokens": 5}
    whole = post(client, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]
    assert whole["refusal"] is None
    for t, entry in zip(OUT[:5], whole["content"], strict=True):
        lp = fake_logprob(t, 2)
        assert entry["token"] == _text(t) and entry["logprob"] == lp.logprob
        assert entry["bytes"] == list(_text(t).encode())
        assert [(e["token"], e["logprob"]) for e in entry["top_logprobs"]] == [(_text(u), v) for u, v in lp.top]
    chunks = sse_events(post(client, "/v1/chat/completions", {**body, "stream": True}))
    streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks[1:] if c["choices"][0]["logprobs"]), [])
    assert streamed == whole["content"]
    plain = post(client, "/v1/chat/completions", {"logprobs": True}).json()["choices"][0]["logprobs"]
    assert all(e["top_logprobs"] == [] for e in plain["content"]) and len(plain["content"]) == 3
    assert post(client, "/v1/chat/completions", {}).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,body,code,param", [
    ("/v1/completions", {"logprobs": 21}, "invalid_value", "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "invalid_value", "logprobs"),
    ("/v1/completions", {"logprobs": True}, "invalid_type", "logprobs"),
    ("/v1/chat/completions", {"logprobs": 2}, "invalid_type", "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "unknown_parameter", "top_logprobs"),
])
def test_bad_logprobs_are_400s(served, path, body, code, param):
    engine, client = served
    refused(post(client, path, body), code, param)
    assert engine.requests == []


def test_logprobs_reach_the_engine(served):
    engine, client = served
    post(client, "/v1/completions", {"logprobs": 4})
    post(client, "/v1/chat/completions", {"logprobs": True})
    post(client, "/v1/chat/completions", {"logprobs": False, "top_logprobs": None})
    assert [r.sampling.logprobs for r in engine.requests] == [4, 0, None]


def test_echo_puts_the_prompt_first_with_its_logprobs(served):
    from serving.testing import fake_logprob

    _, client = served
    text = post(client, "/v1/completions", {"echo": True, "prompt": "hé"}).json()["choices"][0]["text"]
    assert text == "hé" + TOK.decode(OUT[:3])
    prompt = TOK.encode("hé")
    for stream in (False, True):
        r = post(client, "/v1/completions", {"echo": True, "prompt": [prompt, [5, 6]], "logprobs": 1,
                                             "stream": stream})
        if stream:
            events = [c["choices"][0] for c in sse_events(r)]
            choices = []
            for i in (0, 1):
                mine = [e for e in events if e["index"] == i]
                choices.append({"text": "".join(e["text"] for e in mine),
                                "logprobs": {k: sum((e["logprobs"][k] for e in mine), [])
                                             for k in mine[0]["logprobs"]}})
        else:
            choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        for c, ids in zip(choices, (prompt, [5, 6])):
            lp = c["logprobs"]
            assert c["text"] == TOK.decode(ids) + TOK.decode(OUT[:3])
            assert lp["tokens"] == [_text(t) for t in ids + OUT[:3]]
            assert lp["token_logprobs"] == [None] + [fake_logprob(t, 1).logprob for t in ids[1:] + OUT[:3]]
            assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) >= 1
            assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]


def test_best_of_returns_the_n_most_likely(served):
    """FakeEngine's logprob of token t is -(t % 5) / 4: the scripts below rank by that sum."""
    scripts = {0: [5, 5, 5], 1: [1, 1, 1], 2: [10, 10, 10], 3: [3, 3, 3]}     # sums -0, -0.75, -0, -2.25
    engine = FakeEngine(script=lambda r: scripts[r.sampling.seed % 4], eos_token_id=None)
    client = TestClient(build_fastapi_app(OpenAIServer(engine, TOK, ServerSettings(max_context=256))))
    r = post(client, "/v1/completions", {"best_of": 4, "n": 2, "seed": 0}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [TOK.decode(scripts[0]), TOK.decode(scripts[2])]
    assert all(c["logprobs"] is None for c in r["choices"])          # ranked by them, not asked for them
    assert r["usage"]["completion_tokens"] == 12                     # every generation counts
    assert [q.sampling.logprobs for q in engine.requests] == [0] * 4
    asked = post(client, "/v1/completions", {"best_of": 4, "n": 1, "seed": 4, "logprobs": 1}).json()
    (c,) = asked["choices"]
    assert c["text"] == TOK.decode(scripts[0]) and len(c["logprobs"]["tokens"]) == 3
    two = post(client, "/v1/completions", {"prompt": [[7], [8]], "best_of": 2, "n": 1, "seed": 1}).json()
    assert [c["text"] for c in two["choices"]] == [TOK.decode(scripts[2]), TOK.decode(scripts[0])]
