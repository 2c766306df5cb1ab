"""Graceful shutdown (issue 7): once draining starts nothing new is admitted, in-flight requests
finish within the deadline or end with a clear error (a stream: an error event, then [DONE]),
never a silent cut.

In-process over the FakeEngine (HTTP through an ASGI client, gRPC on a plain grpc.aio server);
`specflash serve --engine fake` SIGTERM'd with a stream in flight is
tests/cluster/test_serve_shutdown.py."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.protos import specflash_pb2 as pb
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

from . import serving_helpers

TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)


def events(text: str) -> list:
    """The SSE payloads, checking the framing: every event `data: ...`, the last [DONE]."""
    parts = text.split("\n\n")
    assert parts[-1] == "" and all(p.startswith("data: ") for p in parts[:-1]), text[-300:]
    payloads = [p[len("data: "):] for p in parts[:-1]]
    assert payloads[-1] == "[DONE]", "the stream was cut without [DONE]"
    return [json.loads(p) for p in payloads[:-1]]


async def drain_during(fn, *, delay_s: float, drain_timeout_s: float, max_tokens: int,
                       after=None):
    """Start `fn(client)` (a request), drain once it is in flight, run `after(client)` while
    draining; returns (fn's result, drain report, after's result, server, engine)."""
    engine = FakeEngine(script=lambda r: OUT, delay_s=delay_s, chunk_size=1)
    server = OpenAIServer(engine, TOK, ServerSettings(max_context=256, drain_timeout_s=drain_timeout_s))
    transport = httpx.ASGITransport(app=build_fastapi_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
        task = asyncio.create_task(fn(client, max_tokens))
        while server.outstanding == 0:
            await asyncio.sleep(0.005)
        draining = asyncio.create_task(server.drain())
        await asyncio.sleep(0.02)
        later = await after(client) if after else None
        result, report = await task, await draining
    return result, report, later, server, engine


async def stream(client, max_tokens):
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        return r.status_code, (await r.aread()).decode()


async def refused(client):
    new = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    health = await client.get("/health")
    return new, health


def test_a_stream_that_finishes_within_the_deadline_gets_every_token():
    (status, text), report, (new, health), server, engine = asyncio.run(drain_during(
        stream, delay_s=0.005, drain_timeout_s=20, max_tokens=40, after=refused))
    chunks = events(text)
    assert status == 200 and "error" not in chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(TOK.encode(c["choices"][0]["text"])) for c in chunks) >= 30
    assert new.status_code == 503 and new.headers["retry-after"] == "1"
    assert new.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert report == {"in_flight": 1, "failed": 0, "left": 0}
    assert engine.aborted == [] and server.outstanding == 0


def test_a_stream_past_the_deadline_ends_with_an_error_event_then_done():
    t0 = time.monotonic()
    (status, text), report, _, server, engine = asyncio.run(drain_during(
        stream, delay_s=0.05, drain_timeout_s=0.3, max_tokens=200))
    chunks = events(text)
    assert status == 200 and len(chunks) >= 2          # tokens came before the cut
    assert chunks[-1]["error"]["code"] == "server_shutting_down"
    assert "drain deadline" in chunks[-1]["error"]["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert report == {"in_flight": 1, "failed": 1, "left": 0}
    assert len(engine.aborted) == 1 and engine.active == {}   # its KV blocks were freed
    assert server.outstanding == 0 and time.monotonic() - t0 < 5


def test_a_whole_response_past_the_deadline_is_503_with_retry_after():
    async def whole(client, max_tokens):
        return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens})

    r, report, _, server, engine = asyncio.run(drain_during(
        whole, delay_s=0.05, drain_timeout_s=0.2, max_tokens=200))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "server_shutting_down"
    assert report["failed"] == 1 and len(engine.aborted) == 1 and server.outstanding == 0


def test_several_choices_are_all_failed_and_the_stream_still_ends_with_done():
    async def n3(client, max_tokens):
        body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True, "n": 3}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            return (await r.aread()).decode()

    text, report, _, server, engine = asyncio.run(drain_during(
        n3, delay_s=0.05, drain_timeout_s=0.2, max_tokens=200))
    assert events(text)[-1]["error"]["code"] == "server_shutting_down"
    assert report["failed"] == 3 and len(engine.aborted) == 3 and server.outstanding == 0


def test_a_grpc_stream_past_the_deadline_ends_unavailable():
    async def go(channel, stub, engine, server):
        call = stub.GenerateStream(pb.GenerateRequest(prompt="hi", max_tokens=200))
        first = await call.read()
        report = await server.drain()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() != grpc.aio.EOF:
                pass
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2))
        return first, report, info.value, refused.value

    first, report, err, refused = asyncio.run(serving_helpers.with_grpc(
        go, FakeEngine(script=lambda r: OUT, delay_s=0.05, chunk_size=1), TOK, drain_timeout_s=0.2))
    assert first.text and report["failed"] == 1
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "drain deadline" in err.details()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
