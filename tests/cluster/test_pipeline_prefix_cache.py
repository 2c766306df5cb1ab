"""Prefix caching in the Ray pipeline (verifier and drafter actors, each with its own cache):
a multi-turn conversation gives, token for token, what Hugging Face `generate` of the target
gives, later turns report cached prompt tokens, and the drafter's cache hits as the target's."""
from __future__ import annotations

import pytest
import ray

from .pipeline_helpers import collect, hf_greedy, request, run

SYSTEM = list(b"You are a helpful assistant. Answer briefly.\n")
TURNS = [list(b"User: hi\n"), list(b"User: and then?\n"), list(b"User: thanks\n")]


@pytest.fixture(scope="module")
def cached_engine(ray_cluster, tiny_target, close_draft):
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import pipeline_args

    engine = build_pipeline_engine(pipeline_args(), target_dir=str(tiny_target), draft_dir=str(close_draft),
                                   num_blocks=512, block_size=8, prefix_caching=True)
    yield engine
    engine.kill_pipeline_actors()


@pytest.mark.parametrize("mode,spec_len,width", [("chain", 3, 1), ("tree", 2, 2), ("off", 1, 1)])
def test_multi_turn_greedy_equals_hf_with_the_cache(cached_engine, hf_target, mode, spec_len, width):
    history, cached = list(SYSTEM), []
    for t, turn in enumerate(TURNS):
        prompt = history + turn
        tokens, last = run(collect(cached_engine, request(f"{mode}-{t}", prompt, 12, mode, spec_len, width)))
        assert tokens == hf_greedy(hf_target, prompt, 12)
        cached.append(last.cached_tokens)
        history = prompt + tokens
    assert cached[1] > 0 and cached[2] > cached[1]
    stats = run(cached_engine.stats())
    assert stats["prefix_hit_rate"] > 0
    if mode != "off":
        assert stats["draft_prefix_hit_rate"] >= 0.98 * stats["prefix_hit_rate"], stats
    info = ray.get(cached_engine.pipelines[0].drafters[0].info.remote())
    assert info["prefix_cache"]["hits"] > 0 or mode == "off"


def test_a_long_prompt_chunked_beside_a_decoding_stream_in_the_pipeline(ray_cluster, tiny_target, close_draft,
                                                                         hf_target):
    """Chunked prefill in the verifier actor: the long prompt's chunks ride in the decoding
    stream's verification forwards (the budget saw one: `prefill_chunk_tokens`), and both
    outputs are Hugging Face's, token for token."""
    import asyncio

    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import pipeline_args

    engine = build_pipeline_engine(pipeline_args(), target_dir=str(tiny_target), draft_dir=str(close_draft),
                                   num_blocks=512, block_size=8, prefix_caching=True, prefill_chunk=16)
    try:
        long = SYSTEM * 4 + TURNS[0]

        async def both():
            decoding = asyncio.Event()

            async def seen(chunk, tokens):
                if len(tokens) >= 2:
                    decoding.set()

            short = asyncio.ensure_future(collect(engine, request("short", TURNS[1], 48, "chain", 3), seen))
            await decoding.wait()                    # the short stream decodes, then the long prompt comes
            return await asyncio.gather(short, collect(engine, request("long", long, 12, "chain", 3)))

        (short, _), (tokens, _) = run(both())
        assert short == hf_greedy(hf_target, TURNS[1], 48)
        assert tokens == hf_greedy(hf_target, long, 12)
        assert ray.get(engine.pipelines[0].verifier.get_stats.remote())["prefill_chunk_tokens"] > 0
    finally:
        engine.kill_pipeline_actors()
