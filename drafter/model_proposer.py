"""A draft model proposing chains (Leviathan et al. 2023; Chen et al. 2023) and
EAGLE-2 style trees (Li et al. 2024), with its own paged KV cache.

Cache layout of one sequence: the committed tokens the draft has seen (root
included), then the tree nodes of the current proposal (`_layout`). A forward
appends to the cache, and every cached token is visible to every new query, so
only nodes that are ancestors of the whole frontier may stay cached between
levels: a chain just appends, a branching tree re-feeds its frontier's
ancestors under the tree mask. After verification the accepted nodes that are
cached are compacted behind the prefix and the rest rolled back; whatever was
not cached is fed at the next proposal ("catch-up"), with the new root.

With a prefix-caching cache (`models.PagedKVCache(prefix_caching=True)`) a new sequence
starts on the longest cached prefix of its tokens (all but the root, which is always fed)
and each catch-up registers the full blocks of what it fed: a draft K/V is a function of the
tokens up to it, so a multi-turn conversation's draft starts from its cached history too.

A draft may carry a reduced LM head (`specflash_draft.json`: `logit_rows`):
logits are computed for those rows only and q is scattered into the full
vocabulary, zero elsewhere.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from speculation.proposal import DraftRequest
from drafter.tree_search import ROOT, TreeBuilder
from models.kv_cache import OutOfBlocks
from models import draft_chain
from models.linear import DRAFT_WEIGHTS, PackedWeight, use_draft_weights
from models.sampling import exponential, gumbel_noise, history_columns
from models.tree import TokenTree, ragged_tree_forward


class ModelProposer:
    chains_in_c = True   # greedy chains' levels below the root in one C call, where it runs the model

    def __init__(self, model, cache, spec_len: int, tree_width: int = 1, max_nodes: int | None = None,
                 logit_rows: Sequence[int] | None = None, vocab_size: int | None = None,
                 weights: str | None = DRAFT_WEIGHTS) -> None:
        self.model = model              # models.Transformer (the draft)
        if weights:                     # few-row CPU matmuls read int8 (or fp16) copies: less traffic
            use_draft_weights(model, weights)
        self.cache = cache              # models.PagedKVCache sized for it
        self.spec_len, self.tree_width = spec_len, tree_width
        self.max_nodes = max_nodes      # None = depth * width
        self.vocab_size = vocab_size or model.config.vocab_size
        device = model.embed_tokens.weight.device
        self.logit_rows = None if logit_rows is None else torch.tensor(list(logit_rows), device=device)
        # the reduced LM head, selected once: [V', hidden]
        self.lm_head = None if logit_rows is None else model.lm_head_weight.index_select(0, self.logit_rows)
        self._rows_cpu = None if logit_rows is None else self.logit_rows.cpu()   # what the builders index
        self._rows_ascending = None if logit_rows is None else torch.sort(self._rows_cpu.long())   # q's columns
        self.head_pack = PackedWeight(transposed_gemv=True, low=weights or None)   # built on first use
        if weights and self.lm_head is not None and self.lm_head.dtype == torch.float32 \
                and self.lm_head.device.type == "cpu":
            self.head_pack.round_to(self.lm_head, weights)     # the format's values, as the layers
        self._committed: dict[Hashable, int] = {}   # committed tokens whose K/V the draft cache holds
        self._layout: dict[Hashable, list[int]] = {}   # builder node ids cached after them, in order
        self._node_ids: dict[Hashable, list[int]] = {}   # tree node index -> builder node id
        self._tokens: dict[Hashable, list[int]] = {}     # the tokens of those committed K/V

    @torch.inference_mode()
    def propose(self, batch: Sequence[DraftRequest]) -> list[TokenTree]:
        depth = [min(self.spec_len, r.max_depth) for r in batch]
        live = [b for b, r in enumerate(batch) if depth[b] > 0]
        builders = {b: self._builder(batch[b], depth[b]) for b in live}
        reqs = [batch[b] for b in live]
        if self._chains_in_one_call(reqs, [builders[b] for b in live], [depth[b] for b in live]):
            self._draft_chains(reqs, [builders[b] for b in live], depth[live[0]] - 1)
        elif live:
            root_logits = self._catch_up(reqs)                                # n x [1, V] (V': a reduced head)
            for b, logits in zip(live, root_logits):
                builders[b].expand([ROOT], logits)
            self._grow(batch, live, depth, builders)
        trees = []
        for b, r in enumerate(batch):
            if b not in builders:
                trees.append(TokenTree.empty(len(r.token_ids), r.epoch))
                continue
            tree, node_ids = builders[b].finish(len(r.token_ids), r.epoch)
            self._node_ids[r.seq_id] = node_ids
            trees.append(tree)
        return trees

    def _grow(self, batch, live, depth, builders) -> None:
        """The levels below the root, one draft forward each over every tree's frontier."""
        for level in range(1, max(depth, default=0)):
            frontier = {b: builders[b].frontier(level, depth[b]) for b in live if level < depth[b]}
            frontier = {b: f for b, f in frontier.items() if f}
            if not frontier:
                break
            logits = self._forward_frontier({batch[b].seq_id: (builders[b], f) for b, f in frontier.items()})
            for b, node_logits in zip(frontier, logits):
                builders[b].expand(frontier[b], node_logits)

    def _chains_in_one_call(self, reqs: Sequence[DraftRequest], builders: list[TreeBuilder], depth: list[int]) -> bool:
        """Whether the whole pass goes to one C call (`models.draft_chain`): chains of one depth,
        greedy or sampled, without a grammar (`draft_chain.draws`), of sequences the draft has
        seen, 16 catch-up rows at most in all, and a model the call runs."""
        if not reqs or not self.chains_in_c or len(set(depth)) != 1:
            return False
        for r, builder in zip(reqs, builders):
            if builder.width != 1 or not draft_chain.draws(r.params) or r.seq_id not in self._committed:
                return False
        rows = [len(r.token_ids) - self._committed[r.seq_id] for r in reqs]   # the root at least
        return min(rows) >= 1 and draft_chain.applies(self.model, self.cache, len(reqs), sum(rows), depth[0] - 1)

    def _draft_chains(self, reqs: Sequence[DraftRequest], builders: list[TreeBuilder], levels: int) -> None:
        """The catch-up and `levels` levels below it in one call; the chain's nodes it fed are
        cached after the committed tokens, in order. A sampled node keeps the q its child was
        drawn from, as `TreeBuilder.expand` keeps it."""
        chains = self._chain_pass(reqs, levels, self._chain_sampling(reqs, builders, levels))
        for b, (r, builder, toks, lqs) in enumerate(zip(reqs, builders, chains.tokens.tolist(), chains.log_q.tolist())):
            for node, (token, token_log_q) in enumerate(zip(toks, lqs), start=ROOT):
                if not r.params.greedy:
                    builder.q_rows[node] = chains.q[b, node - ROOT]
                builder.add_children(node, [(token, token_log_q)])
            self._layout[r.seq_id] = list(range(levels))

    def _chain_sampling(self, reqs: Sequence[DraftRequest], builders: list[TreeBuilder],
                        levels: int) -> draft_chain.ChainSampling | None:
        """The temperatures and Gumbel noise of a pass with sampled chains or chains that read
        their history (None: all greedy, none reading), over the head's rows: a seeded request's
        noise is its seed's at each depth's output position (`models.sampling.coupled_scores`),
        another's drawn from its generator as `TreeBuilder.expand` draws it, one level after
        the other; each chain's cut, and its history as `models.sampling.history_columns`."""
        if all(r.params.greedy and not r.params.reads_history for r in reqs):
            return None
        head = self.model.lm_head_weight if self.lm_head is None else self.lm_head
        noise = torch.zeros(len(reqs), levels + 1, head.shape[0])
        for b, (r, builder) in enumerate(zip(reqs, builders)):
            if r.params.coupled:
                start = builder.output_position(ROOT)
                noise[b] = gumbel_noise(r.params.seed, range(start, start + levels + 1), head.shape[0], self._rows_cpu)
            elif not r.params.greedy:
                noise[b] = -exponential((levels + 1, head.shape[0]), r.generator).log()
        temps = torch.tensor([r.params.temperature for r in reqs], dtype=torch.float32)
        history = None
        if any(r.params.reads_history for r in reqs):
            history = [history_columns(r.params, r.token_ids, self._rows_cpu, self.vocab_size) for r in reqs]
        cuts = [(r.params.min_p, r.params.top_k, r.params.top_p) for r in reqs]
        if all(cut == (0, 0, 1) for cut in cuts):
            return draft_chain.ChainSampling(temps, noise, history=history)
        min_p, top_k, top_p = zip(*cuts)
        return draft_chain.ChainSampling(temps, noise, torch.tensor(min_p, dtype=torch.float32),
                                         torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32), history)

    def _chain_pass(self, reqs: Sequence[DraftRequest], levels: int,
                    sampling: draft_chain.ChainSampling | None) -> draft_chain.DraftChains:
        """`_draft_chains`' call: the catch-up's rows, then the pass (node d's token at column d + 1)."""
        ids = self._catch_up_rows(reqs)[0]
        chains = draft_chain.run_chains(self.model, self.cache, [r.seq_id for r in reqs], ids, levels,
                                        self.lm_head, self.head_pack, self._rows_cpu, sampling=sampling)
        self._cache_prefixes(reqs)
        return chains

    def _builder(self, r: DraftRequest, depth: int) -> TreeBuilder:
        width = r.tree_width or self.tree_width
        max_nodes = self.max_nodes or depth * width
        return TreeBuilder(r.params, r.generator, width, max_nodes, self.vocab_size, r.token_ids, self._rows_cpu,
                           self._rows_ascending)

    def on_verified(self, seq_id: Hashable, tree: TokenTree, accepted_nodes: Sequence[int]) -> None:
        """Compact the cached part of the accepted path behind the prefix; drop the rest."""
        if seq_id not in self._committed:
            return
        base, layout = self._committed[seq_id], self._layout[seq_id]
        node_ids = self._node_ids.get(seq_id, [])
        offsets = []
        for node in accepted_nodes:
            builder_id = node_ids[node]
            if builder_id not in layout:
                break
            offsets.append(layout.index(builder_id))
        self.cache.compact(seq_id, base, offsets)
        self._committed[seq_id] = base + len(offsets)
        self._layout[seq_id] = []
        kept = tree.token_ids[list(accepted_nodes[:len(offsets)])].tolist()
        self._tokens[seq_id] = self._tokens[seq_id][:base] + kept

    def rollback(self, seq_id: Hashable, prefix_len: int) -> None:
        """Forget everything past the first `prefix_len` committed tokens (epoch change)."""
        if seq_id in self._committed:
            keep = min(self._committed[seq_id], prefix_len)
            self.cache.truncate(seq_id, keep)
            self._committed[seq_id], self._layout[seq_id] = keep, []
            del self._tokens[seq_id][keep:]

    def release(self, seq_id: Hashable) -> None:
        self.cache.free(seq_id)
        for state in (self._committed, self._layout, self._node_ids, self._tokens):
            state.pop(seq_id, None)

    @torch.inference_mode()
    def cache_committed(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """A finished sequence's whole committed tokens: leave cached the full blocks of all but
        the last (the target's cache holds as many), feeding the tokens the draft has not seen
        when that completes a block (one forward of a few rows), so the next turn's draft finds
        its history cached as the target does. A no-op without prefix caching."""
        held = self._tokens.get(seq_id)
        if held is None or not self.cache.prefix_caching:
            return
        bs, keep = self.cache.block_size, 0
        while keep < min(len(held), len(token_ids)) and held[keep] == token_ids[keep]:
            keep += 1                       # past it the draft held assumed tokens, not committed ones
        need = (len(token_ids) - 1) // bs * bs
        if need // bs > keep // bs:
            self.cache.truncate(seq_id, keep)
            self._committed[seq_id], self._layout[seq_id], self._tokens[seq_id] = keep, [], held[:keep]
            ids = torch.tensor(list(token_ids[keep:need]), dtype=torch.long)
            n = need - keep
            try:
                ragged_tree_forward(self.model, self.cache, [seq_id], [ids], [torch.arange(keep, need)],
                                    [torch.ones(n, n, dtype=torch.bool).tril()], [torch.tensor([n - 1])],
                                    lm_head=self.lm_head, head_pack=self.head_pack)
                self._committed[seq_id], self._tokens[seq_id], keep = need, list(token_ids[:need]), need
            except OutOfBlocks:             # no room to complete them: cache what is there
                pass
        self.cache.cache_prefix(seq_id, list(token_ids[:min(keep, len(token_ids) - 1)]))

    def _catch_up(self, batch: Sequence[DraftRequest]) -> list[torch.Tensor]:   # n x [1, V] (V': a reduced head)
        """Feed the committed tokens the draft has not seen (root last); q after the root."""
        ids, positions, masks, last = self._catch_up_rows(batch)
        logits = self._forward([r.seq_id for r in batch], ids, positions, masks, last)
        self._cache_prefixes(batch)
        return logits

    def _cache_prefixes(self, batch: Sequence[DraftRequest]) -> None:
        """After a catch-up: its sequences' full blocks, now written, go into the prefix cache."""
        for r in batch:
            self.cache.cache_prefix(r.seq_id, r.token_ids)

    def _catch_up_rows(self, batch: Sequence[DraftRequest]):
        """Per sequence: the committed tokens not yet fed, their positions and causal mask, and
        the index of the root among them; the draft now counts them as seen."""
        ids, positions, masks = [], [], []
        for r in batch:
            if r.seq_id not in self._committed:     # the root is always fed: q after it
                self._committed[r.seq_id] = self.cache.add_sequence(r.seq_id, list(r.token_ids[:-1]))
            seen = self._committed[r.seq_id]
            self.cache.truncate(r.seq_id, seen)                 # a stale layout, if any
            n = len(r.token_ids) - seen
            ids.append(torch.tensor(list(r.token_ids[seen:]), dtype=torch.long))
            positions.append(torch.arange(seen, seen + n))
            masks.append(torch.ones(n, n, dtype=torch.bool).tril())
            self._committed[r.seq_id], self._layout[r.seq_id] = len(r.token_ids), []
            self._tokens[r.seq_id] = list(r.token_ids)
        return ids, positions, masks, [torch.tensor([m.shape[0] - 1]) for m in masks]

    def _forward_frontier(self, work: dict[Hashable, tuple[TreeBuilder, list[int]]]) -> list[torch.Tensor]:
        """One draft forward over the frontier of every tree (plus uncached ancestors)."""
        rows = self._frontier_rows(work)
        return self._forward(*rows[:5])

    def _frontier_rows(self, work: dict[Hashable, tuple[TreeBuilder, list[int]]]):
        """Lay out each tree's frontier behind the cached part of its lineage.

        Returns per-sequence lists (seq_ids, ids, positions, masks, picks, new): the
        nodes to feed (`new`, builder ids in feeding order) with their tokens, RoPE
        positions and tree mask, and where the frontier nodes sit among them.
        """
        seq_ids, ids, positions, masks, picks, news = [], [], [], [], [], []
        for seq_id, (builder, frontier) in work.items():
            lineage = [set(builder.ancestors(f)) for f in frontier]
            common = set.intersection(*lineage)
            layout = self._layout[seq_id]
            keep = 0
            while keep < len(layout) and layout[keep] in common:
                keep += 1
            base = self._committed[seq_id]
            self.cache.truncate(seq_id, base + keep)
            new = sorted((set.union(*lineage) | set(frontier)) - set(layout[:keep]))
            self._layout[seq_id] = layout[:keep] + new
            seq_ids.append(seq_id)
            ids.append(torch.tensor([builder.token_ids[i] for i in new], dtype=torch.long))
            positions.append(torch.tensor([base - 1 + builder.depths[i] for i in new], dtype=torch.long))
            masks.append(torch.tensor([[j == i or j in builder.ancestors(i) for j in new] for i in new],
                                      dtype=torch.bool).reshape(len(new), len(new)))
            picks.append(torch.tensor([new.index(f) for f in frontier], dtype=torch.long))
            news.append(new)
        return seq_ids, ids, positions, masks, picks, news

    def _forward(self, seq_ids, ids, positions, masks, picks) -> list[torch.Tensor]:
        """Draft logits at the picked positions: B x [L, V'] over the reduced head's rows (the
        builders know them), B x [L, V] without one."""
        logits = ragged_tree_forward(self.model, self.cache, seq_ids, ids, positions, masks, picks,
                                     lm_head=self.lm_head, head_pack=self.head_pack)
        return [x.cpu() for x in logits]
