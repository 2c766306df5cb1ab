"""Hostile input (issue 7): absurd values, deep nesting, bad bytes and huge bodies get a clear 4xx
over HTTP, and malformed gRPC messages get INVALID_ARGUMENT; the server keeps serving after each.

In-process over the FakeEngine; the schema-driven fuzz run is tests/serving/test_fuzz.py."""
from __future__ import annotations

import asyncio
import json
import math

import grpc
import pytest
from fastapi.testclient import TestClient

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.protos import specflash_pb2 as pb
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

from . import serving_helpers

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)
MB = 1 << 20


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine(script=lambda r: OUT, eos_token_id=0)
    server = OpenAIServer(engine, TOK, ServerSettings(max_context=256, max_request_bytes=4 * MB))
    return engine, server, TestClient(build_fastapi_app(server))


def post(client, body, path="/v1/completions", **kw):
    return client.post(path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                       headers={"Content-Type": "application/json", **kw.pop("headers", {})}, **kw)


def still_serves(client) -> None:
    r = post(client, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def nested(depth: int) -> str:
    return '{"prompt": ' + "[" * depth + "1" + "]" * depth + "}"


CASES = {
    "max_tokens 10^9": ({"prompt": "hi", "max_tokens": 10**9}, 400, "context_length_exceeded"),
    "max_tokens 10^30": ({"prompt": "hi", "max_tokens": 10**30}, 400, None),
    "n 10^6": ({"prompt": "hi", "n": 10**6}, 400, "invalid_value"),
    "a 1 MB stop string": ({"prompt": "hi", "stop": "x" * MB}, 400, "invalid_value"),
    "a million stop strings": ({"prompt": "hi", "stop": ["ab"] * 10**6}, 413, "request_too_large"),
    "17 stop strings": ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, 400, "invalid_value"),
    "100k nested lists": (nested(100_000), 400, "invalid_json"),
    "900 nested lists": (nested(900), 400, None),
    "nested objects": ('{"prompt": "hi", "speculation": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001,
                       400, "invalid_json"),
    "invalid UTF-8": (b'{"prompt": "\xff\xfe\xc3("}', 400, "invalid_json"),
    "a lone surrogate escape": ('{"prompt": "\\ud800", "max_tokens": 2}', 400, None),
    "NaN temperature": ('{"prompt": "hi", "temperature": NaN}', 400, None),
    "Infinity temperature": ('{"prompt": "hi", "temperature": Infinity}', 400, None),
    "temperature 1e308": ({"prompt": "hi", "temperature": 1e308, "max_tokens": 2}, 200, None),
    "seed 2^64": ({"prompt": "hi", "seed": 2**64}, 400, "invalid_value"),
    "token id 2^40": ({"prompt": [2**40]}, 400, "invalid_value"),
    "negative token id": ({"prompt": [-1]}, 400, "invalid_value"),
    "negative stop token id": ({"prompt": "hi", "stop_token_ids": [-3]}, 400, "invalid_value"),
    "a batch of 10^5 prompts": ({"prompt": [[1]] * 100_000}, 400, "invalid_value"),
    "empty inner prompt": ({"prompt": [[]]}, 400, None),
    "a JSON array body": ("[1, 2, 3]", 400, "invalid_json"),
    "an empty body": ("", 400, "invalid_json"),
    "null bytes": ('{"prompt": "a\\u0000b", "max_tokens": 2}', 200, None),
    "top_k 10^30": ({"prompt": "hi", "top_k": 10**30, "max_tokens": 2}, 200, None),
    "spec_len 10^6": ({"prompt": "hi", "speculation": {"mode": "chain", "spec_len": 10**6}}, 400,
                      "invalid_value"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_absurd_values_get_4xx_and_the_server_keeps_serving(served, name):
    body, status, code = CASES[name]
    engine, server, client = served
    r = post(client, body)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    if status >= 400:
        err = r.json()["error"]
        assert err["message"] and (code is None or err["code"] == code), err
    assert server.outstanding == 0
    still_serves(client)


def test_absurd_chat_values(served):
    _, _, client = served
    huge_history = {"messages": [{"role": "user", "content": "hi"}] * 50_000, "max_tokens": 2}
    assert post(client, huge_history, "/v1/chat/completions").status_code == 400
    deep_content = '{"messages": [{"role": "user", "content": ' + "[" * 100_000 + "]" * 100_000 + "}]}"
    r = post(client, deep_content, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    still_serves(client)


def test_a_body_over_the_limit_is_413_declared_or_streamed():
    engine = FakeEngine(script=lambda r: OUT)
    server = OpenAIServer(engine, TOK, ServerSettings(max_context=256, max_request_bytes=4096))
    client = TestClient(build_fastapi_app(server))
    big = json.dumps({"prompt": "x" * 5000})
    r = post(client, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 512):
            yield big[i:i + 512].encode()
    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert post(client, json.dumps({"prompt": "x" * 3000, "max_tokens": 2})).status_code == 400  # context
    assert post(client, {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert engine.requests and all(len(q.prompt_token_ids) < 10 for q in engine.requests)


def test_a_bad_content_length_is_400(served):
    _, _, client = served
    r = post(client, '{"prompt": "hi"}', headers={"Content-Length": "banana"})
    assert r.status_code in (400, 413) and r.status_code < 500


# ---- gRPC ------------------------------------------------------------------------------------
async def with_grpc(fn):
    return await serving_helpers.with_grpc(
        lambda channel, stub, engine, server: fn(channel, stub, engine),
        FakeEngine(script=lambda r: OUT), TOK)


GARBAGE = {
    "random bytes": bytes(range(256)) * 4,
    "a truncated varint": b"\x18\xff\xff\xff",
    "a length past the end": b"\x0a\xff\x01abc",
    "invalid UTF-8 in prompt": b"\x0a\x03\xff\xfe\xfd",
    "a wrong wire type for max_tokens": b"\x1a\x02hi\x0a\x02hi",   # field 3 as bytes
    "a huge field number": b"\xf8\xff\xff\xff\x0f\x01",
    "nested garbage in speculation": b"\x52\x04\xff\xff\xff\xff",
    "empty": b"",
}


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_garbage_bytes_are_a_clear_status_not_a_crash(method):
    async def go(channel, stub, engine):
        path = f"/specflash.Specflash/{method}"
        call = (channel.unary_unary if method == "Generate" else channel.unary_stream)(
            path, request_serializer=None, response_deserializer=None)
        codes = {}
        for name, data in GARBAGE.items():
            try:
                out = call(data, timeout=30)
                if method == "Generate":
                    await out
                else:
                    [m async for m in out]
                codes[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                codes[name] = e.code()
                assert e.details(), name
        ok = await stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=30)
        return codes, ok

    codes, ok = asyncio.run(with_grpc(go))
    # Bytes that parse are validated like any request. Protobuf skips a field sent with the wrong
    # wire type, as it does unknown fields: that request is prompt "hi", and is served.
    expected = {name: grpc.StatusCode.INVALID_ARGUMENT for name in GARBAGE}
    expected["a wrong wire type for max_tokens"] = grpc.StatusCode.OK
    assert codes == expected
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize("req", [
    pb.GenerateRequest(prompt="hi", max_tokens=2**31 - 1),
    pb.GenerateRequest(prompt="hi", max_tokens=-5),
    pb.GenerateRequest(prompt_token_ids=[-1, 5]),
    pb.GenerateRequest(prompt_token_ids=[2**31 - 1]),
    pb.GenerateRequest(prompt="hi", temperature=math.nan),
    pb.GenerateRequest(prompt="hi", temperature=math.inf),
    pb.GenerateRequest(prompt="hi", top_p=math.nan),
    pb.GenerateRequest(prompt="hi", top_k=-7),
    pb.GenerateRequest(prompt="hi", stop=["x" * MB]),
    pb.GenerateRequest(prompt="hi", stop=["s"] * 17),
    pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(mode="chain", spec_len=10**6)),
    pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(mode="tree", tree_width=-1)),
    pb.GenerateRequest(prompt="\ufffd" * 1000),
], ids=lambda r: str(r).replace("\n", " ")[:40])
def test_grpc_absurd_values_are_invalid_argument(req):
    async def go(channel, stub, engine):
        codes = []
        for call in (stub.Generate(req, timeout=30), stub.GenerateStream(req, timeout=30)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                if isinstance(call, grpc.aio.UnaryStreamCall):
                    [m async for m in call]
                else:
                    await call
            codes.append(info.value.code())
        ok = await stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2), timeout=30)
        return codes, engine.requests, ok

    codes, requests, ok = asyncio.run(with_grpc(go))
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert len(requests) == 1 and ok.usage.completion_tokens == 2
