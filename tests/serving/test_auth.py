"""Access control (issue 7): API keys on HTTP and gRPC, never logged; /health and /metrics
configurable; per-key concurrency limits. The serving config's key settings and the KubeRay
manifests mounting the key from a Secret are in tests/cluster/test_auth_deploy.py.

In-process: FastAPI's TestClient and a plain grpc.aio server over the FakeEngine (no Ray)."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from fastapi.testclient import TestClient

from serving.access import ApiKeyConfigError, ApiKeys, load_api_keys
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.protos import specflash_pb2 as pb
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

from . import serving_helpers

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)
KEY, OTHER = "sk-right-8f1d2c", "sk-other-77a0b3"


def make(engine=None, **settings):
    engine = engine or FakeEngine(script=lambda r: OUT, eos_token_id=0)
    server = OpenAIServer(engine, TOK, ServerSettings(**{"max_context": 256, **settings}))
    return engine, server, TestClient(build_fastapi_app(server))


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


COMPLETION = {"prompt": "hi", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.mark.parametrize("headers", [{}, bearer("sk-wrong"), bearer(KEY[:-1]), bearer(KEY + "x"),
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     bearer("")])
def test_missing_or_wrong_key_is_401_on_every_v1_route(headers):
    engine, _, client = make(api_key=KEY)
    for r in (client.post("/v1/completions", json=COMPLETION, headers=headers),
              client.post("/v1/chat/completions", json=CHAT, headers=headers),
              client.get("/v1/models", headers=headers)):
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert KEY not in r.text
    assert engine.requests == []


def test_right_key_is_served_and_the_scheme_is_case_insensitive():
    engine, _, client = make(api_key=KEY)
    assert client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT,
                       headers={"Authorization": f"bearer  {KEY} "}).status_code == 200
    assert client.get("/v1/models", headers=bearer(KEY)).json()["data"][0]["id"] == "specflash"
    assert len(engine.requests) == 2


def test_several_keys_each_work_and_are_told_apart():
    keys = ApiKeys([KEY, OTHER])
    assert keys.identify(f"Bearer {KEY}") == "key-0" and keys.identify(f"Bearer {OTHER}") == "key-1"
    assert ApiKeys().identify(None) == "anonymous"
    assert KEY not in repr(keys) and OTHER not in repr(keys)


def test_health_and_metrics_are_open_by_default_and_guarded_when_configured():
    _, _, client = make(api_key=KEY)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    _, _, client = make(api_key=KEY, auth_health=True)
    assert client.get("/health").status_code == 401
    assert client.get("/health", headers=bearer(KEY)).status_code == 200
    assert client.get("/metrics").status_code == 200
    _, _, client = make(api_key=KEY, auth_metrics=True)
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=bearer(KEY)).status_code == 200
    assert client.get("/health").status_code == 200


def test_the_key_never_appears_in_logs_errors_metrics_or_reprs(caplog, capfd):
    caplog.set_level(logging.DEBUG)
    _, server, client = make(api_key=[KEY, OTHER], auth_metrics=True)
    texts = [client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).text,
             client.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER + "!")).text,
             client.post("/v1/completions", json={"prompt": 5}, headers=bearer(KEY)).text,
             client.get("/metrics", headers=bearer(KEY)).text,
             repr(server.settings), repr(server.keys), repr(server.__dict__)]
    out, err = capfd.readouterr()
    everything = "\n".join(texts + [caplog.text, out, err])
    assert "specflash_requests_total" in everything  # the metrics really were read
    for secret in (KEY, OTHER):
        assert secret not in everything


def test_key_sources_env_and_file(tmp_path):
    assert load_api_keys() == ()
    assert load_api_keys(env="K", environ={"K": f" {KEY}\n"}) == (KEY,)
    f = tmp_path / "api-key"
    f.write_text(f"{KEY}\n\n  {OTHER}  \n")
    assert load_api_keys(file=str(f)) == (KEY, OTHER)
    for kwargs in ({"env": "K", "environ": {}}, {"env": "K", "environ": {"K": " \n"}},
                   {"file": str(tmp_path / "missing")}):
        with pytest.raises(ApiKeyConfigError):
            load_api_keys(**kwargs)
    f.write_text("\n")
    with pytest.raises(ApiKeyConfigError) as info:
        load_api_keys(file=str(f))
    assert "empty" in str(info.value)


# ---- per-key concurrency ---------------------------------------------------------------------
def test_one_key_over_its_share_gets_429_while_another_key_is_served():
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05)
    _, server, client = make(engine, api_key=[KEY, OTHER], max_concurrent_per_key=2, max_queue=8)
    body = {"prompt": "a", "max_tokens": 100, "stream": True, "n": 2}
    with client.stream("POST", "/v1/completions", json=body, headers=bearer(KEY)) as r1:
        assert r1.status_code == 200 and server.outstanding == 2
        r2 = client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
        assert r2.status_code == 429 and r2.headers["retry-after"] == "1"
        assert r2.json()["error"]["code"] == "key_concurrency_limit"
        r3 = client.post("/v1/completions", json={**COMPLETION, "n": 2}, headers=bearer(OTHER))
        assert r3.status_code == 200, r3.text
    assert server.outstanding == 0 and dict(server.limiter.held) == {}
    assert client.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
    assert 'reason="key_concurrency_limit"' in client.get("/metrics").text


def test_without_keys_the_per_key_limit_does_not_apply():
    engine = FakeEngine(script=lambda r: OUT, delay_s=0.05)
    _, server, client = make(engine, max_concurrent_per_key=1, max_queue=8)
    with client.stream("POST", "/v1/completions",
                       json={"prompt": "a", "max_tokens": 100, "stream": True, "n": 2}) as r1:
        assert r1.status_code == 200
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


# ---- gRPC ------------------------------------------------------------------------------------
async def with_grpc(fn, engine=None, **settings):
    engine = engine or FakeEngine(script=lambda r: OUT)
    return await serving_helpers.with_grpc(lambda channel, stub, engine, server: fn(stub, engine, server),
                                           engine, TOK, **settings)


@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_grpc_missing_wrong_and_right_keys(method):
    req = pb.GenerateRequest(prompt="hi", max_tokens=2)

    async def call(stub, metadata):
        if method == "Generate":
            return [await stub.Generate(req, metadata=metadata)]
        return [m async for m in stub.GenerateStream(req, metadata=metadata)]

    async def go(stub, engine, server):
        errors = []
        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", KEY),)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(stub, metadata)
            errors.append(info.value)
        assert engine.requests == []
        ok = await call(stub, (("authorization", f"Bearer {KEY}"),))
        return errors, ok

    errors, ok = asyncio.run(with_grpc(go, api_key=KEY))
    for e in errors:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.details()
        assert KEY not in e.details()
    assert ok[-1].usage.completion_tokens == 2


def test_grpc_per_key_limit_is_resource_exhausted():
    async def go(stub, engine, server):
        auth = (("authorization", f"Bearer {KEY}"),)
        long = stub.GenerateStream(pb.GenerateRequest(prompt="a", max_tokens=200), metadata=auth)
        await long.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=2), metadata=auth)
        other = await stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=2),
                                    metadata=(("authorization", f"Bearer {OTHER}"),))
        long.cancel()
        return info.value, other

    err, other = asyncio.run(with_grpc(go, FakeEngine(script=lambda r: OUT, delay_s=0.02),
                                       api_key=[KEY, OTHER], max_concurrent_per_key=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per key" in err.details()
    assert other.usage.completion_tokens == 2
