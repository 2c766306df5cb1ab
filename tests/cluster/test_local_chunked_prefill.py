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


def instrument(eng, events: list) -> None:
    """Record ("prefill", seq id, limit, tokens fed) for a chunk in a forward of its own and
    ("step", the request ids verified, [(seq id, tokens fed) of the chunks riding in it])."""
    prefill, verify = eng.side.prefill, eng.side.verify_items

    def chunk(sid, prompt, use_cache=True, limit=0):
        at = eng.side.cache.seq_len(sid) if eng.side.cache.has_sequence(sid) else 0
        out = prefill(sid, prompt, use_cache, limit)
        events.append(("prefill", sid, limit, eng.side.cache.seq_len(sid) - at))
        return out

    def step(items, threads=None, chunks=None):
        out = verify(items, threads, chunks)
        events.append(("step", {it.seq.request_id for it in items}, [(c.seq_id, len(c.ids or ())) for c in chunks or ()]))
        return out

    eng.side.prefill, eng.side.verify_items = chunk, step


def fed_chunks(events: list, sid: str) -> list[tuple[str, int]]:
    """("alone" | "riding", tokens) of every chunk of `sid`'s prompt, in order."""
    out = []
    for e in events:
        if e[0] == "prefill" and e[1] == sid:
            out.append(("alone", e[3]))
        elif e[0] == "step":
            out += [("riding", n) for s, n in e[2] if s == sid]
    return out


@pytest.mark.parametrize("mode,K,W", [("off", 1, 1), ("sync", 3, 1), ("sync", 2, 2)])
def test_chunked_prefill_gives_the_one_shot_output_and_rides_in_the_decoding_steps(
        tiny_target, close_draft, hf_target, mode, K, W):
    eng = engine(tiny_target, close_draft, chunk=16)
    events = []
    instrument(eng, events)
    prompts = SHORT + [LONG]
    outs = eng.generate([request(f"r{i}", p, mode, K, W) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, 12) for p in prompts]
    chunks = fed_chunks(events, "r2")
    assert sum(n for _, n in chunks) == len(LONG) - 1
    # all three joined at once: nothing decoded yet, the first step's 16 tokens went to the three
    # prompts, in forwards of their own; then chunks of 16, the last one what was left
    assert chunks[0][0] == "alone" and all(n == 16 for _, n in chunks[1:-1]) and chunks[-1][1] <= 16
    # while the short streams decode, every chunk rides in a verification of theirs (once they
    # are done, the rest goes alone)
    decoding = [i for i, e in enumerate(events) if e[0] == "step" and e[1] & {"r0", "r1"}]
    meanwhile = events[decoding[0]:decoding[-1] + 1]
    assert not [e for e in meanwhile if e[0] == "prefill"]
    assert len([e for e in meanwhile if e[2]]) >= 2
    assert all(e[1] & {"r0", "r1"} for e in events if e[0] == "step" and e[2])
    one_shot = engine(tiny_target, close_draft, chunk=0).generate(
        [request(f"r{i}", p, mode, K, W) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in one_shot] == [o.token_ids for o in outs]


def test_with_a_token_budget_one_chunk_of_a_measured_size_rides_in_each_step(tiny_target, close_draft, hf_target):
    """While streams decode, each step's forward feeds at most one chunk, of a multiple of
    MIN_CHUNK tokens within prefill_chunk (verifier/chunking.py); the output is unchanged."""
    from verifier.chunking import MIN_CHUNK

    eng = engine(tiny_target, close_draft, chunk=32, share=0.5)
    events = []
    instrument(eng, events)
    prompts = SHORT + [LONG]
    outs = eng.generate([request(f"r{i}", p, "off", 1, 1) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == [hf_greedy(hf_target, p, 12) for p in prompts]
    chunks = fed_chunks(events, "r2")
    first_step = next(i for i, e in enumerate(events) if e[0] == "step")
    assert sum(e[3] for e in events[:first_step]) == 32           # nothing decodes yet: one whole chunk's tokens
    assert all(len(e[2]) <= 1 for e in events if e[0] == "step")  # one chunk a step
    sizes = [n for _, n in chunks[1:-1]]                          # the last one: what was left
    assert sizes and all(0 < n <= 32 and n % MIN_CHUNK == 0 for n in sizes), sizes
    assert sum(n for _, n in chunks) == len(LONG) - 1


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
