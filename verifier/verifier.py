"""Tree verification against the target model (DESIGN.md §3-§4).

The target cache holds every committed token but the last (the root). One
target forward over [root] + tree nodes, under the tree mask, yields the T+1
target distributions: after the root (row 0) and after each node (row i+1).
Rejection sampling (`kernels.rejection_sample` on CUDA, its torch reference
`kernels.ref.rejection_sample` on the CPU; for greedy requests its greedy case
on each row's argmax, `greedy_walk`) picks the accepted path and one
more token; the
accepted path's K/V are compacted behind the prefix and the rest rolled back.

Exact for greedy decoding and for sampling: chains follow Leviathan et al.
2023 / Chen et al. 2023, trees SpecInfer (Miao et al. 2023) with children
drawn without replacement (Sequoia, Chen et al. 2024). A seeded sampled request is
verified by coupling instead (Daliri, Musco and Suresh): the target's token at output
position t is argmax(log p + G_t), G_t Gumbel noise keyed by (seed, t), and a node is
accepted when it is that token, so the output is a function of the seed alone, whatever
drafted it (`models.sampling.coupled_scores`). Temperature, top-k and
top-p are applied to p here exactly as the drafter applied them to q
(`models.sampling.logits_to_probs`), and so are the transforms that read the tokens
before a row (penalties, `logit_bias`, `min_tokens`: `models.sampling.process_logits`),
each node's row over the committed tokens plus its own path.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from models.kv_cache import chain_hash
from models.sampling import (SamplingParams, TokenHistory, coupled_scores, exponential, logits_to_probs,
                             process_logits, token_logprobs)
from models.tree import TokenTree, ragged_tree_forward


def rejection_sample(draft_token_ids, *args):
    """The one switch: the Triton sampler on CUDA, the bit-identical torch reference elsewhere."""
    if draft_token_ids.is_cuda:
        from kernels import rejection_sample as sample   # Triton; lazy on purpose
    else:
        from kernels.ref import rejection_sample as sample
    return sample(draft_token_ids, *args)


def greedy_walk(parents: Sequence[int], tokens: Sequence[int], best: Sequence[int]) -> tuple[list[int], int]:
    """The rejection sampler's greedy case on the host: from the root, accept the first child
    whose token is the target's argmax after its parent (`best[u + 1]`, row 0 = after the
    root); stop where none is; the next token is the argmax there. Returns (accepted node
    indices, next token): what `kernels.rejection_sample` gives with one-hot target probs."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path, u = [], -1
    while True:
        want = best[u + 1]
        child = next((i for i in children.get(u, ()) if tokens[i] == want), None)
        if child is None:
            return path, int(want)
        path.append(child)
        u = child


class StaleTreeError(ValueError):
    """A tree drafted for another prefix than the committed one (DESIGN.md §3)."""


@dataclass
class VerifyRequest:
    seq_id: Hashable
    root_token_id: int              # the last committed token, not yet in the target cache
    tree: TokenTree
    params: SamplingParams
    generator: torch.Generator      # per request: reproducible uniform / exp_noise draws
    committed: Sequence[int] = ()   # prompt + output, root last: what penalties read (params.reads_history)


@dataclass
class PromptChunk:
    """A prompt's next tokens to prefill (all of them, or a chunk of a chunked prefill)."""

    seq_id: Hashable
    prompt: Sequence[int]           # the whole prompt; all but its last token are prefilled
    use_cache: bool = True          # start on (and leave) cached prefix blocks
    limit: int | None = None        # feed at most this many tokens now (None: the rest)
    at: int = 0                     # filled in: the sequence's length before this chunk
    ids: list[int] | None = None    # filled in: the tokens fed now
    hidden: torch.Tensor | None = None   # filled in, with features: their hidden states [n, feature_width]


@dataclass
class VerifyResult:
    accepted_nodes: list[int]       # accepted path as node indices, root to leaf
    token_ids: list[int]            # tokens of that path + next_token_id
    next_token_id: int              # bonus token (whole path accepted) or the correction
    num_drafted: int                # T
    # with `Verifier(features=True)`: the target's final-norm hidden states at the root and the
    # accepted nodes [1 + num_accepted, feature_width], the input a feature-conditioned draft reads
    features: torch.Tensor | None = None
    # with `params.logprobs` set: one models.sampling.TokenLogprob per token of `token_ids`
    logprobs: list | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


class Verifier:
    def __init__(self, model, cache, features: bool = False, feature_layers: tuple[int, ...] = ()) -> None:
        self.model = model      # models.Transformer (the target)
        self.cache = cache      # models.PagedKVCache sized for it
        self.features = features   # return the target's hidden states (for an EAGLE draft)
        # with them, the outputs of these target layers (a fused EAGLE head's), set on the model
        # before each of this verifier's forwards: engines in one process may share the target
        self.feature_layers = tuple(feature_layers) if features else ()
        model.set_feature_layers(self.feature_layers)
        # prompt tokens each sequence found in the prefix cache at its prefill (models.PagedKVCache
        # with prefix_caching), and the sequences that opted out of it
        self.cached_tokens: dict[Hashable, int] = {}
        self._uncached: set[Hashable] = set()
        # with features and a prefix cache: the target's hidden states of each cached block (by
        # its chain key) and of each sequence's cached positions so far, so that a sequence
        # starting on cached blocks gets their features too (an EAGLE head reads them)
        self._block_features: dict[bytes, torch.Tensor] = {}     # key -> [block_size, hidden]
        self._seq_features: dict[Hashable, list[torch.Tensor]] = {}

    def _own_feature_layers(self) -> None:
        if self.model.feature_layers != self.feature_layers:
            self.model.set_feature_layers(self.feature_layers)

    def prefill(self, seq_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Cache every prompt token but the last: the last one is the first tree's root."""
        self.prefill_batch([seq_id], [prompt_ids])

    @torch.inference_mode()
    def prefill_batch(self, seq_ids: Sequence[Hashable], prompts: Sequence[Sequence[int]],
                      max_rows: int = 64, use_cache: Sequence[bool] | None = None, limit: int | None = None
                      ) -> dict[Hashable, torch.Tensor] | None:
        """`prefill` for many sequences, `max_rows` prompts per target forward. With a prefix
        cache, each starts on the longest cached prefix of its prompt (`cached_tokens`) and
        feeds the rest, then registers its full blocks; `use_cache[i]` False opts sequence i
        out of both. `limit`: feed at most this many tokens of each (a chunk of a chunked
        prefill): a sequence already in the cache goes on from where it stands.

        With `features`, returns each sequence's hidden states over the prompt tokens fed
        now (all but the last, when whole) [n, hidden] (the target's cache then has no
        prefix caching: `verifier.target.TargetSide`).
        """
        chunks = [PromptChunk(s, p, True if use_cache is None else use_cache[i], limit)
                  for i, (s, p) in enumerate(zip(seq_ids, prompts))]
        self.feed_chunks(chunks, max_rows)
        return {c.seq_id: c.hidden for c in chunks} if self.features else None

    @torch.inference_mode()
    def feed_chunks(self, chunks: Sequence["PromptChunk"], max_rows: int = 64) -> None:
        """`prefill_batch` on `PromptChunk`s, each filled in (`at`, `ids`, `hidden`)."""
        todo = self._start_chunks(chunks)
        todo.sort(key=lambda c: len(c.ids))                   # similar lengths pad less
        for i in range(0, len(todo), max_rows):
            part = todo[i:i + max_rows]
            self._own_feature_layers()
            out = ragged_tree_forward(self.model, self.cache, [c.seq_id for c in part],
                                      *self._chunk_inputs(part), return_hidden=self.features)
            if self.features:
                for c, h in zip(part, out[1]):
                    c.hidden = h.cpu()
        self._end_chunks(chunks)

    def _start_chunks(self, chunks: Sequence["PromptChunk"]) -> list["PromptChunk"]:
        """Add the chunks' sequences that are new (on their cached prefix) and give each chunk the
        tokens it feeds now (`ids`, from `at`). Returns those with tokens to feed."""
        for c in chunks:
            if self.cache.has_sequence(c.seq_id):
                continue                                      # the next chunk of its prompt
            self.cached_tokens[c.seq_id] = self.cache.add_sequence(c.seq_id, self._lookup(c.prompt)
                                                                   if c.use_cache else None)
            if not c.use_cache:
                self._uncached.add(c.seq_id)
            if self._keeps_features:
                self._seq_features[c.seq_id] = [self._block_features[k] for k in self.cache.block_keys(c.seq_id)]
        for c in chunks:
            c.at = self.cache.seq_len(c.seq_id)
            end = len(c.prompt) - 1 if c.limit is None else min(len(c.prompt) - 1, c.at + c.limit)
            c.ids = list(c.prompt[c.at:end])
        return [c for c in chunks if c.ids]

    @staticmethod
    def _chunk_inputs(chunks: Sequence["PromptChunk"]) -> tuple[list, list, list, list]:
        """`ragged_tree_forward`'s inputs for prompt chunks: causal chains, no logits."""
        return ([torch.tensor(c.ids, dtype=torch.long) for c in chunks],
                [c.at + torch.arange(len(c.ids)) for c in chunks],
                [torch.ones(len(c.ids), len(c.ids), dtype=torch.bool).tril() for c in chunks],
                [torch.zeros(0, dtype=torch.long) for _ in chunks])

    def _end_chunks(self, chunks: Sequence["PromptChunk"]) -> None:
        """After the forward: each chunk's features (with the cached blocks' before the first),
        its sequence's full blocks registered in the prefix cache."""
        width = self.model.feature_width
        for c in chunks:
            if c.hidden is None and self.features:
                c.hidden = torch.zeros(0, width)
            if self._keeps_features:      # the first call's output starts with the cached blocks'
                first = c.at == self.cached_tokens[c.seq_id]
                c.hidden = torch.cat((self._seq_features[c.seq_id] if first else []) + [c.hidden])
                if first:
                    self._seq_features[c.seq_id] = [c.hidden]
                else:
                    self._seq_features[c.seq_id].append(c.hidden)
            if c.seq_id not in self._uncached:
                self.cache.cache_prefix(c.seq_id, list(c.prompt[:-1]))
                self._keep_block_features(c.seq_id)

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_ids: Sequence[int], params: SamplingParams) -> list:
        """Each prompt token's log-probability after the tokens before it (the first has none: None)
        and the top `params.logprobs` there, under temperature only (penalties read an output the
        prompt does not have). One forward of the prompt on a scratch sequence: only an `echo`
        with log-probabilities asks for it."""
        scratch = ("__prompt_logprobs__", id(prompt_ids))
        self.cache.add_sequence(scratch)
        try:
            n = len(prompt_ids)
            (logits,) = ragged_tree_forward(
                self.model, self.cache, [scratch], [torch.tensor(list(prompt_ids), dtype=torch.long)],
                [torch.arange(n)], [torch.ones(n, n, dtype=torch.bool).tril()], [torch.arange(n - 1)])
        finally:
            self.cache.free(scratch)
        return [None] + token_logprobs(logits, params, prompt_ids[1:], params.prompt_logprobs)

    @property
    def _keeps_features(self) -> bool:
        return self.features and self.cache.prefix_caching

    def _lookup(self, prompt: Sequence[int]) -> list[int]:
        """The prompt tokens (all but the last) a new sequence may look up in the prefix cache:
        with features, only as far as the cached blocks' features are kept."""
        if not self._keeps_features:
            return list(prompt[:-1])
        bs, key, n = self.cache.block_size, None, 0
        while (n + 1) * bs <= len(prompt) - 1:
            key = chain_hash(key, prompt[n * bs:(n + 1) * bs])
            if not self.cache.is_cached(key) or key not in self._block_features:
                break
            n += 1
        return list(prompt[:n * bs])

    def _keep_block_features(self, seq_id: Hashable) -> None:
        """Keep the features of the sequence's cached blocks (and forget evicted blocks')."""
        if not self._keeps_features:
            return
        for key in [k for k in self._block_features if not self.cache.is_cached(k)]:
            del self._block_features[key]
        feats, bs = torch.cat(self._seq_features[seq_id]) if self._seq_features[seq_id] else None, self.cache.block_size
        for i, key in enumerate(self.cache.block_keys(seq_id)):
            if key not in self._block_features and self.cache.is_cached(key) and feats is not None \
                    and feats.shape[0] >= (i + 1) * bs:
                self._block_features[key] = feats[i * bs:(i + 1) * bs].clone()

    def release(self, seq_id: Hashable, token_ids: Sequence[int] | None = None) -> None:
        """Free the sequence; with `token_ids` (its committed tokens), first register its full
        blocks in the prefix cache (unless it opted out), for a next turn to start on."""
        if token_ids is not None and seq_id not in self._uncached and self.cache.has_sequence(seq_id):
            self.cache.cache_prefix(seq_id, list(token_ids))
            self._keep_block_features(seq_id)
        self.cache.free(seq_id)
        self._seq_features.pop(seq_id, None)
        self.cached_tokens.pop(seq_id, None)
        self._uncached.discard(seq_id)

    @torch.inference_mode()
    def verify(self, batch: Sequence[VerifyRequest], chunks: Sequence["PromptChunk"] = ()) -> list[VerifyResult]:
        """One target forward over all trees of the batch, then accept / reject per tree.
        `chunks`: prompts' next chunks (chunked prefill), fed in the same forward: each filled
        in as `prefill_batch` would (their sequences must not be in `batch`)."""
        for r in batch:
            cached = self.cache.seq_len(r.seq_id)
            if r.tree.prefix_len != cached + 1:
                raise StaleTreeError(f"tree for prefix {r.tree.prefix_len} but sequence {r.seq_id!r} "
                                     f"has {cached + 1} committed tokens")
        feeding = self._start_chunks(chunks)
        extra = self._chunk_inputs(feeding)
        self._own_feature_layers()
        target_logits = ragged_tree_forward(                                     # B x [T+1, V]
            self.model, self.cache, [r.seq_id for r in batch] + [c.seq_id for c in feeding],
            [torch.cat([torch.tensor([r.root_token_id]), r.tree.token_ids]) for r in batch] + extra[0],
            [r.tree.prefix_len - 1 + torch.cat([torch.zeros(1, dtype=torch.long), r.tree.depths])
             for r in batch] + extra[1],
            [r.tree.verification_mask() for r in batch] + extra[2],
            [torch.arange(r.tree.num_nodes + 1) for r in batch] + extra[3],
            return_hidden=self.features,
        )
        hidden = None
        if self.features:
            target_logits, hidden = target_logits
            for c, h in zip(feeding, hidden[len(batch):]):
                c.hidden = h.cpu()
        target_logits = target_logits[:len(batch)]
        self._end_chunks(chunks)
        target_logits = [process_logits(logits, r.params, TokenHistory(r.committed, r.tree.row_paths()))
                         if r.params.reads_history else logits for r, logits in zip(batch, target_logits)]
        results: list[VerifyResult | None] = [None] * len(batch)
        # greedy and seeded requests walk the tree on one token per row: the argmax of the logits,
        # or of the seed's Gumbel-perturbed log p (`coupled`); the rest run rejection sampling
        walk_rows = [self._coupled(r, logits) if r.params.coupled else logits
                     for r, logits in zip(batch, target_logits)]
        for walks in (True, False):
            rows = [b for b, r in enumerate(batch) if r.params.reads_q != walks]
            if rows:
                sample = self._sample_greedy if walks else self._sample
                source = walk_rows if walks else target_logits
                for b, res in zip(rows, sample([batch[b] for b in rows], [source[b] for b in rows])):
                    results[b] = res
        for b, (r, res) in enumerate(zip(batch, results)):
            # commit [root] + accepted path behind the prefix; the rest of the tree is rolled back
            base = r.tree.prefix_len - 1
            rows = [0] + [a + 1 for a in res.accepted_nodes]
            if r.params.logprobs is not None:   # token j was sampled at row rows[j]: the same forward
                res.logprobs = token_logprobs(target_logits[b][torch.tensor(rows)], r.params, res.token_ids)
            self.cache.compact(r.seq_id, base, rows)
            if hidden is not None:
                res.features = hidden[b][torch.tensor(rows)].cpu()
                if r.seq_id in self._seq_features:        # kept for the prefix cache
                    self._seq_features[r.seq_id].append(res.features)
        return results

    @staticmethod
    def _coupled(r: VerifyRequest, logits: torch.Tensor) -> torch.Tensor:   # [T+1, V] -> [T+1, V]
        """`log p + G` of each row, G keyed by (seed, the output position the row samples): the
        walk reads each row's argmax alone, so only scores that can be it are made (`top=1`)."""
        start = len(r.committed) - r.params.prompt_len          # output tokens committed so far
        positions = [start] + [start + int(d) for d in r.tree.depths]
        return coupled_scores(logits_to_probs(logits, r.params), r.params, positions, top=1)

    @staticmethod
    def _sample_greedy(batch, target_logits) -> list[VerifyResult]:
        """Greedy trees need only each row's argmax: one small copy to the host and the
        sampler's greedy walk there (`greedy_walk`), not one-hot probabilities over the
        vocabulary and a launch."""
        best = torch.cat([logits.argmax(-1) for logits in target_logits]).tolist()   # one sync
        out, at = [], 0
        for r, logits in zip(batch, target_logits):
            rows = best[at:at + logits.shape[0]]
            at += logits.shape[0]
            tokens = r.tree.token_ids.tolist()
            path, next_id = greedy_walk(r.tree.parent_ids.tolist(), tokens, rows)
            out.append(VerifyResult(path, [tokens[i] for i in path] + [next_id], next_id, r.tree.num_nodes))
        return out

    def _sample(self, batch, target_logits) -> list[VerifyResult]:
        """Pad the stochastic trees and run rejection sampling.

        Everything lives on the target's device (the Triton sampler on CUDA); the
        random draws come from each request's CPU generator, so a seed means the
        same on every device.
        """
        B, T = len(batch), max(r.tree.num_nodes for r in batch)
        V, device = target_logits[0].shape[-1], target_logits[0].device
        draft_token_ids = torch.zeros(B, T, dtype=torch.long)                # [B, T]
        parent_ids = torch.full((B, T), -1, dtype=torch.long)                # [B, T]
        target_probs = torch.zeros(B, T + 1, V, device=device)               # [B, T+1, V]
        draft_probs = torch.zeros(B, T + 1, V, device=device)
        uniform = torch.zeros(B, T)                                          # [B, T]
        exp_noise = torch.ones(B, V)                                         # [B, V]
        for b, (r, logits) in enumerate(zip(batch, target_logits)):
            n = r.tree.num_nodes
            draft_token_ids[b, :n], parent_ids[b, :n] = r.tree.token_ids, r.tree.parent_ids
            target_probs[b, : n + 1] = logits_to_probs(logits, r.params)
            if n:                       # q over the vocabulary, or over a reduced head's columns (0 elsewhere)
                columns = slice(None) if r.tree.draft_columns is None else r.tree.draft_columns.to(device)
                draft_probs[b, : n + 1, columns] = r.tree.draft_probs.to(device)
            uniform[b, :n] = torch.rand(n, generator=r.generator)
            exp_noise[b] = exponential((V,), r.generator)
        num_nodes = torch.tensor([r.tree.num_nodes for r in batch], dtype=torch.long)
        accepted, num_accepted, next_ids = rejection_sample(
            draft_token_ids.to(device), parent_ids.to(device), num_nodes.to(device), target_probs,
            draft_probs, uniform.to(device), exp_noise.to(device))
        accepted, num_accepted, next_ids = accepted.cpu(), num_accepted.tolist(), next_ids.tolist()
        out = []
        for b, r in enumerate(batch):
            path = accepted[b, : num_accepted[b]].tolist()
            tokens = r.tree.token_ids[path].tolist() + [next_ids[b]]
            out.append(VerifyResult(path, tokens, next_ids[b], r.tree.num_nodes))
        return out
