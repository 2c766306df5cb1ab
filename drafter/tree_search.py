"""Growing one draft token tree level by level, EAGLE-2 style (Li et al. 2024).

Each node is scored by its draft confidence, the cumulative log-probability of
its path. At each depth the `width` best-scoring nodes are expanded (one draft
forward per level over all of them, done by the caller), each into `width`
children:

- greedy: the top-`width` tokens of the draft's q;
- sampling: `width` tokens drawn from q *without replacement* (Gumbel-top-k,
  Kool et al. 2019), kept in draw order, so that multi-step speculative
  sampling (SpecInfer; Sequoia, Chen et al. 2024) stays exact; for a seeded
  request the Gumbel noise is the target's own at the children's output
  position (`models.sampling.coupled_scores`), so the draft proposes the top-w
  tokens under the perturbation the verifier will take its token from.

Every node's q goes through the same transforms as the verifier's p of that node
(`models.sampling.process_logits` over the committed tokens plus the node's path, then
`logits_to_probs`), so penalties and biases cost no acceptance.

Greedy trees are reranked at the end: the `max_nodes` best-scoring nodes are
kept (a child never outscores its parent, so the kept set is a tree).
Sampled trees are never pruned by value, which would bias the children a
verifier sees; their node budget is spread over the levels as they are
expanded, each node's number of children fixed before its children are drawn.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from models.sampling import (SamplingParams, TokenHistory, coupled_scores, exponential, logits_to_probs,
                             process_logits)
from models.tree import TokenTree, row_paths

ROOT = -1


class TreeBuilder:
    def __init__(self, params: SamplingParams, generator: torch.Generator, width: int,
                 max_nodes: int, vocab_size: int, committed: Sequence[int] = (),
                 rows: torch.Tensor | None = None,
                 ascending: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.params, self.generator = params, generator
        self.committed = committed                       # prompt + output, root last
        self.width, self.max_nodes, self.vocab_size = width, max_nodes, vocab_size
        self.rows = rows                                 # [V'] token ids of a reduced head's logits, or None
        self.ascending = ascending                       # torch.sort(rows) (values, indices): the proposer's,
        #                                                  sorted once; None: sorted here where needed
        self.token_ids: list[int] = []
        self.parent_ids: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []                    # cumulative draft log-probability
        self.q_rows: dict[int, torch.Tensor] = {}        # node (ROOT = -1) -> [V] q its children came from
        #                                                  ([V'] over `rows`)

    def output_position(self, node: int) -> int:
        """The output position (0 = the first generated token) of `node`'s children."""
        return len(self.committed) - self.params.prompt_len + self.depth_of(node)

    def depth_of(self, node: int) -> int:
        return 0 if node == ROOT else self.depths[node]

    def score_of(self, node: int) -> float:
        return 0.0 if node == ROOT else self.scores[node]

    def ancestors(self, node: int) -> list[int]:
        """Proper ancestors of `node`, excluding the root, nearest first."""
        out, node = [], self.parent_ids[node]
        while node != ROOT:
            out.append(node)
            node = self.parent_ids[node]
        return out

    def expand(self, nodes: list[int], draft_logits: torch.Tensor) -> None:   # [n, V], or [n, V'] over `rows`
        """Give each node its children, drawn from the draft distribution after it.

        Over a reduced head's rows a tree is grown on those logits alone: every other token's q
        is 0, so its top tokens, its draws and its log-probabilities are the same, and a sampled
        node's q is kept over the rows (`finish` scatters it into the vocabulary). The
        transforms that read the history are each token's own: they apply to the rows alone."""
        rows = self.rows
        if self.params.reads_history:
            paths = row_paths(self.parent_ids, self.token_ids)
            history = TokenHistory(self.committed, [paths[node + 1] for node in nodes], draft=True)
            draft_logits = process_logits(draft_logits, self.params, history, rows)
        if self.params.greedy:                                   # every node's top tokens at once
            log_q = torch.log_softmax(draft_logits.float(), -1)     # [n, V or V']
            k = min(self.width, log_q.shape[-1])
            values, indices = log_q.max(-1, keepdim=True) if k == 1 else log_q.topk(k)   # [n, k]
            tokens = indices if rows is None else rows[indices]     # token ids
            for node, children, child_log_q in zip(nodes, tokens.tolist(), values.tolist()):
                kept = [(t, v) for t, v in zip(children, child_log_q) if v > float("-inf")]   # a grammar's mask
                self.add_children(node, kept)
            return
        q = logits_to_probs(draft_logits, self.params)                         # [n, V or V'], as p will be
        log_q = q.log()
        if self.params.coupled:    # the target's own noise at the children's positions
            perturbed = coupled_scores(q, self.params, [self.output_position(node) for node in nodes], rows,
                                       top=self.width)
        else:
            perturbed = log_q - exponential(q.shape, self.generator).to(q.device).log()
        support = (q > 0).sum(-1).tolist()
        for i, node in enumerate(nodes):
            self.q_rows[node] = q[i]
            k = min(self.width, support[i], self.max_nodes - len(self.token_ids))   # fixed before the draw
            if k <= 0:
                continue
            children = perturbed[i].topk(k).indices                                  # draw order
            tokens = children if rows is None else rows[children]
            self.add_children(node, list(zip(tokens.tolist(), log_q[i, children].tolist())))

    def add_children(self, node: int, children: list[tuple[int, float]]) -> None:
        """Children of `node`, in order: (token id, its log q) each."""
        depth, score = self.depth_of(node) + 1, self.score_of(node)
        for token, token_log_q in children:
            self.token_ids.append(token)
            self.parent_ids.append(node)
            self.depths.append(depth)
            self.scores.append(score + token_log_q)

    def frontier(self, depth: int, max_depth: int) -> list[int]:
        """The nodes at `depth` to expand next, most confident first.

        Greedy: the `width` best (EAGLE-2; the rerank trims later). Sampling: as many
        as leave budget for the levels below, at least one: the budget left is
        split evenly over the remaining levels.
        """
        count = self.width
        if not self.params.greedy:
            budget = self.max_nodes - len(self.token_ids)
            if budget <= 0:
                return []
            count = min(self.width, max(1, budget // ((max_depth - depth) * self.width)))
        level = [i for i, d in enumerate(self.depths) if d == depth]
        level.sort(key=lambda i: -self.scores[i])
        return sorted(level[:count])

    def finish(self, prefix_len: int, epoch: int) -> tuple[TokenTree, list[int]]:
        """The tree, and for each of its nodes the builder's node id."""
        kept = list(range(len(self.token_ids)))
        if self.params.greedy and len(kept) > self.max_nodes:
            # EAGLE-2 rerank: keep the most confident nodes; ties go to the shallower node
            kept.sort(key=lambda i: (-self.scores[i], self.depths[i], i))
            kept = sorted(kept[: self.max_nodes], key=lambda i: (self.depths[i], i))
        new_index = {old: new for new, old in enumerate(kept)}
        new_index[ROOT] = ROOT
        draft_probs = columns = None
        if self.params.reads_q:                                  # a walk reads no q: none to ship
            draft_probs, columns = self._q_matrix(len(kept), new_index)
        tree = TokenTree(
            torch.tensor([self.token_ids[i] for i in kept], dtype=torch.long),
            torch.tensor([new_index[self.parent_ids[i]] for i in kept], dtype=torch.long),
            torch.tensor([self.depths[i] for i in kept], dtype=torch.long),
            draft_probs, prefix_len, epoch, columns,
        )
        return tree, kept

    def _q_matrix(self, nodes: int, new_index: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kept nodes' q rows (row 0 the root's) [nodes + 1, V], or, with a reduced head,
        over its rows alone [nodes + 1, V'] with those token ids ascending [V'] (a sixth of the
        bytes to ship at 8K of 49K; q is 0 off them). `expand` keeps q over `rows` whenever they
        are given, even where they span the whole vocabulary in the head's own order."""
        if self.rows is None:
            columns, order = None, None
            draft_probs = torch.zeros(nodes + 1, self.vocab_size)
        else:
            columns, order = self.ascending if self.ascending is not None else torch.sort(self.rows.long())
            draft_probs = torch.zeros(nodes + 1, columns.shape[0])
        for node, q in self.q_rows.items():
            if node in new_index:
                draft_probs[new_index[node] + 1] = q if order is None else q[order]
        return draft_probs, columns
