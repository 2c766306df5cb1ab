"""Structured-output fields of the OpenAI API (issue 24, item 4): what reaches the engine, a
forced tool call's answer, and the bad-input matrix (each a 400 naming its field)."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from models.grammar import GrammarSpec
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.testing import FakeEngine, tiny_byte_tokenizer

TOK = tiny_byte_tokenizer()
MSGS = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def served(answer: str = "x"):
    engine = FakeEngine(script=lambda r: TOK.encode(answer) + [0], eos_token_id=0)
    return engine, TestClient(build_fastapi_app(OpenAIServer(engine, TOK, ServerSettings(max_context=256))))


def post(client, path, body):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MSGS}
    return client.post(path, json={**base, "max_tokens": 30, **body})


@pytest.mark.parametrize("path, body, kind", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "json_object"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, "json_schema"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}}, "json_schema"),
    ("/v1/completions", {"guided_regex": "[a-z]+"}, "regex"),
    ("/v1/chat/completions", {"guided_choice": ["yes", "no"]}, "choice"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required"}, "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "none"}, None),
])
def test_the_grammar_reaches_the_engine_one_per_choice(path, body, kind):
    engine, client = served()
    r = post(client, path, {**body, "n": 2})
    assert r.status_code == 200, r.text
    grammars = [req.sampling.grammar for req in engine.requests]
    if kind is None:
        assert grammars == [None, None]
        return
    assert all(isinstance(g, GrammarSpec) and g.kind == kind for g in grammars)
    assert grammars[0] == grammars[1] and grammars[0] is not grammars[1]     # a cursor each
    if "json_schema" in json.dumps(body):
        assert grammars[0].strict == bool(body["response_format"]["json_schema"].get("strict"))


def test_a_named_tool_call_is_answered_as_tool_calls():
    engine, client = served('{"city": "Paris"}')
    r = post(client, "/v1/chat/completions", {"tools": [WEATHER, CLOCK], "parallel_tool_calls": False,
                                              "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert choice["message"]["content"] is None and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert json.loads(engine.requests[0].sampling.grammar.source) == WEATHER["function"]["parameters"]


def test_required_among_tools_names_the_one_called():
    _, client = served('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    r = post(client, "/v1/chat/completions", {"tools": [WEATHER, CLOCK], "tool_choice": "required", "max_tokens": 80})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call == {"name": "get_time", "arguments": '{"zone": "UTC"}'}


def test_a_tool_call_cut_by_length_keeps_length():
    _, client = served('{"city": "Paris"}')
    r = post(client, "/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 3})
    assert r.json()["choices"][0]["finish_reason"] == "length"


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "properties": {"x": {"$ref": "#/nowhere"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_regex": "([a-"}, "guided_regex"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice.1"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [WEATHER]}, "tool_choice"),                                   # "auto", the default
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "stream": True}, "stream"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_structured_input_is_a_400_naming_the_field(body, param):
    engine, client = served()
    r = post(client, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert engine.requests == []


def test_completions_take_no_tools_and_grammars_refuse_min_tokens_and_ignore_eos():
    engine, client = served()
    r = post(client, "/v1/completions", {"tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    for name, value in (("min_tokens", 2), ("ignore_eos", True)):
        r = post(client, "/v1/completions", {"guided_regex": "a+", name: value})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
    assert engine.requests == []


def test_the_server_registers_its_vocabulary_as_it_starts():
    """xgrammar's table of the server's tokenizer is made when the server is built, not on the
    first structured request; a tokenizer it cannot take leaves the server up."""
    from serving import structured

    tok = tiny_byte_tokenizer()
    OpenAIServer(FakeEngine(), tok, ServerSettings(max_context=256))
    key = structured._server_vocabularies.get(id(tok))
    assert key is not None and structured.vocabulary_of(tok) == key

    class NoVocabulary:
        name_or_path = ""

        def __len__(self) -> int:
            return 3

    assert structured.preload_server_vocabulary(NoVocabulary()) is None
