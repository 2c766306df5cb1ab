"""Chunked prefill in the in-process engine: a long prompt prefilled `prefill_chunk` tokens at a
time (or fewer, by the step's token budget), between the steps of the streams already decoding,
gives what one-shot prefill and transformers' greedy `generate` give (speculation off, chained,
in trees; with the prefix cache)."""
from __future__ import annotations

import pytest

from cluster.local import build_engine
from speculation.settings import EngineSettings
from tests.cluster.test_local_greedy import hf_greedy
from tests.cluster.test_local_prefix_cache import request

LONG = list(b"def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] "
            b"else b.pop(0))\n    return out + a + b\n# now the tests\n")
SHORT = [list(b"x = 1"), list(b"print(")]


def engine(tiny_target, close_draft, chunk: int, caching: bool = False, share: float = 0.0):
    """`share`: `prefill_step_share` (0: every chunk `chunk` tokens)."""
    settings = EngineSettings(num_blocks=256, block_size=8, prefill_chunk=chunk, prefix_caching=caching, num_cpus=1,
                              prefill_step_share=share)
    return build_engine(tiny_target, close_draft, settings=settings).engine


@pytest.mark.parametrize("mode,K,W", [("off", 1, 1), ("sync", 3, 1), ("sync", 2, 2)])
def test_chunked_prefill_gives_the_one_shot_output_and_interleaves_with_decoding(
        tiny_target, close_draft, hf_target, mode, K, W):
    eng = engine(tiny_target, close_draft, chunk=16)
    events = []
    prefill, verify = eng.side.prefill, eng.side.verify_items
    eng.side.prefill = lambda sid, prompt, *rest: (events.append(("prefill", sid)), prefill(sid, prompt, *rest))[1]
    eng.side.verify_items = lambda items, *rest: (events.append(("step", len(items))), verify(items, *rest))[1]
    prompts = SHORT + [LONG]
    outs = eng.generate([request(f"r{i}", p, mode, K, W) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, 12) for p in prompts]
    chunks = [i for i, e in enumerate(events) if e == ("prefill", "r2")]
    assert len(chunks) == -(-(len(LONG) - 1) // 16)
    between = [e for e in events[chunks[0]:chunks[-1]] if e[0] == "step"]
    # the short streams step between the long prompt's chunks (in a speculative mode a pass may
    # also be the in-process drafter's turn, with no verification)
    assert len(between) >= (len(chunks) - 1 if mode == "off" else 2), events
    one_shot = engine(tiny_target, close_draft, chunk=0).generate(
        [request(f"r{i}", p, mode, K, W) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in one_shot] == [o.token_ids for o in outs]


def test_with_a_token_budget_one_chunk_of_a_measured_size_runs_between_two_steps(tiny_target, close_draft, hf_target):
    """While streams decode, each step's prefill feeds at most one chunk, of a multiple of
    MIN_CHUNK tokens within prefill_chunk (verifier/chunking.py); the output is unchanged."""
    from verifier.chunking import MIN_CHUNK

    eng = engine(tiny_target, close_draft, chunk=32, share=0.5)
    events = []
    prefill, verify = eng.side.prefill, eng.side.verify_items

    def chunk(sid, prompt, use_cache, limit):
        at = eng.side.cache.seq_len(sid) if eng.side.cache.has_sequence(sid) else 0
        out = prefill(sid, prompt, use_cache, limit)
        events.append(("prefill", sid, limit, eng.side.cache.seq_len(sid) - at))
        return out

    eng.side.prefill = chunk
    eng.side.verify_items = lambda items, *rest: (
        events.append(("step", {it.seq.request_id for it in items})), verify(items, *rest))[1]
    prompts = SHORT + [LONG]
    outs = eng.generate([request(f"r{i}", p, "off", 1, 1) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, 12) for p in prompts]
    steps = [i for i, e in enumerate(events) if e[0] == "step" and e[1] & {"r0", "r1"}]
    assert sum(e[3] for e in events[:steps[0]]) == 32             # nothing decodes yet: one whole chunk's tokens
    later = events[steps[0]:steps[-1]]                            # while the short streams decode
    runs = "".join("p" if e[0] == "prefill" else "s" for e in later)
    assert "pp" not in runs and "p" in runs, later                # one chunk between two steps
    sizes = [e[2] for e in later if e[0] == "prefill"][:-1]       # the last one: what was left
    assert all(0 < n <= 32 and n % MIN_CHUNK == 0 for n in sizes), sizes
    fed = [e[3] for e in events if e[0] == "prefill" and e[1] == "r2"]
    assert sum(fed) == len(LONG) - 1


def test_chunked_prefill_with_the_prefix_cache_starts_on_the_cached_blocks(tiny_target, close_draft, hf_target):
    eng = engine(tiny_target, close_draft, chunk=16, caching=True)
    first, = eng.generate([request("a", LONG, "sync", 3, 1)])
    second, = eng.generate([request("b", LONG + list(b"assert merge"), "sync", 3, 1)])
    assert second.token_ids == hf_greedy(hf_target, LONG + list(b"assert merge"), 12)
    assert second.stats.prefix_hits == len(LONG) // 8 * 8        # the whole blocks of the shared prompt
    assert eng.side.cache.block_states()["referenced"] == 0


@pytest.mark.parametrize("caching", [False, True])
def test_a_chunked_prefill_returns_the_features_of_a_one_shot_one(tiny_target, caching):
    """What an EAGLE head reads: the target's hidden states of every prompt token but the last,
    whether the prompt was prefilled at once or in chunks (and started on cached blocks)."""
    import torch

    from models import load_model
    from verifier.target import PREFILLING, TargetSide

    model = load_model(tiny_target)
    side = TargetSide("", 64, 8, features=True, model=model, prefix_caching=caching)
    whole = side.prefill("whole", LONG)
    calls, out = 0, PREFILLING
    while out is PREFILLING:
        out, calls = side.prefill("chunked", LONG, True, 16), calls + 1
    assert calls == max(1, -(-(len(LONG) - 1 - side.cached_tokens("chunked")) // 16))
    assert side.cached_tokens("chunked") == ((len(LONG) - 1) // 8 * 8 if caching else 0)
    assert out.shape == whole.shape == (len(LONG) - 1, model.config.hidden_size)
    assert torch.allclose(out, whole, atol=1e-4)
