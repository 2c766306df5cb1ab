"""Test doubles for the serving layer: a scripted `Engine` and a tiny byte-level tokenizer.

`FakeEngine` implements the Engine protocol (docs/internals.md, "cluster")
without a model: it answers each request with a scripted list of token ids, in
chunks, optionally slowly, honours `max_tokens`, EOS and `ignore_eos`, counts
drafted / accepted tokens like a speculative engine, and records aborts and the
requests it saw, so tests can check what the ingress asked of it. It is
importable by path (`serving.testing:FakeEngine`) for Serve-level tests and for
trying the HTTP API without a model (`build_app({"engine": "fake"})`).
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from speculation.requests import GenerationChunk, GenerationRequest, error_chunk

SAMPLE_TEXT = ("Hello, wörld! Ünïcödé: 世界 🙂 naïve café — ∑ αβγ. "
               "def reverse(s): return s[::-1]\n")


class FakeEngine:
    """Scripted engine. `script(request) -> token ids` decides each answer."""

    def __init__(self, script: Callable[[GenerationRequest], list[int]] | None = None,
                 tokenizer=None, chunk_size: int = 3, delay_s: float = 0.0,
                 eos_token_id: int | None = None, speculation: bool = True,
                 num_kv_blocks: int = 64, fail_with: str | None = None) -> None:
        if script is None:
            if tokenizer is None:
                tokenizer = tiny_byte_tokenizer()
            sample = list(tokenizer.encode(SAMPLE_TEXT * 8))
            script = lambda request: sample  # noqa: E731
        self.script, self.chunk_size, self.delay_s = script, chunk_size, delay_s
        self.eos_token_id, self.speculation = eos_token_id, speculation
        self.fail_with = fail_with
        self.num_kv_blocks = num_kv_blocks
        self.active: dict[str, int] = {}          # request_id -> KV blocks held
        self.requests: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.ready = True

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        self.requests.append(request)
        rid, sp = request.request_id, request.sampling
        if self.fail_with is not None:
            yield error_chunk(rid, self.fail_with)
            return
        self.active[rid] = 1 + len(request.prompt_token_ids) // 16
        out = list(self.script(request))
        drafted = accepted = emitted = 0
        try:
            while True:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                else:
                    await asyncio.sleep(0)
                if rid not in self.active:          # aborted meanwhile
                    return
                step = out[emitted:emitted + self.chunk_size]
                reason = None
                if not sp.ignore_eos and self.eos_token_id in step:
                    step = step[:step.index(self.eos_token_id) + 1]
                    reason = "stop"
                if sp.stop_token_ids and any(t in sp.stop_token_ids for t in step):
                    first = min(step.index(t) for t in sp.stop_token_ids if t in step)
                    step, reason = step[:first + 1], "stop"
                step = step[:sp.max_tokens - emitted]
                emitted += len(step)
                if reason is None and emitted >= sp.max_tokens:
                    reason = "length"
                if reason is None and emitted >= len(out):
                    reason = "stop"
                if request.speculation.mode != "off" and self.speculation:
                    drafted += 4
                    accepted += max(len(step) - 1, 0)
                self.active[rid] = 1 + (len(request.prompt_token_ids) + emitted) // 16
                prompt_lps = None
                if sp.prompt_logprobs is not None and emitted == len(step):     # the first chunk
                    prompt_lps = [None] + [fake_logprob(t, sp.prompt_logprobs) for t in request.prompt_token_ids[1:]]
                yield GenerationChunk(rid, step, reason is not None, reason, drafted, accepted,
                                      logprobs=None if sp.logprobs is None else [fake_logprob(t, sp.logprobs)
                                                                                 for t in step],
                                      prompt_logprobs=prompt_lps)
                if reason is not None:
                    self.finished.append(rid)
                    return
        finally:
            self.active.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.active.pop(request_id, None)

    async def health(self) -> dict:
        return {"ok": self.ready, "speculation": self.speculation}

    async def stats(self) -> dict:
        used = sum(self.active.values())
        return {"acceptance_rate": 0.75, "mean_accepted_length": 3.25,
                "verifier_idle_fraction": 0.125, "num_running": len(self.active),
                "kv_blocks_used": used, "kv_blocks_free": self.num_kv_blocks - used}


def fake_logprob(token_id: int, k: int):
    """A scripted token's log-probability: -(id % 5) / 4, its top k the ids after it, each less likely."""
    from models.sampling import TokenLogprob

    lp = -(token_id % 5) / 4
    return TokenLogprob(token_id, lp, [(token_id + 1 + i, lp - 1 - i) for i in range(k)])


def tiny_byte_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained in milliseconds on `SAMPLE_TEXT`, with `<eos>` = id 0.

    So small a vocabulary leaves most multi-byte UTF-8 characters split across
    several tokens, which is what detokenizer tests need. No chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([SAMPLE_TEXT] * 4 + ["the quick brown fox jumps over the lazy dog"],
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
