"""What every proposer receives and must do (DESIGN.md §2-§3).

A proposer turns the committed tokens of a sequence into a `TokenTree` whose
nodes carry the draft distributions they were drawn from, and keeps whatever
state it has (a draft KV cache) in step with the verifier's accept / rollback
signal. Proposers here: `ModelProposer` (a draft model: chains and EAGLE-2
trees) and `NgramProposer` (prompt lookup decoding).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.sampling import SamplingParams
from models.tree import TokenTree


@dataclass
class DraftRequest:
    seq_id: Hashable
    token_ids: Sequence[int]        # committed tokens, prompt + output; the last one is the root
    params: SamplingParams
    generator: torch.Generator      # per request, shared with the verifier's draws
    max_depth: int                  # deepest node worth drafting (tokens left to generate - 1)
    epoch: int = 0
    tree_width: int | None = None   # per-request override of the proposer's width


class Proposer(Protocol):
    def propose(self, batch: Sequence[DraftRequest]) -> list[TokenTree]: ...

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        """The verifier accepted `accepted_nodes` of `tree`: keep their state, drop the rest."""

    def release(self, seq_id: Hashable) -> None:
        """The sequence is finished: free its state."""


def point_mass_rows(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:   # -> [K+1, V]
    """Draft probabilities of a deterministic chain: row i is one-hot at token i, the last row 0."""
    rows = torch.zeros(len(token_ids) + 1, vocab_size)
    if len(token_ids):
        rows[torch.arange(len(token_ids)), torch.tensor(list(token_ids))] = 1.0
    return rows
