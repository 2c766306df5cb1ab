"""BENCHMARK ONLY: a drafter with a controlled acceptance rate (bench/gpu_e2e.py).

Real large checkpoints are not available where the GPU benchmark runs, and a random draft
agrees with a random target about never. `CorruptedReplayProposer` fixes that for
measurement: it runs a real draft-shaped model (`drafter.ModelProposer`, or an EAGLE-style
head, `drafter.EagleProposer`, fed the target's features as in the product) so drafting costs
what it would, then overwrites the chain it drafted with the target's own recorded greedy
continuation of the prompt, each token replaced by a random other token with probability
`corruption`. Greedy verification then accepts each token with probability about
`1 - corruption` (numerical near-ties of random weights aside), so the speedup can be
measured against a chosen acceptance.

It is injected, never built by the product: `build_pipeline_engine(..., wrap_proposer=
ReplayWrap())` hands each drafter actor the wrapper, which wraps its draft model's proposer,
and the benchmark steers it through `DrafterActor.call_proposer("set_references" |
"set_corruption", ...)`. Exactness is untouched: whatever the drafter proposes, the verifier
commits only what the target itself would.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class ReplayWrap:
    """What a drafter actor applies to its draft proposer (picklable: it crosses to the actor)."""

    def __init__(self, corruption: float = 0.0, seed: int = 0) -> None:
        self.corruption, self.seed = corruption, seed

    def __call__(self, inner) -> "CorruptedReplayProposer":
        return CorruptedReplayProposer(inner, [], self.corruption, inner.vocab_size, self.seed)


class CorruptedReplayProposer:
    """BENCHMARK ONLY. A ModelProposer whose chains are replaced by the target's recorded
    greedy continuation, each token corrupted with probability `corruption`."""

    def __init__(self, inner, references: Sequence[Sequence[int]], corruption: float, vocab_size: int,
                 seed: int = 0) -> None:
        self.inner = inner                  # drafter.ModelProposer: pays the real drafting cost
        self.references = [list(r) for r in references]   # prompt + recorded greedy continuation
        self.corruption = corruption
        self.vocab_size = vocab_size
        self.rng = torch.Generator().manual_seed(seed)

    def set_references(self, references: list[list[int]]) -> None:
        """The recorded target continuations (prompt + greedy output) to replay."""
        self.references = [list(r) for r in references]

    def set_corruption(self, corruption: float) -> None:
        self.corruption = corruption

    @property
    def cache(self):
        return self.inner.cache

    @property
    def needs_features(self) -> bool:
        """An EAGLE head's proposer: the drafter passes it the target's features."""
        return bool(getattr(self.inner, "needs_features", False))

    def observe_features(self, seq_id, start: int, features) -> None:
        self.inner.observe_features(seq_id, start, features)

    @property
    def model(self):
        return self.inner.model

    def propose(self, batch):
        trees = self.inner.propose(batch)
        return [self._replay(r.token_ids, t) for r, t in zip(batch, trees)]

    def _replay(self, prefix: Sequence[int], tree):
        """Overwrite the first chain of `tree` with the (corrupted) recorded continuation."""
        n = len(prefix)
        ref = next((r for r in self.references if len(r) > n and r[:n] == list(prefix)), None)
        if ref is None or tree.num_nodes == 0:
            return tree
        tokens = tree.token_ids.clone()
        node, depth = -1, 0
        parents = tree.parent_ids.tolist()
        for i, p in enumerate(parents):          # the first-child chain from the root
            if p == node and n + depth < len(ref):
                token = ref[n + depth]
                if float(torch.rand(1, generator=self.rng)) < self.corruption:
                    token = (token + 1 + int(torch.randint(self.vocab_size - 1, (1,), generator=self.rng))) \
                        % self.vocab_size
                tokens[i] = token
                node, depth = i, depth + 1
        from models.tree import TokenTree

        return TokenTree(tokens, tree.parent_ids, tree.depths, tree.draft_probs, tree.prefix_len, tree.epoch,
                         tree.draft_columns)

    def on_verified(self, seq_id, tree, accepted_nodes) -> None:
        # the draft's K/V were computed for its own tokens, not the replayed ones: drop them, so the
        # next proposal re-feeds the committed tokens (cost stays that of a real draft catch-up)
        self.inner.on_verified(seq_id, tree, [])

    def rollback(self, seq_id, prefix_len: int) -> None:
        self.inner.rollback(seq_id, prefix_len)

    def release(self, seq_id) -> None:
        self.inner.release(seq_id)
