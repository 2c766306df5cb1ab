"""Structured output through the HTTP API on the in-process engine (issue 24, item 4): sampled
answers to a nested json_schema all validate (jsonschema), greedy output is the same with
speculation off, chain and tree, and a forced tool call's arguments fit its parameters.

The tiny random model writes garbage within the grammar: an answer the grammar ended
(finish_reason "stop") must be valid JSON that validates; one cut by max_tokens must be a
prefix that the same grammar can still complete (checked by replaying its text).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from cluster.local import build_local_engine
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from speculation.settings import EngineSettings

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ada", "bob"]},
        "ok": {"type": "boolean"},
        "place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                   "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                  "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "ok", "place", "tags"], "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def client(tiny_target, far_draft):
    engine, tok = build_local_engine(str(tiny_target), str(far_draft), EngineSettings(max_batch_size=8, num_blocks=256))
    server = OpenAIServer(engine, tok, ServerSettings(max_context=engine.engine.max_context))
    yield TestClient(build_fastapi_app(server))
    engine.shutdown()


def completes(text: str, schema: dict) -> bool:
    """Whether `text` is a prefix of some output the schema's grammar allows."""
    import xgrammar as xgr
    from models.grammar import compile_grammar, GrammarSpec
    from serving.structured import _server_vocabularies

    key = next(iter(_server_vocabularies.values()))
    m = xgr.GrammarMatcher(compile_grammar(GrammarSpec("json_schema", json.dumps(schema), key)))
    return m.accept_string(text)


def check(choice: dict, schema: dict) -> None:
    text = choice["message"]["content"]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert choice["finish_reason"] == "length" and completes(text, schema), text


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_sampled_answers_to_a_nested_schema_validate(client, mode):
    r = client.post("/v1/chat/completions", json={
        "messages": MSGS, "response_format": FORMAT, "n": 6, "temperature": 1.0, "max_tokens": 90,
        "speculation": {"mode": mode, "spec_len": 3, "tree_width": 2 if mode == "tree" else None}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for c in choices:
        check(c, SCHEMA)
    assert any(c["finish_reason"] == "stop" for c in choices)


def test_greedy_json_is_the_same_with_speculation_off_chain_and_tree(client):
    texts = []
    for spec in ({"mode": "off"}, {"mode": "chain", "spec_len": 4}, {"mode": "tree", "spec_len": 3, "tree_width": 3}):
        r = client.post("/v1/chat/completions", json={
            "messages": MSGS, "response_format": FORMAT, "temperature": 0, "max_tokens": 90, "speculation": spec,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        check(c, SCHEMA)
        texts.append((c["message"]["content"], c["token_ids"], c["finish_reason"]))
    assert texts[0] == texts[1] == texts[2]


def test_json_object_regex_and_choice(client):
    import re

    r = client.post("/v1/chat/completions", json={"messages": MSGS, "response_format": {"type": "json_object"},
                                                  "temperature": 0, "max_tokens": 40})
    c = r.json()["choices"][0]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(c["message"]["content"]), dict)
    r = client.post("/v1/completions", json={"prompt": "id:", "guided_regex": "[a-c]{2}-[0-9]{1,3}", "n": 4,
                                             "max_tokens": 10, "temperature": 1.0})
    for c in r.json()["choices"]:
        assert re.fullmatch("[a-c]{2}-[0-9]{1,3}", c["text"]) and c["finish_reason"] == "stop", c
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "guided_choice": ["yes", "no", "maybe so"],
                                                  "n": 4, "max_tokens": 10, "temperature": 1.0})
    for c in r.json()["choices"]:
        assert c["message"]["content"] in ("yes", "no", "maybe so") and c["finish_reason"] == "stop", c


def test_a_forced_tool_call_fits_its_parameters(client):
    params = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "boolean"}},
              "required": ["unit", "days"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "forecast", "parameters": params}}
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "tools": [tool], "tool_choice": "required",
                                                  "max_tokens": 60, "temperature": 1.0, "n": 3})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        call = c["message"]["tool_calls"][0]["function"]
        assert call["name"] == "forecast" and c["finish_reason"] == "tool_calls", c
        jsonschema.validate(json.loads(call["arguments"]), params)
