"""Prefix caching in the in-process engine (target and draft caches): multi-turn conversations
and a shared system prompt give, token for token, what transformers' greedy `generate` gives
with the cache on, with speculation off, chained and in trees; later turns start on cached
blocks; the hit rate under speculation equals the hit rate without it, for both caches."""
from __future__ import annotations

import os

import pytest
import torch

from cluster.local import build_engine, speculation_for
from models import SamplingParams
from speculation.requests import GenerationRequest
from speculation.settings import EngineSettings
from tests.cluster.test_local_greedy import hf_greedy

SYSTEM = list(b"You are a helpful assistant. Answer briefly.\n")
TURNS = [list(b"User: hi\n"), list(b"User: and the next one?\n"), list(b"User: thanks\n")]
MAX_TOKENS = 12
MODES = [("off", 1, 1), ("sync", 3, 1), ("sync", 2, 2)]


def engine(tiny_target, close_draft, caching: bool):
    settings = EngineSettings(num_blocks=256, block_size=8, prefix_caching=caching, num_cpus=1)
    return build_engine(tiny_target, close_draft, settings=settings).engine


def request(rid, prompt, mode, K, W, prefix_cache=True):
    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             speculation_for(mode, K, W), prefix_cache)


def converse(eng, mode, K, W, name="c"):
    """Three turns, each prompt the whole history so far; returns (prompts, outputs)."""
    history, prompts, outs = list(SYSTEM), [], []
    for t, turn in enumerate(TURNS):
        prompt = history + turn
        out, = eng.generate([request(f"{name}{t}", prompt, mode, K, W)])
        prompts.append(prompt)
        outs.append(out)
        history = prompt + out.token_ids
    return prompts, outs


@pytest.fixture(scope="module")
def reference(tiny_target, close_draft, hf_target):
    prompts, outs = converse(engine(tiny_target, close_draft, False), "off", 1, 1)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, MAX_TOKENS) for p in prompts]
    assert all(o.stats.prefix_hits == 0 for o in outs)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode,K,W", MODES)
def test_multi_turn_greedy_output_is_the_same_with_the_cache(tiny_target, close_draft, reference, mode, K, W):
    eng = engine(tiny_target, close_draft, True)
    prompts, outs = converse(eng, mode, K, W)
    assert [o.token_ids for o in outs] == reference
    hits = [o.stats.prefix_hits for o in outs]
    bs = eng.settings.block_size
    assert hits[0] == 0
    # a later turn finds every full block of the previous prompt and its answer but the last token
    for t in (1, 2):
        known = len(prompts[t - 1]) + MAX_TOKENS - 1
        assert hits[t] == min(known, len(prompts[t]) - 1) // bs * bs
    if mode != "off":
        assert sum(o.stats.num_accepted for o in outs) > 0


def test_hit_rate_under_speculation_equals_without_it_for_target_and_draft(tiny_target, close_draft):
    rates = {}
    for mode, K, W in MODES:
        eng = engine(tiny_target, close_draft, True)
        _, outs = converse(eng, mode, K, W)
        target = sum(o.stats.prefix_hits for o in outs) / sum(o.stats.prefix_queried for o in outs)
        draft = eng.proposer.cache.prefix_stats()
        rates[(mode, K, W)] = (target, None if mode == "off" else draft["hits"] / draft["queries"])
    off = rates[MODES[0]][0]
    assert off > 0.5
    for key in MODES[1:]:
        target, draft = rates[key]
        assert target == off, rates
        assert draft >= 0.98 * off, rates


def test_shared_system_prompt_and_per_request_opt_out(tiny_target, close_draft, hf_target):
    eng = engine(tiny_target, close_draft, True)
    prompts = [SYSTEM + list(b"User: a\n"), SYSTEM + list(b"User: bb\n"), SYSTEM + list(b"User: ccc\n")]
    outs = eng.generate([request("a", prompts[0], "sync", 3, 1), request("b", prompts[1], "sync", 3, 1),
                         request("c", prompts[2], "sync", 3, 1, prefix_cache=False)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, MAX_TOKENS) for p in prompts]
    bs = eng.settings.block_size
    common = len(os.path.commonprefix([prompts[0], prompts[1]]))      # the system prompt and "User: "
    assert common > len(SYSTEM) and [o.stats.prefix_hits for o in outs] == [0, common // bs * bs, 0]
    assert outs[2].stats.prefix_queried == 0


def test_off_by_default_and_every_block_back_after_the_requests(tiny_target, close_draft):
    assert EngineSettings().prefix_caching is False
    eng = engine(tiny_target, close_draft, True)
    converse(eng, "sync", 3, 1)
    for cache in (eng.side.cache, eng.proposer.cache):
        states = cache.block_states()
        assert states["referenced"] == 0 and states["cached_unreferenced"] > 0
        assert cache.num_free_blocks == cache.num_blocks


def test_served_usage_reports_cached_tokens_and_metrics_the_hit_rate(tiny_target, close_draft, hf_target):
    from fastapi.testclient import TestClient

    from cluster.local import build_local_engine
    from serving.openai_api import OpenAIServer, ServerSettings
    from serving.openai_routes import build_fastapi_app

    settings = EngineSettings(num_blocks=256, block_size=8, prefix_caching=True)
    engine, tok = build_local_engine(str(tiny_target), str(close_draft), settings)
    try:
        client = TestClient(build_fastapi_app(OpenAIServer(engine, tok, ServerSettings(max_context=2048))))
        prompt = "You are a helpful assistant. Answer briefly, and in English.\nUser: hi"
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                "speculation": {"mode": "chain", "spec_len": 3}}
        first, second, opted_out = (client.post("/v1/completions", json=b).json()
                                    for b in (body, body, {**body, "prefix_cache": False}))
        ids = tok.encode(prompt)
        expected = hf_greedy(hf_target, ids, 6)
        assert [r["choices"][0]["token_ids"] for r in (first, second, opted_out)] == [expected] * 3
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second, opted_out)]
        assert cached == [0, (len(ids) - 1) // 8 * 8, 0]
        metrics = client.get("/metrics").text
        rate = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("specflash_prefix_cache_target_hit_rate "))
        assert rate == pytest.approx(cached[1] / (2 * (len(ids) - 1)))
        assert "specflash_prefix_cache_draft_hit_rate " in metrics
        assert "specflash_prefix_cache_target_blocks " in metrics
        r = client.post("/v1/completions", json={**body, "prefix_cache": "sometimes"})
        assert r.status_code == 400 and "prefix_cache" in r.text
    finally:
        engine.shutdown()


def test_the_config_switch_reaches_the_engine_settings():
    from cluster.config import AppArgs
    from cluster.pipeline import settings_from_config

    assert settings_from_config(AppArgs()).prefix_caching is False
    assert settings_from_config(AppArgs.model_validate({"kv_cache": {"prefix_caching": True}})).prefix_caching
    with pytest.raises(ValueError, match="prefix_cachin"):
        AppArgs.model_validate({"kv_cache": {"prefix_cachin": True}})


def test_an_eagle_head_reads_the_features_of_cached_positions(tiny_target, eagle_draft, hf_target):
    """The target keeps its hidden states of cached blocks: a later turn starting on them hands
    the EAGLE head the same features a full prefill would (greedy output the target's own)."""
    eng = engine(tiny_target, eagle_draft, True)
    prompts, outs = converse(eng, "sync", 3, 1)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, MAX_TOKENS) for p in prompts]
    assert outs[2].stats.prefix_hits > 0 and sum(o.stats.num_drafted for o in outs) > 0
    full = engine(tiny_target, eagle_draft, False).side          # the features of a full prefill
    for p in prompts[1:]:
        rid = f"f{len(p)}"
        cached = eng.side.prefill(rid, p)
        assert eng.side.cached_tokens(rid) > 0
        reference = full.prefill(rid, p)
        assert cached.shape == reference.shape == (len(p) - 1, reference.shape[1])
        assert torch.allclose(cached, reference, atol=1e-4), (cached - reference).abs().max()
        eng.side.release(rid)
        full.release(rid)


def test_a_served_soak_with_aborts_and_evictions_leaves_every_block_free_or_cached(tiny_target, close_draft):
    """Concurrent turns over shared histories in a small cache (so blocks get evicted), some
    aborted after their first tokens: the finished ones give what the engine gives with the
    cache off, and afterwards no block of either cache is referenced."""
    import asyncio
    import random
    import time

    from cluster.local import build_local_engine

    rng = random.Random(3)
    prompts = [SYSTEM[: rng.randrange(20, len(SYSTEM))] + list(bytes(rng.randrange(97, 123) for _ in range(16)))
               for _ in range(12)]
    aborted = {2, 5, 9}

    async def serve(engine):
        async def one(i, prompt):
            tokens = []
            async for chunk in engine.generate(request(f"s{i}", prompt, "sync", 3, 1)):
                tokens += chunk.token_ids
                if i in aborted and tokens:
                    await engine.abort(f"s{i}")
                    return None
            return tokens
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    outs = {}
    for caching in (False, True):
        settings = EngineSettings(num_blocks=30, block_size=8, prefix_caching=caching, max_batch_size=3)
        engine, _ = build_local_engine(str(tiny_target), str(close_draft), settings)
        try:
            outs[caching] = asyncio.run(serve(engine))
            caches = (engine.engine.side.cache, engine.engine.proposer.cache)
            deadline = time.monotonic() + 20                  # the last frees run on the engine's loop
            while any(c.block_states()["referenced"] for c in caches) and time.monotonic() < deadline:
                time.sleep(0.05)
            for cache in caches:
                assert cache.block_states()["referenced"] == 0, (cache is caches[1], cache.block_states())
                assert cache.num_free_blocks == cache.num_blocks
            if caching:
                assert caches[0].evictions > 0 and caches[0].prefix_hits > 0
        finally:
            engine.shutdown()
    assert [o for i, o in enumerate(outs[True]) if i not in aborted] == \
        [o for i, o in enumerate(outs[False]) if i not in aborted]


def test_grpc_usage_reports_cached_tokens_as_http_does(tiny_target, close_draft, hf_target):
    """Generate's and GenerateStream's usage carry `prompt_tokens_details.cached_tokens`, the
    figure the HTTP API reports: 0 on a cold cache, the prompt's whole cached blocks after."""
    import asyncio

    from cluster.local import build_local_engine
    from serving.protos import specflash_pb2 as pb
    from tests.serving.serving_helpers import with_grpc

    settings = EngineSettings(num_blocks=256, block_size=8, prefix_caching=True)
    engine, tok = build_local_engine(str(tiny_target), str(close_draft), settings)
    prompt = "You are a helpful assistant. Answer briefly, and in English.\nUser: hi"

    async def go(channel, stub, engine, server):
        req = pb.GenerateRequest(prompt=prompt, max_tokens=6, temperature=0.0,
                                 speculation=pb.Speculation(mode="chain", spec_len=3))
        first = await stub.Generate(req)
        second = await stub.Generate(req)
        pieces = [m async for m in stub.GenerateStream(req)]
        return first, second, pieces

    try:
        first, second, pieces = asyncio.run(with_grpc(go, engine, tok, max_context=2048))
    finally:
        engine.shutdown()
    ids = tok.encode(prompt)
    assert list(second.token_ids) == list(first.token_ids) == hf_greedy(hf_target, ids, 6)
    cached = (len(ids) - 1) // 8 * 8
    assert cached > 0
    assert [r.usage.prompt_tokens_details.cached_tokens for r in (first, second, pieces[-1])] == [0, cached, cached]
    assert second.usage.prompt_tokens == len(ids) and second.usage.completion_tokens == 6
