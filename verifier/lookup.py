"""The verifier's own speculation: prompt-lookup chains where the draft model is off.

In a step where no sequence has a drafter's tree (the planner chose depth 0 for every "auto"
one, so the drafters sit idle), an "auto" sequence may still speculate: the verifier looks up
the latest earlier occurrence of its last 3 (else 2) committed tokens in the prompt and
output (`speculation.proposal.NgramIndex`, kept per sequence: with 16 sequences of 300 tokens
and few repeats, lookups and plan cost 0.19 ms a step against 2.07 ms by a scan,
`bench/lookup_plan.py`) and verifies the tokens that followed it as a chain of point masses
(exact under sampling too). A planner of its own (the same optimiser, a γ per sequence for
these chains, no drafting cost) picks each chain's length, or none, where that beats decoding
alone. Such steps cost the drafter nothing: it hears of the committed tokens with its next
signal as before.
"""
from __future__ import annotations

from models.tree import TokenTree
from speculation.cost_model import VerifyCosts
from speculation.planner import AdaptiveSpeculation
from speculation.proposal import NgramIndex, lookup, point_mass_chain
from speculation.settings import MAX_SPEC_LEN


class VerifierLookup:
    """The γ of each sequence's lookup chains and its n-gram index."""

    def __init__(self, enabled: bool, row_limit: int | None = None) -> None:
        self.enabled = enabled
        self.planner = AdaptiveSpeculation(max_spec_len=MAX_SPEC_LEN, overlap=False)
        self.planner.row_limit = row_limit
        self.indexes: dict[str, NgramIndex] = {}

    def add(self, stream: str, mode: str, spec_len: int) -> None:
        """A joining sequence: "auto" ones may get lookup chains."""
        if self.enabled and mode == "auto":
            self.planner.add(stream, "auto", spec_len, 1)
            self.indexes[stream] = NgramIndex(3, 2)

    def remove(self, stream: str) -> None:
        self.planner.remove(stream)
        self.indexes.pop(stream, None)

    def wants(self, stream: str) -> bool:
        return stream in self.planner.seqs

    def observe(self, stream: str, depth: int, accepted: int) -> None:
        self.planner.observe(stream, depth, accepted)

    def chains(self, candidates: list[tuple[str, list[int], int, bool]], alone: int,
               costs) -> dict[str, TokenTree]:
        """Chains worth verifying this step; `costs`: the step-cost model whose verify half
        prices them (`speculation.cost_model.CostModel`). See `plan_lookups`."""
        self.planner.costs = VerifyCosts(costs)
        return plan_lookups(self.planner, candidates, alone, self.indexes)


def plan_lookups(planner: AdaptiveSpeculation, candidates: list[tuple[str, list[int], int, bool]],
                 alone: int, indexes: dict | None = None) -> dict[str, TokenTree]:
    """Prompt-lookup chains worth verifying.

    `candidates`: (stream, committed tokens, deepest useful node, whether its verification
    reads q: `SamplingParams.reads_q`) of the streams in `planner` (their γ of these chains) that
    would decode alone this step; `alone`: the other sequences of the step, decoding alone.
    Each candidate's proposal is the tokens that followed the latest earlier occurrence of its
    last 3 (else 2) tokens, at most its `max_len`; the planner chooses how many of them to
    verify where that beats decoding alone. `indexes`: a `NgramIndex` per stream, kept across calls (else a scan).
    Returns {stream: TokenTree} for the chosen (a chain of point masses)."""
    proposals = {}
    for stream, tokens, depth, reads_q in candidates:
        k = min(planner.seqs[stream].max_len, depth)
        index = None if indexes is None else indexes.get(stream)
        if k <= 0:
            found = []
        else:
            found = lookup(tokens, k, 3, 2) if index is None else index.lookup(tokens, k)
        if found:
            proposals[stream] = (found, len(tokens), reads_q)
    if not proposals:
        return {}
    plan = planner.plan(list(proposals), alone=alone + len(candidates) - len(proposals),
                        caps={s: len(found) for s, (found, _, _) in proposals.items()})
    out = {}
    for s, (found, prefix_len, reads_q) in proposals.items():
        k = plan[s][0]
        if k:
            out[s] = point_mass_chain(found[:k], prefix_len, with_q=reads_q)
    return out
