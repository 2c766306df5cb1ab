"""Admission: which waiting requests join the batch, and their prompts' prefills (DESIGN.md §3).

Continuous batching as vLLM schedules it: between steps, finished sequences are freed and
waiting ones admitted, oldest first, within the batch size and the target's KV blocks (each
reserves its prompt, its `max_tokens` and the widest tree up front, so a running sequence
never runs out). An admitted sequence gets its ring, its first budget (planned with the
running batch, `speculation.planner.AdaptiveSpeculation.plan_joining`) and its drafter before
its prefill, so that the drafter drafts its first tree while the target prefills. With
chunked prefill (verifier/chunking.py) a prompt is fed over several steps within each step's
token budget; while streams decode, its chunk rides inside their verification forward
(`settle_riders`) instead of a forward of its own.

Part of the scheduler (verifier/scheduler.py), kept apart so that each reads on its own: the
scheduler's `plan_admission`, `prefill` and `prefilled` are these.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from models.sampling import SamplingParams
from speculation.requests import InvalidRequest
from speculation.settings import MAX_SPEC_LEN
from verifier.target import PREFILLING
from verifier.verifier import PromptChunk

if TYPE_CHECKING:
    from verifier.scheduler import Scheduler


def check_request(prompt: list[int], params: SamplingParams, ctx: int, vocab: int) -> None:
    """`InvalidRequest` for a prompt or sampling parameters this target cannot serve."""
    if not prompt:
        raise InvalidRequest("the prompt is empty: it must hold at least one token", "prompt")
    if len(prompt) >= ctx:
        raise InvalidRequest(f"the prompt is {len(prompt)} tokens long; the target's context is {ctx} "
                             f"tokens (room is needed for at least one more)", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
    if any(t >= vocab for t, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias names token ids outside the vocabulary [0, {vocab})", "logit_bias")


def settle_riders(sch: Scheduler, riders: list[PromptChunk], seconds: float) -> None:
    """After a step whose forward fed `riders` (`seconds`: the forward's): their outcomes in the
    scheduler `sch`, as `Scheduler.prefilled` settles a prefill of their own."""
    sch.riders = []
    features = {c.seq_id: sch.target.after_chunk(c) for c in riders}
    for c in riders:
        s = sch.streams.get(c.seq_id)
        if s is not None:
            s.observe_prefill(seconds / len(riders), sch.target.cached_tokens(c.seq_id), sch.stats,
                              features[c.seq_id] is not PREFILLING)
    sch.prefilled([c.seq_id for c in riders], features)


class Admission:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sch = scheduler
        self.feeds: dict[str, int | None] = {}   # this step's prefills: tokens each may feed (None: all)

    def plan(self) -> tuple[list[str], list[str], int]:
        """Finished sequences to free and waiting ones to admit (within the batch size and the KV
        budget), each admitted one given its ring, first budget and drafter, so that the drafter
        drafts its first tree while the target prefills. Returns (to free, joins, the threads of
        their prefill)."""
        sch = self.sch
        to_free, sch.to_free = sch.to_free, []
        joins = []
        budget = sch.target.cache.num_blocks - sum(sch.reserved_blocks.values())
        running = sum(1 for s in sch.streams.values() if s.prefilled)
        # the prefill's token budget (verifier/chunking.py): prompts under way first, oldest first
        self.feeds = {}
        sch.chunks.start(decoding=running > 0)
        for rid, s in [(r, s) for r, s in sch.streams.items() if s.under_way]:
            if sch.chunks.spent:
                break
            have = sch.target.cache.seq_len(rid) if sch.target.cache.has_sequence(rid) else 0
            self.feeds[rid] = sch.chunks.grant(len(s.prompt) - 1 - have)
        while sch.joins and running + len(joins) < sch.settings.max_batch_size and not sch.chunks.spent:
            s = sch.streams[sch.joins[0]]
            need = -(-(len(s.prompt) + s.params.max_tokens + MAX_SPEC_LEN * s.tree_width + 2)
                     // sch.settings.block_size)
            if need > sch.target.cache.num_blocks:
                sch.joins.popleft()
                sch.finish(s, "error", error=f"request needs {need} KV blocks; the verifier has "
                           f"{sch.target.cache.num_blocks}")
                continue
            if need > budget:
                break                        # wait for running sequences to finish
            budget -= need
            sch.reserved_blocks[s.request_id] = need
            self.feeds[s.request_id] = sch.chunks.grant(max(1, len(s.prompt) - 1))
            joins.append(sch.joins.popleft())
        if joins:
            self._admit(joins)
        joins += [rid for rid in self.feeds if rid not in joins]   # the next chunks of prompts under way
        # while streams decode, a chunk rides in their next verification forward (no pass of its own)
        rides = [r for r in joins if running and sch.chunks.chunk and sch.streams[r].params.prompt_logprobs is None]
        sch.riders = [PromptChunk(r, sch.streams[r].prompt, sch.streams[r].prefix_cache, self.feeds[r]) for r in rides]
        joins = [rid for rid in joins if rid not in rides]
        # a prefill, like a plain step, may run on the idle drafters' cores
        threads = sch.registry.lendable_threads() if sch.members.drafters_idle() else sch.threads
        return to_free, joins, threads

    def _admit(self, joins: list[str]) -> None:
        sch = self.sch
        beside = [t.budget for t in sch.streams.values() if t.prefilled]
        for rid in joins:
            s = sch.streams[rid]
            sch.adaptive.add(rid, s.mode, s.spec_len, s.tree_width, s.proposer)
            if s.proposer == "model":
                sch.lookup.add(rid, s.mode, s.spec_len)
        # first budgets planned with the running batch (a tree that a large batch's plan would
        # never allow would also take its steps off the borrowed cores)
        sch.plan_overlap([sch.streams[rid] for rid in joins])
        lendable = sch.registry.lendable_threads(now=False)
        extra = sch.costs.refilling(len(beside) + len(joins), lendable)
        first = sch.adaptive.plan_joining(joins, beside + [(0, 0)] * extra,
                                          sch.costs.plain_step_s(len(beside) + len(joins) + extra, lendable))
        for rid in joins:
            s = sch.streams[rid]
            s.admitted = True
            sch.ring.add_stream(rid)
            s.budget = s.capped(first[rid])
            sch.adaptive.started(rid, s.budget[0])
            sch.stats.observe_join(s.budget[0] > 0)
            if not sch.features:         # a feature-conditioned drafter waits for the prefill's features
                sch.members.assign_new(s)

    def prefill(self, to_free: list[str], joins: list[str], threads: int) -> dict:
        """Free and prefill, on the model thread. Returns the prefills' target features (if any)."""
        sch = self.sch
        start = time.perf_counter()
        torch.set_num_threads(threads)           # per call: the step before may have run on lent cores
        for rid in to_free:
            sch.target.release(rid, sch.freed_tokens.pop(rid, None))
            if sch.bridge_draft is not None:
                sch.bridge_draft.release(rid)
        features = {}
        for rid in joins:
            s = sch.streams.get(rid)
            features[rid] = sch.target.prefill(rid, s.prompt if s is not None else [0],
                                               s is not None and s.prefix_cache, self.feeds.get(rid) or 0)
            if s is not None and s.params.prompt_logprobs is not None:
                s.prompt_logprobs = sch.target.prompt_logprobs(s.prompt, s.params)
        seconds = (time.perf_counter() - start) / max(1, len(joins))
        for rid in joins:
            if rid in sch.streams:
                done = features[rid] is not PREFILLING
                sch.streams[rid].observe_prefill(seconds, sch.target.cached_tokens(rid), sch.stats, done)
        return features

    def prefilled(self, joins: list[str], features: dict) -> None:
        sch = self.sch
        for rid in joins:
            s = sch.streams.get(rid)
            if s is None:                    # aborted during its prefill
                sch.to_free.append(rid)
                continue
            if features[rid] is PREFILLING:  # chunks of its prompt remain
                continue
            s.prefilled = True
            if sch.features:
                s.features.append(features[rid])
                sch.members.assign_new(s)
