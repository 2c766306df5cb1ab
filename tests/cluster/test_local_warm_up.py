"""The in-process engine (cluster/local.py) with fixed caches warms up when it is built, on the
CPU too: its target and its draft have run their dummy forwards before the first request
(verifier.target.TargetSide.warm_up), leaving every block free and the prefix caches' hit
counts at zero; a cache too small for the dummy is built all the same."""
from __future__ import annotations

import torch

from cluster.local import InProcessEngine
from models import SamplingParams, load_model
from speculation.requests import GenerationRequest, SpeculationOptions
from speculation.settings import EngineSettings


def _count_forwards(model) -> list[int]:
    """The model's forwards through its layers from now on (a few-row forward runs them in one C
    call, not through the layer modules: counted where every forward runs them)."""
    calls = [0]
    real = model._packed_layers

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)
    model._packed_layers = counted
    return calls


def test_a_fresh_engine_with_fixed_caches_has_warmed_up(tiny_target, close_draft):
    threads = torch.get_num_threads()
    try:
        target, draft = load_model(tiny_target), load_model(close_draft)
        target_calls, draft_calls = _count_forwards(target), _count_forwards(draft)
        settings = EngineSettings(num_blocks=64, block_size=8, prefix_caching=True, num_cpus=1)
        engine = InProcessEngine(target, draft, settings=settings, num_blocks=64)
        assert target_calls[0] >= 2 + 2 * settings.spec_len      # the prefill, plain steps, chains
        assert draft_calls[0] > 0
        for cache in (engine.side.cache, engine.proposer.cache):
            assert cache.num_free_blocks == cache.num_blocks and not cache._lens
            assert cache.prefix_stats()["queries"] == cache.prefix_stats()["hits"] == 0
    finally:
        torch.set_num_threads(threads)


def test_an_engine_whose_caches_cannot_hold_the_dummy_still_builds_and_serves(tiny_target, close_draft):
    """4 blocks of 8 tokens, fewer than the 32-token dummy and its trees take: the warm-ups
    shorten their dummy prompts; the engine then serves a request that fits."""
    threads = torch.get_num_threads()
    try:
        engine = InProcessEngine(load_model(tiny_target), load_model(close_draft), num_blocks=4, block_size=8)
        for cache in (engine.side.cache, engine.proposer.cache):
            assert cache.num_free_blocks == cache.num_blocks
        request = GenerationRequest("r", [5, 9, 2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                    SpeculationOptions(mode="chain", spec_len=2))
        (out,) = engine.generate([request])
        assert len(out.token_ids) == 4
    finally:
        torch.set_num_threads(threads)
