"""Helpers shared by the pipeline tests: the HF reference and request collection."""
from __future__ import annotations

import asyncio
import torch

from speculation.requests import GenerationRequest, SpeculationOptions
from models.sampling import SamplingParams


def hf_greedy(hf, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """Hugging Face `generate` of the target alone, greedy: the reference output."""
    eos = [] if ignore_eos else hf.config.eos_token_id    # [] = never stop early
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                      do_sample=False, eos_token_id=eos, pad_token_id=hf.config.vocab_size - 1)
    return out[0, len(prompt):].tolist()


def request(rid: str, prompt: list[int], max_tokens: int, mode: str = "chain", spec_len: int = 4,
            tree_width: int | None = None, **sampling) -> GenerationRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    width = None if mode == "chain" else tree_width
    return GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling),
                             SpeculationOptions(mode=mode, spec_len=spec_len, tree_width=width))


async def collect(engine, req: GenerationRequest, on_chunk=None):
    """All tokens of one request and its last chunk."""
    tokens, last = [], None
    async for chunk in engine.generate(req):
        tokens += chunk.token_ids
        last = chunk
        if on_chunk is not None:
            await on_chunk(chunk, tokens)
    return tokens, last


def run(coro, timeout: float = 120.0):
    """Run a coroutine with a hard timeout: a hung pipeline fails the test instead of CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def prompts(n: int, vocab: int = 256, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (1 to ~40 tokens) over byte tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (7 * i + 3) % 40 for i in range(n)]
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lengths]


def assert_greedy_exact_beside_sampled(engine, hf_target, ps: list[list[int]], max_tokens: int = 28,
                                       sampled_tokens: int = 12, seed: int = 3) -> None:
    """Greedy chain requests for `ps`, with a sampled one beside them, through `engine`: every
    greedy output is the target's own (Hugging Face `generate`) and the sampled one finishes."""
    async def all_of():
        greedy = [collect(engine, request(f"g{i}", p, max_tokens, "chain", 4)) for i, p in enumerate(ps)]
        sampled = collect(engine, request("sampled", ps[0], sampled_tokens, "chain", 4, temperature=0.9,
                                          seed=seed))
        return await asyncio.gather(*greedy, sampled)

    *outs, (sampled, last) = run(all_of(), timeout=180)
    for (tokens, _), p in zip(outs, ps):
        assert tokens == hf_greedy(hf_target, p, max_tokens)
    assert len(sampled) == sampled_tokens and last.finish_reason == "length"
