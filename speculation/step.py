"""The speculative step: draft, verify, accept or reject, commit (DESIGN.md §3-§4).

Every engine runs this one function, through the one scheduler (verifier/scheduler.py): the
in-process engine, whose drafter drafted each tree an instant before on the same cores, and
the pipeline, whose drafter drafted it ahead of time on a device of its own and filed it in
the ring. Read it like gpt-fast's `speculative_decode`; the comments give the rules.

Exactness rests on three facts checked here or before: a tree is verified only for exactly
the prefix it was drafted after (the ring checks the claimed prefix); the target's
distributions p and the draft's q went through the same sampling transforms
(`models.sampling.logits_to_probs`); and the acceptance test is the exact one (greedy: the
target's argmax; sampled: multi-step speculative sampling, `kernels.rejection_sample`).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from models.sampling import SamplingParams
from models.tree import TokenTree


class Committing(Protocol):
    """A sequence as the step sees it (verifier.stream.VerifyStream)."""

    request_id: str
    committed: list[int]          # prompt + accepted output; the last token is the next tree's root
    params: SamplingParams
    generator: torch.Generator    # the request's own randomness: acceptance draws, corrections

    def commit(self, token_ids: list[int]) -> list[int]: ...


@dataclass
class StepItem:
    """One sequence of a step and the tree it verifies."""

    seq: Committing
    tree: TokenTree               # drafted after exactly `seq.committed`; 0 nodes = decode alone
    header: Any = None            # the drafter's speculation.wire.TreeHeader; None = not a drafter's tree


def tree_rows(batch: Iterable[StepItem]) -> int:
    """Rows a verification forward of `batch` runs: each tree's nodes and its root."""
    return sum(1 + it.tree.num_nodes for it in batch)


@dataclass
class StepOutcome:
    item: StepItem
    result: Any                   # verifier.VerifyResult: accepted path, its tokens + the next one
    kept: list[int]               # tokens committed (up to the sequence's stop condition)


async def _inline(fn: Callable, *args):
    return fn(*args)


class Verifying(Protocol):
    """The target side (verifier.target.TargetSide)."""

    def verify_items(self, items: list[StepItem], threads: int | None, chunks: list | None) -> tuple[list, float]: ...


async def speculative_step(items: list[StepItem], target: Verifying,
                           run: Callable[..., Awaitable] = _inline, threads: int | None = None,
                           chunks: list | None = None) -> tuple[list[StepOutcome], float]:
    """One speculative step over a batch. `run(fn, *args)` runs the target's forward where the
    model lives (the model thread, or inline); `threads`: torch threads for it; `chunks`:
    prompts' chunks (`verifier.verifier.PromptChunk`) fed in the same forward (chunked
    prefill). Returns the outcomes and the forward's seconds."""
    # 1. Draft: done before the step. Each item's tree claims exactly its sequence's
    #    committed prefix, with the draft distribution q of every node (None when greedy).
    # 2. Verify: ONE target forward over every sequence's [root] + tree nodes, each under its
    #    tree mask, gives p after the root and after every node (T + 1 distributions a tree).
    # 3. Accept / reject, per tree, from the root down: greedy, the child carrying the target's
    #    argmax; sampled, child x with probability min(1, p(x) / q(x)), p <- norm(max(p - q, 0))
    #    after each rejection. The path ends with one token of the target's own: the bonus
    #    (sampled from p below the last accepted node) or the correction.
    results, seconds = await run(target.verify_items, items, threads, chunks)
    # 4. Commit the accepted path and that token, up to each sequence's stop condition; the
    #    target's KV cache already keeps exactly these (the verifier compacted it).
    return [StepOutcome(it, res, it.seq.commit(res.token_ids)) for it, res in zip(items, results)], seconds


def commit_tokens(committed: list[int], output: list[int], token_ids: Iterable[int], stop_ids: set[int],
                  max_tokens: int, max_context: int) -> tuple[list[int], str | None]:
    """Append verified tokens to a sequence until a stop condition. Returns (the tokens kept,
    the finish reason: "stop" after a stop token, "length" at `max_tokens` or the context's
    end, None while it goes on)."""
    kept = []
    for t in token_ids:
        committed.append(t)
        output.append(t)
        kept.append(t)
        if t in stop_ids:
            return kept, "stop"
        if len(output) >= max_tokens or len(committed) >= max_context:
            return kept, "length"
    return kept, None
