"""`stream_interval` (speculation.settings.EngineSettings, `serving.stream_interval`): a
request's chunks carry at least that many tokens, its first and last chunk go at once, and the
whole stream holds what the per-step stream holds, in the in-process engine and the pipeline."""
from __future__ import annotations

import asyncio

from cluster.local import InProcessEngine
from models import load_model
from models.sampling import TokenLogprob
from speculation.requests import GenerationChunk, merge_chunks
from speculation.settings import EngineSettings

from .pipeline_helpers import collect, hf_greedy, prompts, request, run


def test_merged_chunks_keep_tokens_logprobs_and_the_later_counts():
    lp = [TokenLogprob(1, -0.1, [(1, -0.1)]), TokenLogprob(2, -0.2, [(2, -0.2)]), TokenLogprob(3, -0.3, [])]
    a = GenerationChunk("r", [1], num_drafted=3, num_accepted=2, cached_tokens=4, logprobs=lp[:1],
                        prompt_logprobs=[None, []])
    b = GenerationChunk("r", [2, 3], True, "length", num_drafted=7, num_accepted=5, cached_tokens=4, logprobs=lp[1:])
    m = merge_chunks(a, b)
    assert (m.token_ids, m.finished, m.finish_reason, m.num_drafted, m.num_accepted) == ([1, 2, 3], True, "length", 7, 5)
    assert m.logprobs == lp and m.prompt_logprobs == [None, []] and m.cached_tokens == 4
    plain = merge_chunks(GenerationChunk("r", [1]), GenerationChunk("r", [2]))
    assert plain.logprobs is None and plain.prompt_logprobs is None and not plain.finished


def _chunks(engine, req) -> list[GenerationChunk]:
    async def go():
        return [c async for c in engine.generate_stream(req)]
    return asyncio.run(go())


def _check_sizes(chunks: list[GenerationChunk], interval: int) -> None:
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert all(len(c.token_ids) >= interval for c in chunks[1:-1])       # first and last: at once


def test_in_process_chunks_carry_the_interval_and_the_same_tokens(tiny_target, close_draft):
    target, draft = load_model(tiny_target), load_model(close_draft)
    outputs = {}
    for interval in (1, 5):
        engine = InProcessEngine(target, draft, settings=EngineSettings(spec_len=2, stream_interval=interval,
                                                                        num_blocks=64))
        try:
            chunks = _chunks(engine, request("s", [5, 6, 7, 8], 30, "chain", 2, logprobs=2))
        finally:
            engine.shutdown()
        _check_sizes(chunks, interval)
        outputs[interval] = ([t for c in chunks for t in c.token_ids], [lp for c in chunks for lp in c.logprobs],
                             len(chunks), chunks[-1].num_drafted)
    (tokens1, lps1, n1, drafted1), (tokens5, lps5, n5, drafted5) = outputs[1], outputs[5]
    assert len(tokens1) == 30 and tokens5 == tokens1 and lps5 == lps1 and drafted5 == drafted1
    assert n5 < n1 and n5 <= 2 + 30 // 5


def test_pipeline_chunks_carry_the_interval_and_stay_exact(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft, stream_interval=6)
    p = prompts(1, seed=41)[0]
    seen: list[GenerationChunk] = []

    async def keep(chunk, tokens):
        seen.append(chunk)

    tokens, last = run(collect(engine, request("si", p, 33, "chain", 3), keep), 180)
    assert last.finish_reason == "length" and tokens == hf_greedy(hf_target, p, 33)
    _check_sizes(seen, 6)
    assert len(seen) <= 2 + 33 // 6
