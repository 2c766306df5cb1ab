"""Drafting with a feature-conditioned draft head (EAGLE, Li et al. 2024; `models.eagle`).

Like `ModelProposer` (chains and EAGLE-2 trees, the same `TreeBuilder`), but every
draft input row carries a feature next to its token: a committed token j reads the
target's true feature f_{j-1}, which the verifier returned (`observe_features`);
a tree node reads the draft's own predicted feature at its parent (the root's
prediction comes from the catch-up). The draft K/V of tree nodes were computed
from predicted features, so after verification they are dropped, not compacted:
the accepted tokens are fed again with the target's true features at the next
catch-up (one draft forward of a few rows, as EAGLE does).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from speculation.proposal import DraftRequest
from drafter.model_proposer import ModelProposer
from drafter.tree_search import ROOT, TreeBuilder
from models import draft_chain
from models.tree import TokenTree, ragged_tree_forward


class MissingFeaturesError(RuntimeError):
    """The target's features of some committed tokens never reached the proposer."""


class EagleProposer(ModelProposer):
    needs_features = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._features: dict[Hashable, torch.Tensor] = {}   # target features of committed positions
        self._pred: dict[Hashable, dict[int, torch.Tensor]] = {}   # builder node -> predicted feature

    def observe_features(self, seq_id: Hashable, start: int, features: torch.Tensor) -> None:
        """The target's final-norm hidden states at positions start, start+1, ... [n, hidden]
        (a fused head's: [n, (k + 1) hidden], fused here as they arrive: `EagleDraft.fuse_features`)."""
        with torch.inference_mode():
            features = self.model.fuse_features(features.to(self.model.fc.weight.device)).float().cpu()
        known = self._features.get(seq_id)
        width = self.model.config.hidden_size
        known = torch.zeros(0, width) if known is None else known
        if start > known.shape[0]:
            raise MissingFeaturesError(f"features of {seq_id!r} from position {start}, but only "
                                       f"{known.shape[0]} are known")
        self._features[seq_id] = torch.cat([known[:start], features])

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        """Drop the tree's draft K/V (they read predicted features); the accepted tokens are
        fed again, with the target's features, at the next catch-up.

        Until the target's features of the accepted positions arrive (`observe_features`
        overwrites them), the head's own predictions stand in: the root's and each accepted
        node's output, the features a tree drafted ahead on an assumed outcome reads
        (drafter/draft_side.py; the pipeline's overlap)."""
        if seq_id in self._committed:
            self.cache.truncate(seq_id, self._committed[seq_id])
            self._layout[seq_id] = []
        pred, node_ids = self._pred.pop(seq_id, None), self._node_ids.get(seq_id, [])
        known = self._features.get(seq_id)
        if pred is None or known is None or known.shape[0] != self._committed.get(seq_id, 0) - 1:
            return                      # predictions only extend the target's own, never replace them
        ids = [ROOT] + [node_ids[a] for a in accepted_nodes]
        if all(i in pred for i in ids):
            self._features[seq_id] = torch.cat([known, torch.stack([pred[i] for i in ids])])

    def rollback(self, seq_id: Hashable, prefix_len: int) -> None:
        super().rollback(seq_id, prefix_len)
        if seq_id in self._features:
            self._features[seq_id] = self._features[seq_id][: max(prefix_len - 1, 0)]
        self._pred.pop(seq_id, None)

    def release(self, seq_id: Hashable) -> None:
        super().release(seq_id)
        self._features.pop(seq_id, None)
        self._pred.pop(seq_id, None)

    # -- forwards -----------------------------------------------------------------------
    def _catch_up(self, batch: Sequence[DraftRequest]) -> list[torch.Tensor]:   # n x [1, V] (V': a reduced head)
        ids, positions, masks, last, feats = self._catch_up_features(batch)
        logits, hidden = self._forward_with_features([r.seq_id for r in batch], ids, positions, masks, last, feats)
        for r, h in zip(batch, hidden):
            self._pred[r.seq_id] = {ROOT: h[-1]}
        return logits      # no prefix caching: the K/V read features (drafter.draft_side.model_proposer)

    def _chain_pass(self, reqs: Sequence[DraftRequest], levels: int,
                    sampling: draft_chain.ChainSampling | None) -> draft_chain.DraftChains:
        """The one-call pass (`ModelProposer._draft_chains`) with the catch-up's features; each
        node's final-norm state is kept as its predicted feature, as `_forward_frontier` keeps it."""
        ids, _, _, _, feats = self._catch_up_features(reqs)
        chains = draft_chain.run_chains(self.model, self.cache, [r.seq_id for r in reqs], ids, levels,
                                        self.lm_head, self.head_pack, self._rows_cpu, features=feats, sampling=sampling)
        for r, states in zip(reqs, chains.features):       # [levels + 1, H]: the root's, then node d's
            self._pred[r.seq_id] = {node: states[node - ROOT] for node in range(ROOT, levels)}
        return chains

    def _catch_up_features(self, batch: Sequence[DraftRequest]):
        """`_catch_up_rows`, and each sequence's row features: committed token j reads the
        target's f_{j-1} (position 0 reads zeros). Checked before any state changes."""
        width = self.model.config.hidden_size
        prev = []                                   # per sequence: f_{j-1} for j = 0..n-1
        for r in batch:
            n = len(r.token_ids)
            known = self._features.get(r.seq_id, torch.zeros(0, width))
            if known.shape[0] < n - 1:
                raise MissingFeaturesError(
                    f"sequence {r.seq_id!r} has {n} committed tokens but the target's features of only "
                    f"{known.shape[0]} (the verifier must run with features=True and the engine pass them on)")
            prev.append(torch.cat([torch.zeros(1, width), known[: n - 1]]))
        ids, positions, masks, last = self._catch_up_rows(batch)
        feats = [p[int(pos[0]):] if len(pos) else p[:0] for p, pos in zip(prev, positions)]
        return ids, positions, masks, last, feats

    def _forward_frontier(self, work: dict[Hashable, tuple[TreeBuilder, list[int]]]) -> list[torch.Tensor]:
        seq_ids, ids, positions, masks, picks, news = self._frontier_rows(work)
        # each node reads the prediction at its parent (made by an earlier level's forward)
        feats = [torch.stack([self._pred[seq_id][work[seq_id][0].parent_ids[i]] for i in new])
                 for seq_id, new in zip(seq_ids, news)]
        logits, hidden = self._forward_with_features(seq_ids, ids, positions, masks, picks, feats)
        for seq_id, new, h in zip(seq_ids, news, hidden):
            self._pred[seq_id].update({node: h[k] for k, node in enumerate(new)})
        return logits

    def _forward_with_features(self, seq_ids, ids, positions, masks, picks, feats):
        logits, hidden = ragged_tree_forward(self.model, self.cache, seq_ids, ids, positions, masks, picks,
                                             lm_head=self.lm_head, head_pack=self.head_pack, features=feats,
                                             return_hidden=True)
        return [x.cpu() for x in logits], [h.float().cpu() for h in hidden]
