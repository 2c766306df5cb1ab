"""The scheduler: the verifier's half of the asynchronous protocol, for every engine (DESIGN.md §3).

One plain class, free of Ray and of asyncio, owns every request's stream, the ring of
drafted trees, the planner and the step costs; `verifier.loop.EngineLoop` drives it
(admit, collect, verify, publish) on an event loop with the forwards on a model thread. The
Ray verifier actor (cluster/actors.py) is that loop plus remote drafters calling `receive`;
the in-process engine is the same loop with a drafter in its own process, pumped before each
collect (verifier/inprocess.py). Drafter membership (attach, resync, rebalance) is
`verifier.membership.Membership`; admission (who joins the batch, their prefills and chunked
prefill's riders) is `verifier.admission.Admission`.

Each step takes, for every active sequence, the first valid tree in its ring (or a tree of
zero nodes when speculation is off, its drafter is dead, or its tree is late), verifies them
all in **one** target forward (continuous batching: sequences join and leave between steps),
commits, streams the tokens out at once, plans the next budgets and queues an accept /
rollback signal for each sequence's drafter. Exactness never rests on the drafter: only a
tree whose claimed prefix equals the committed one is verified (verifier/ring.py).

On a CPU node, a plain step or a prompt prefill taken while no drafter has work runs on the
idle drafters' cores too (`step_threads`, `speculation.policy.plain_step_threads`): with
speculation switched off the pipeline then decodes as fast as the target alone.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from models.sampling import SamplingParams
from models.linear import few_row_limit
from models.tree import TokenTree
from speculation.planner import AdaptiveSpeculation
from speculation.policy import bridge_chain_depth, restart_tree_depth, threads_of
from speculation.proposal import DraftRequest
from speculation.requests import GenerationChunk, InvalidRequest, SpeculationOptions, resolve_speculation
from speculation.settings import MAX_SPEC_LEN, EngineSettings
from speculation.stats import SpecStats
from speculation.step import StepItem, StepOutcome, tree_rows
from speculation.transport import Exchange
from speculation.wire import Signal
from verifier.admission import Admission, check_request
from verifier.chunking import PrefillBudget
from verifier.costs import StepCosts, StepKind
from verifier.lookup import VerifierLookup
from verifier.membership import Membership
from verifier.regime import RegimeChoice
from verifier.registry import DrafterRegistry
from verifier.ring import Ring, RingEntry
from verifier.stream import VerifyStream
from verifier.verifier import PromptChunk

log = logging.getLogger("specflash.verifier")


def drafted(batch: list[StepItem]) -> list[StepItem]:
    """The batch's trees drafted by a drafter (not prompt-lookup ones)."""
    return [it for it in batch if it.header is not None and it.tree.num_nodes]


def observe_verified(sch, s: VerifyStream, tree: TokenTree, header, res, chained: bool) -> None:
    """A verified tree's outcome in the scheduler `sch`'s stats and in the γ its proposer earns."""
    depth = int(tree.depths.max()) if tree.num_nodes else 0
    last = res.accepted_nodes[-1] if res.accepted_nodes else -1
    rejected = bool((tree.parent_ids == last).any())     # the walk stopped at a rejection
    for stats in (sch.stats, s.stats):
        stats.observe_verification(tree.num_nodes, res.num_accepted, depth, res.num_accepted, rejected)
    if s.restarting and header is not None:
        sch.stats.observe_restart_tree(tree.num_nodes, res.num_accepted)
    s.restarting = False
    if chained:
        sch.stats.observe_bridge_chain(tree.num_nodes, res.num_accepted)
        sch.adaptive.observe(s.request_id, depth, res.num_accepted)   # the draft's own γ
    elif header is None and tree.num_nodes:       # the verifier's own prompt-lookup chain
        sch.lookup.observe(s.request_id, depth, res.num_accepted)
        sch.stats.observe_lookup(tree.num_nodes, res.num_accepted)
    else:
        sch.adaptive.observe(s.request_id, depth, res.num_accepted)


def take_tree(entry: RingEntry) -> None:
    """How a filed tree's payload becomes its tree in process: it is the tree."""
    entry.tree = entry.payload


class Scheduler:
    def __init__(self, target, settings: EngineSettings, *, eos_ids=(), bridge_draft=None,
                 node_id: str = "", gpu_ids: list[str] | None = None) -> None:
        """`target`: a `verifier.target.TargetSide`; `bridge_draft`: the verifier's copy of the
        draft (`drafter.draft_side.BridgeDraft`) for bridge chains; `node_id` / `gpu_ids`: where
        this runs (Ray's names; "" / None where unknown or off a GPU)."""
        self.target, self.settings = target, settings
        self.threads = threads_of(settings.num_cpus)
        self.eos_ids = set(eos_ids)
        # the randomness of a request without a seed (its rejection sampler's draws); tests fix it
        self.entropy: Callable[[], int] = lambda: int.from_bytes(os.urandom(7), "little")
        self.bridge_draft = bridge_draft
        self.features = target.verifier.features     # a feature-conditioned drafter reads them
        self.ring = Ring(settings.ring_slots)
        self.adaptive = AdaptiveSpeculation(max_spec_len=MAX_SPEC_LEN)
        self.adaptive.restart_depth = max(0, settings.restart_depth)   # as planned: `_plan_and_signal`
        self.costs = StepCosts(self.adaptive, target.model, settings, self.threads)
        self.step_kind = StepKind()       # what the batch collected last was planned as (`collect`)
        self.regime = RegimeChoice(settings.lockstep_measured)    # a lone stream's: overlap or lockstep
        self.costs.choose(settings.ring_slots > 1, self.threads)
        self.chunks = PrefillBudget(settings.prefill_chunk, settings.prefill_step_share)
        self.riders: list[PromptChunk] = []     # prompts' chunks fed inside the next verification forward
        self.lookup = VerifierLookup(settings.lookup, few_row_limit(target.model))
        self.adaptive.row_limit = self.lookup.planner.row_limit
        self.registry = DrafterRegistry(settings, node_id, gpu_ids, self.threads)
        self.members = Membership(self)
        self.admission = Admission(self)
        self.stats = SpecStats()
        self.streams: dict[str, VerifyStream] = {}
        self.joins: deque[str] = deque()
        self.to_free: list[str] = []
        self.freed_tokens: dict[str, list[int]] = {}   # committed tokens of those, for the prefix cache
        self.reserved_blocks: dict[str, int] = {}
        self.announced: dict[str, list[int] | None] = {}   # this step's bridge chains: their outcomes
        self.error: str | None = None
        # how a filed tree's payload becomes a TokenTree (the Ray actor fetches it from the object
        # store instead), and how the loop is woken when work arrives
        self.fetch: Callable[[RingEntry], None] = take_tree
        self.on_work: Callable[[], None] = lambda: None

    # -- requests ------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            spec: SpeculationOptions | None, emit: Callable[[GenerationChunk], None],
            prefix_cache: bool = True) -> VerifyStream:
        """A new request; its chunks go to `emit`. Raises `InvalidRequest` for what it cannot serve.
        `prefix_cache` False: it neither starts on cached blocks nor leaves its own cached."""
        if request_id in self.streams:
            raise InvalidRequest(f"request id {request_id!r} is already running")
        ctx = self.target.max_context
        check_request(prompt, params, ctx, self.target.vocab_size)
        r = resolve_speculation(spec, self.settings, self.settings.proposers)
        seed = params.seed if params.seed is not None else self.entropy()
        # what both sides' sampling transforms read (models.sampling.process_logits)
        params = replace(params, prompt_len=len(prompt),
                         eos_token_ids=[] if params.ignore_eos else sorted(self.eos_ids))
        s = VerifyStream(request_id, list(prompt), params, torch.Generator().manual_seed(seed), set(params.stop_ids),
                         r.mode, r.spec_len, r.tree_width, ctx, proposer=r.proposer, seed=seed, emit=emit,
                         committed=list(prompt), prefix_cache=prefix_cache)
        s.started = time.perf_counter()
        self.streams[request_id] = s
        self.joins.append(request_id)
        self.on_work()
        return s

    def abort(self, request_id: str) -> bool:
        s = self.streams.get(request_id)
        if s is None:
            return False
        self.finish(s, "abort")
        return True

    def finish(self, s: VerifyStream, reason: str, notify: bool = True, error: str | None = None) -> None:
        """Take the stream out: ring slots now, KV blocks at the loop's next reap. With `notify`,
        an abort or an error is told to the request as a last chunk."""
        if s.request_id not in self.streams:
            return
        s.finish_reason = s.finish_reason or reason
        s.stats.observe_time("elapsed", time.perf_counter() - s.started)
        del self.streams[s.request_id]
        if s.request_id in self.joins:
            self.joins.remove(s.request_id)
        self.drop(self.ring.remove_stream(s.request_id))
        self.adaptive.remove(s.request_id)
        self.lookup.remove(s.request_id)
        self.reserved_blocks.pop(s.request_id, None)
        if s.prefilled or s.request_id in self.target.partial:
            self.to_free.append(s.request_id)
            self.freed_tokens[s.request_id] = s.committed    # the list itself: a running step extends it
        if s.drafter is not None:
            self.registry.send(s.drafter, Signal("leave", s.request_id, token_ids=s.cacheable(self.settings)))
        if notify and reason in ("abort", "error") and s.emit is not None:
            s.emit(s.chunk([], error=error))
        self.on_work()

    def fail_all(self, error: str) -> None:
        """A bug in a step: fail the running requests, keep serving."""
        self.error = error
        for s in list(self.streams.values()):
            self.finish(s, "error", error=f"verifier step failed: {error}")

    # -- drafters ------------------------------------------------------------------------
    def receive(self, call: Exchange) -> None:
        """A drafter's exchange (its trees already checked against the wire format)."""
        self.members.receive(call)

    def signals_for(self, drafter: int) -> list[Signal]:
        return self.registry.take(drafter)

    def drop(self, entries: list[RingEntry]) -> None:         # counts add up: none adds nothing
        self.stats.observe_dropped(len(entries), sum(e.header.num_nodes for e in entries))

    # -- admission (verifier/admission.py) -------------------------------------------------
    def plan_admission(self) -> tuple[list[str], list[str], int]:
        """(to free, joins, their prefill's threads): `Admission.plan`."""
        return self.admission.plan()

    def prefill(self, to_free: list[str], joins: list[str], threads: int) -> dict:
        """Free and prefill, on the model thread (`Admission.prefill`): the prefills' features."""
        return self.admission.prefill(to_free, joins, threads)

    def prefilled(self, joins: list[str], features: dict) -> None:
        self.admission.prefilled(joins, features)

    def active(self) -> list[VerifyStream]:
        return [s for s in self.streams.values() if s.prefilled]

    # -- a step --------------------------------------------------------------------------
    def collect(self, active: list[VerifyStream], now: float) -> tuple[list[StepItem], float]:
        """The batch to verify now, and when to look again if it is empty."""
        batch, deadline, alone = [], now + self.settings.poll_s, []
        kind = self.step_kind = StepKind()
        for s in active[: self.settings.max_batch_size]:
            ring = self.ring.stream(s.request_id)
            entry, dropped = ring.head_valid(s.committed)
            self.drop(dropped)
            if entry is not None and entry.tree is not None:
                ring.pop()
                batch.append(StepItem(s, entry.tree, entry.header))
                kind.planned, kind.catching_up = True, kind.catching_up or s.first_tree
                s.waiting_since, s.first_tree = None, False
                continue
            planned = s.budget[0] > 0 and not s.bridge
            wants = planned and self.registry.live(s.drafter)
            if planned and not wants:      # its drafter is dead, restarting or stuck: decode alone
                self.stats.observe_drafter_absent()
            if wants:
                s.waiting_since = s.waiting_since or now
                late = s.waiting_since + self.members.patience(s)
                if now < late:
                    deadline = min(deadline, late)
                    continue
                self.stats.observe_fallback()
            s.waiting_since = None
            if wants or s.bridge:       # a late tree, or the bridge after a contradicted one
                kind.planned, kind.catching_up = True, kind.catching_up or (wants and s.first_tree)
            if not (wants or s.bridge):
                alone.append(len(batch))
            elif s.bridge and self.bridge_draft is not None and \
                    bridge_chain_depth(self.settings, s.params, s.budget[0], s.proposer) > 0:
                self.announced[s.request_id] = None     # a bridge chain: drafted before the forward
            s.bridge = False
            batch.append(StepItem(s, TokenTree.empty(len(s.committed))))
        if alone:
            self._lookup_trees(batch, alone)
        trees = drafted(batch)
        # each drafter's way once (a way counts the drafter's streams)
        kind.lockstep = bool(trees) and all(self.members.lockstep(d) for d in {it.seq.drafter for it in trees})
        kind.settling = self.regime.settling > 0
        return batch, deadline

    def bridge_chains(self, batch: list[StepItem], threads: int) -> None:
        """Replace the empty trees of the batch's bridging sequences (`announced`) by the draft's
        greedy chains, drafted in one pass; note the outcome each announces. Runs on the model
        thread, on the step's `threads`."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        at = {it.seq.request_id: i for i, it in enumerate(batch) if it.seq.request_id in self.announced}
        requests = [DraftRequest(rid, batch[i].seq.committed, batch[i].seq.params, batch[i].seq.generator,
                                 bridge_chain_depth(self.settings, batch[i].seq.params, batch[i].seq.budget[0],
                                                    batch[i].seq.proposer)) for rid, i in at.items()]
        for r, chain in zip(requests, self.bridge_draft.chains(requests)):
            batch[at[r.seq_id]] = StepItem(batch[at[r.seq_id]].seq, chain.tree)
            self.announced[r.seq_id] = chain.outcome

    def _lookup_trees(self, batch: list[StepItem], alone: list[int]) -> None:
        """Prompt-lookup chains of the verifier's own (verifier/lookup.py) for the sequences of
        `batch` (indices `alone`) that decode alone by plan (not bridging, no tree late). Only in
        steps without a drafter's tree, which run on the cores a plain step would (a mixed
        batch is priced by the drafter's plan instead)."""
        if len(alone) < len(batch) or not self.members.drafters_idle():
            return
        candidates = [(s.request_id, s.committed, min(s.spec_len, s.max_depth()), s.params.reads_q)
                      for s in (batch[i].seq for i in alone) if self.lookup.wants(s.request_id)]
        if not candidates:
            return
        costs = self.costs.plain if self.costs.borrowing_measured(self.registry.lendable_threads(now=False)) \
            else self.costs.overlap
        chains = self.lookup.chains(candidates, len(batch) - len(candidates), costs)
        for i in alone:
            s = batch[i].seq
            if s.request_id in chains:
                batch[i] = StepItem(s, chains[s.request_id])

    def step_threads(self, batch: list[StepItem], turn: int | None = None) -> int:
        """The verifier's own threads, or more for a step while no drafter has work: no drafter's
        tree in the batch (prompt-lookup ones may be) and every sequence at budget 0, its drafter
        told so; or, in lockstep, every drafted sequence's one tree in this batch (its drafter
        waits for the step's signal); `turn`, when the drafters of this process chose the
        threads of this lockstep turn (`verifier.inprocess.InProcessDrafters`)."""
        if drafted(batch):
            if not self.members.drafters_blocked(batch):
                return self.threads
            return self.registry.lendable_threads() if turn is None else turn
        return self.registry.lendable_threads() if self.members.drafters_idle() else self.threads

    def publish(self, outcomes: list[StepOutcome], draft_s: float, verify_s: float) -> None:
        """After the forward: stream the committed tokens out, plan the next budgets, signal the
        drafters. `draft_s` / `verify_s`: the step's drafting and forward seconds, shared out
        among its sequences' own stats."""
        steps = []
        share = 1.0 / max(1, len(outcomes))
        for o in outcomes:
            s, tree, header, res = o.item.seq, o.item.tree, o.item.header, o.result
            if s.request_id not in self.streams:     # aborted while the target ran
                continue
            tree_id = -1 if header is None else header.tree_id
            # the drafter announced what it assumed; a contradiction makes it bridge, so do we
            # (after a bridge chain, which announced the draft's path: drafter/streams.py)
            chained = s.request_id in self.announced
            announced = self.announced.pop(s.request_id, None) if chained else \
                (None if header is None else header.outcome)
            s.bridge = announced is not None and announced != res.token_ids
            observe_verified(self, s, tree, header, res, chained)
            s.stats.observe_generated(len(o.kept))
            s.stats.observe_time("draft", draft_s * share)
            s.stats.observe_time("verify", verify_s * share)
            if res.features is not None:
                s.features.append(res.features)
            logprobs = None if res.logprobs is None else res.logprobs[:len(o.kept)]
            s.logprobs += logprobs or []
            s.emit(s.chunk(o.kept, logprobs=logprobs))
            if s.finish_reason:
                self.finish(s, s.finish_reason, notify=False)
            else:
                steps.append((s, tree_id, o.kept))
        # a lone stream's regime, measured on what this step committed (before the plan uses it)
        self.regime.observe(self.members.lone_stream(), sum(len(o.kept) for o in outcomes), time.monotonic())
        self._plan_and_signal(steps)
        self.stats.observe_ring(self.ring.total(), self.ring.capacity())
        self.announced.clear()       # a chain's outcome counts for its own step only

    def _plan_and_signal(self, steps: list[tuple[VerifyStream, int, list[int]]]) -> None:
        live = [s for s, _, _ in steps]
        self.plan_overlap()
        lendable = self.registry.lendable_threads(now=False)
        extra = self.costs.refilling(len(live), lendable)
        self.adaptive.restart_depth = self._restart_depth(live)
        plan = self.adaptive.plan([s.request_id for s in live], alone=extra,
                                  plain_step_s=self.costs.plain_step_s(len(live) + extra, lendable)) if live else {}
        lockstep: dict[int, bool] = {}     # each drafter's way this step, worked out once
        for s, tree_id, kept in steps:
            s.budget = s.capped(plan[s.request_id])
            self.stats.observe_speculation(s.budget[0] > 0)
            if s.drafter is None:
                continue
            restart = restart_tree_depth(self.settings, s.budget[0],
                                         self.members.overlapped_alone(s.drafter)) if s.bridge else 0
            if restart:
                # no bridge: the drafter drafts a short restart tree after the committed prefix
                # (this step's signal tells it) and the sequence waits for it
                s.bridge, s.restarting = False, True
                self.stats.observe_restart()
            if s.budget == s.sent_budget == (0, 0) and tree_id == -1:
                # the drafter has nothing to draft and knows it: it hears of these tokens with
                # the next signal it needs instead of once per step (no wake-ups, no calls)
                s.unsent.extend(kept)
                continue
            ring = self.ring.stream(s.request_id)
            if s.drafter not in lockstep:
                lockstep[s.drafter] = self.members.lockstep(s.drafter)
            self.registry.send(s.drafter, Signal("step", s.request_id, ring.epoch, tree_id, len(s.committed),
                                                 s.unsent + kept, s.budget,
                                                 features=s.unsent_features() if self.features else None,
                                                 lockstep=lockstep[s.drafter], restart=restart))
            s.unsent, s.sent_budget = [], s.budget

    def _restart_depth(self, live: list[VerifyStream]) -> int:
        """The depth of the restart trees the plan prices after a contradicted outcome (within each
        stream's depth): `restart_tree_depth`'s, the one stream planned counted as overlapped
        alone with its drafter where it is; 0 = bridges."""
        alone = len(live) == 1 and self.members.overlapped_alone(live[0].drafter)
        return restart_tree_depth(self.settings, MAX_SPEC_LEN, alone)

    def plan_overlap(self, joining: list[VerifyStream] = ()) -> None:
        """Before a plan: the step-cost model of how the drafters run now (`StepCosts.choose`):
        lockstep while every drafter runs in lockstep, else overlapped, with bridges; and the
        cost of the prompt chunk that each step pays while a prefill is under way. `joining`:
        the streams being admitted (`Membership.plan_bridges`)."""
        self.costs.choose(self.members.plan_bridges(joining), self.registry.lendable_threads(now=False))
        waiting = bool(self.joins) or any(s.under_way for s in self.streams.values())   # a chunk a step too
        self.adaptive.chunk_s = self.chunks.seconds(self.chunks.tokens(True) or 0) if waiting else 0.0

    def observe_step(self, batch: list[StepItem], seconds: float, threads: int, step_s: float, chunks=None) -> None:
        """The step's forward (`seconds`, on `threads`) and its cost after admission (`step_s`);
        `chunks`: the prompt chunks (`PromptChunk`) its forward fed too."""
        borrowed = threads != self.threads
        self.stats.observe_batch(seconds)
        if borrowed:
            self.stats.observe_borrowed_step()
        rows_of_trees, fed = tree_rows(batch), sum(len(c.ids or ()) for c in chunks or ())
        self.chunks.observe_step(step_s, rows_of_trees, fed)
        rows = rows_of_trees + fed       # a chunk's rows are rows of the forward too
        self.costs.observe_forward(rows, seconds, borrowed)
        trees = drafted(batch)
        levels = max(int(it.tree.depths.max()) for it in trees) if self.step_kind.lockstep else None
        self.costs.observe_step(rows, step_s, levels, borrowed, bool(trees), self.step_kind)

    # -- reports -------------------------------------------------------------------------
    def health(self) -> dict:
        return {"ok": self.error is None, "error": self.error, "active": len(self.streams),
                **self.registry.report(), "cpus": self.settings.num_cpus, "gpus": self.registry.gpu_ids}

    def report(self) -> dict:
        cache = self.target.cache
        return {**self.stats.as_dict(), **self.costs.report(), **self.chunks.report(), **self.regime.report(),
                **self.adaptive.report(),
                "drafters_live": self.registry.live_ids(),
                "prefix_cached_blocks": cache.num_cached_blocks, "prefix_evictions": cache.evictions,
                # CUDA graphs of the target's small forwards (None off a GPU): captures, replays, eager
                "cuda_graphs": None if self.target.graphs is None else self.target.graphs.stats()}

    def kv_usage(self) -> dict:
        """KV blocks, ring slots and the other per-request state (all 0 / free when idle)."""
        cache = self.target.cache
        return {"free": cache.num_free_blocks, "total": cache.num_blocks, "ring": self.ring.total(),
                "cached_blocks": cache.num_cached_blocks,
                "streams": len(self.streams), "joins": len(self.joins),
                "reserved_blocks": sum(self.reserved_blocks.values()), "to_free": len(self.to_free)}
