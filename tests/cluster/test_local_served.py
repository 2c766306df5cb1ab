"""The in-process engine behind the HTTP layer (`cluster.local.LocalEngine`: continuous batching on
the server's event loop, forwards on a model thread), no Ray."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from fastapi.testclient import TestClient

from cluster.local import build_local_engine
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from speculation.requests import GenerationRequest, SpeculationOptions
from models.sampling import SamplingParams
from speculation.settings import EngineSettings


@pytest.fixture(scope="module")
def local(tiny_target, close_draft):
    engine, tok = build_local_engine(str(tiny_target), str(close_draft), EngineSettings(max_batch_size=8, num_blocks=256))
    server = OpenAIServer(engine, tok, ServerSettings(max_context=engine.engine.max_context))
    yield engine, tok, TestClient(build_fastapi_app(server))
    engine.shutdown()


def hf_greedy(hf_model, ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("mode", ["off", "chain", "tree"])
def test_greedy_equals_transformers_and_stream_equals_whole(local, hf_target, mode):
    engine, tok, client = local
    prompt = "Grüße, 世界! def f(x):"
    expected = hf_greedy(hf_target, tok.encode(prompt), 30)
    body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "return_token_ids": True,
            "speculation": {"mode": mode, "spec_len": 3, "tree_width": 2 if mode == "tree" else None}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == expected
    usage = r.json()["usage"]
    assert (usage["drafted_tokens"] == 0) == (mode == "off")
    streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    import json
    events = [json.loads(line[6:]) for line in streamed.split("\n\n")
              if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_concurrent_requests_are_batched_and_stay_exact(local, hf_target):
    engine, tok, _ = local
    prompts = [f"prompt number {i}" for i in range(6)]

    async def run():
        async def one(i, p):
            req = GenerationRequest(f"w{i}", tok.encode(p), SamplingParams(temperature=0, max_tokens=12),
                                    SpeculationOptions(mode="chain", spec_len=2))
            ids = []
            async for chunk in engine.generate(req):
                ids += chunk.token_ids
            return ids
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    outs = asyncio.run(run())
    assert outs == [hf_greedy(hf_target, tok.encode(p), 12) for p in prompts]


def test_abort_frees_kv_blocks(local):
    engine, tok, _ = local

    async def run():
        req = GenerationRequest("long", tok.encode("tell me"), SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True), SpeculationOptions(mode="off"))
        gen = engine.generate(req)
        first = await gen.__anext__()
        during = (await engine.stats())["kv_blocks_free"]
        await engine.abort("long")
        rest = [c async for c in gen]
        return first, during, rest

    first, during, rest = asyncio.run(run())
    stats = asyncio.run(engine.stats())
    assert first.token_ids and rest[-1].finish_reason == "abort"
    assert during < stats["kv_blocks_total"]
    deadline = time.monotonic() + 10
    while asyncio.run(engine.stats())["kv_blocks_free"] != stats["kv_blocks_total"]:
        assert time.monotonic() < deadline, "KV blocks not freed after abort"
        time.sleep(0.05)


def test_bad_request_is_an_error_chunk_not_a_dead_engine(local):
    engine, tok, client = local

    async def run():
        bad = GenerationRequest("bad", [10**6], SamplingParams(temperature=0, max_tokens=2))
        return [c async for c in engine.generate(bad)]

    (chunk,) = asyncio.run(run())
    assert chunk.finished and chunk.finish_reason == "error" and "vocabulary" in chunk.error
    assert asyncio.run(engine.health())["ok"]
    r = client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 3, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_an_eagle_draft_serves_exact_greedy_output(tiny_target, eagle_draft, hf_target):
    """The local engine behind HTTP with a feature-conditioned draft head: the features
    flow from each prefill and step to the head; output is the target's own."""
    engine, tok = build_local_engine(str(tiny_target), str(eagle_draft), EngineSettings(max_batch_size=4, num_blocks=256))
    try:
        client = TestClient(build_fastapi_app(OpenAIServer(engine, tok, ServerSettings(
            max_context=engine.engine.max_context))))
        for prompt, mode in (("def f(x):", "chain"), ("Hello there", "tree"), ("abc", "auto")):
            expected = hf_greedy(hf_target, tok.encode(prompt), 16)
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True,
                    "speculation": {"mode": mode, "spec_len": 3, "tree_width": 2 if mode == "tree" else None}}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected
            if mode != "auto":
                assert r.json()["usage"]["drafted_tokens"] > 0
    finally:
        engine.shutdown()
