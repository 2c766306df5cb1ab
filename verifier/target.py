"""The target's side of every engine: the model, its paged KV cache and the `Verifier`.

Built inside the process that serves (an actor, or the in-process engine) from a checkpoint
directory or a `random:` preset (`models.presets`), so weights never travel through Ray.
"""
from __future__ import annotations

import time

import torch

from verifier.verifier import PromptChunk, Verifier, VerifyRequest

PREFILLING = "prefilling"     # what `TargetSide.prefill` returns while chunks of the prompt remain


class TargetSide:
    """Target model + paged KV cache + Verifier; one forward per verification step."""

    def __init__(self, target: str, num_blocks: int, block_size: int = 16, device: str = "cpu",
                 dtype: str = "float32", features: bool = False, model=None, prefix_caching: bool = False,
                 feature_layers: tuple[int, ...] = ()) -> None:
        """`target`: a checkpoint directory or `random:<preset>`; `model`: an already loaded
        `models.Transformer` instead. `features`: return the target's hidden states with each
        verification and prefill (a feature-conditioned draft reads them; with prefix caching
        the Verifier keeps those of cached blocks); `feature_layers`: with them, the outputs of
        these target layers (a fused EAGLE head's `aux_layers`, `models.eagle`).
        `prefix_caching`: automatic prefix caching in the target's KV cache."""
        from models.presets import load

        model = model if model is not None else load(target, device, dtype)
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_position_embeddings
        cache = model.new_cache(num_blocks, block_size, prefix_caching=prefix_caching)
        self.verifier = Verifier(model, cache, features=features, feature_layers=feature_layers)
        self.partial: set[str] = set()        # sequences whose chunked prefill is under way
        self._pieces: dict[str, list] = {}    # their features so far
        self.fed = 0                          # prompt tokens the latest `prefill` fed (past cached ones)
        self.graphs = getattr(model, "graphs", None)     # models.cuda_graphs.GraphedLayers on a GPU

    @property
    def cache(self):
        return self.verifier.cache

    @property
    def model(self):
        return self.verifier.model

    def prefill(self, seq_id: str, prompt: list[int], use_cache: bool = True, chunk: int = 0):
        """Cache the prompt but its last token, from the longest cached prefix on (unless
        `use_cache` is False); with features, their hidden states [n - 1, hidden]. The prompt
        tokens found cached: `cached_tokens(seq_id)`. `chunk` > 0: feed at most that many
        tokens per call (chunked prefill): returns `PREFILLING` until a call completes it. `fed`:
        the tokens this call fed."""
        c = PromptChunk(seq_id, prompt, use_cache, chunk or None)
        self.verifier.feed_chunks([c])
        return self.after_chunk(c)

    def after_chunk(self, c: PromptChunk):
        """A prompt's chunk fed (by `prefill` or inside a verification): `fed`, the prompt's
        features so far; returns `PREFILLING` while chunks remain, else what `prefill` returns."""
        self.fed = self.cache.seq_len(c.seq_id) - c.at
        if c.hidden is not None:
            self._pieces.setdefault(c.seq_id, []).append(c.hidden)
        if self.cache.seq_len(c.seq_id) < len(c.prompt) - 1:
            self.partial.add(c.seq_id)
            return PREFILLING
        self.partial.discard(c.seq_id)
        pieces = self._pieces.pop(c.seq_id, None)
        return None if pieces is None else torch.cat(pieces)

    def cached_tokens(self, seq_id: str) -> int:
        return self.verifier.cached_tokens.get(seq_id, 0)

    def prompt_logprobs(self, prompt: list[int], params) -> list:
        """`Verifier.prompt_logprobs`: None, then a TokenLogprob per prompt token after the first."""
        return self.verifier.prompt_logprobs(prompt, params)

    def verify(self, requests: list, threads: int | None = None, chunks: list | None = None) -> tuple[list, float]:
        """`requests`: verifier.VerifyRequest list. Returns (VerifyResult list, seconds).

        `threads`: torch threads for this forward, set in the calling thread (OpenMP's
        thread count is a per-thread setting). `chunks`: `PromptChunk`s fed in the same
        forward (chunked prefill); `after_chunk` reads each one's outcome.
        """
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        results = self.verifier.verify(requests, chunks or ())
        return results, time.perf_counter() - start

    def verify_items(self, items: list, threads: int | None = None, chunks: list | None = None
                     ) -> tuple[list, float]:
        """`verify` for a step's `speculation.step.StepItem`s: each sequence's root and tree."""
        return self.verify([VerifyRequest(it.seq.request_id, it.seq.committed[-1], it.tree, it.seq.params,
                                          it.seq.generator, it.seq.committed) for it in items], threads, chunks)

    def release(self, seq_id: str, token_ids: list[int] | None = None) -> None:
        """Free the sequence; `token_ids`: its committed tokens, whose full blocks stay cached."""
        self.verifier.release(seq_id, token_ids)
        self.partial.discard(seq_id)
        self._pieces.pop(seq_id, None)

    def warm_up(self, spec_len: int, prompt_len: int = 32, *, width: int = 1,
                max_len: int | None = None) -> float:
        """Before serving: one dummy sequence through a prefill, plain steps and chain
        verifications of 1..`spec_len` nodes, each shape twice, so that no one-off work lands
        inside the first requests: on a GPU Triton compiles those kernels (the sampler's too),
        on a CPU the first forwards' allocations and weight packing (a fresh in-process engine's
        first request took 2 s cold against 0.3 s warmed on the embedded pair). Then on a GPU
        the CUDA graphs of every verification shape the planner can choose
        (`speculation.planner.verify_rows`: trees of up to `spec_len` levels of `width`) for one
        sequence at every block-table width up to `max_len` tokens (None: what the cache holds),
        `models.cuda_graphs.GraphedLayers.warm_up` (on an H200 a cold first draft took 5 s, long
        enough for the verifier to count its drafter as gone). The dummy takes at most
        `prompt_len` + `spec_len` tokens (each verification is rolled back), fewer in a smaller
        cache (`speculation.planner.warm_up_prompt_len`); none where not even that fits. It
        leaves every block free and the prefix cache's hit counts as they were. Returns the
        seconds it took (0 when skipped)."""
        from speculation.planner import verify_rows, warm_up_prompt_len

        start, sid = time.perf_counter(), "__warm_up__"
        prompt_len = warm_up_prompt_len(self.cache, prompt_len, spec_len, self.max_context)
        if prompt_len:
            self._warm_up_forwards(sid, [1] * prompt_len, spec_len)
        if self.graphs is not None:
            self.graphs.warm_up(self.cache, verify_rows(spec_len, width), max_len=max_len)
        return time.perf_counter() - start if prompt_len or self.graphs is not None else 0.0

    def _warm_up_forwards(self, sid: str, prompt: list[int], spec_len: int) -> None:
        """`warm_up`'s dummy steps: 2 plain steps, then chains of 1..`spec_len` twice each, each
        rolled back to the prompt so that the sequence never outgrows it by more than a tree."""
        from models.sampling import SamplingParams
        from models.tree import TokenTree

        params, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
        with self.cache.uncounted():       # the dummy's lookups are not the clients' hit rate
            try:
                self.prefill(sid, prompt, use_cache=False)
                for k in [0, 0] + [k for k in range(1, spec_len + 1) for _ in (0, 1)]:
                    tree = TokenTree.empty(len(prompt)) if k == 0 else TokenTree.chain([1] * k, None, len(prompt))
                    self.verifier.verify([VerifyRequest(sid, prompt[-1], tree, params, gen)])
                    self.cache.truncate(sid, len(prompt) - 1)
            finally:
                self.release(sid)
