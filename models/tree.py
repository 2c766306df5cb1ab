"""Token trees: the unit a drafter proposes and a verifier checks (DESIGN.md §2).

A token tree holds candidate continuations of a committed prefix. Node i has a
token, a parent (-1 = child of the root, the last committed token), a depth (1
for the root's children) and, for stochastic verification, the draft
distribution its children were sampled from. A chain (Leviathan et al. 2023;
Chen et al. 2023) is a tree of width 1; trees follow SpecInfer (Miao et al.
2023), Sequoia (Chen et al. 2024) and EAGLE-2 (Li et al. 2024). T = 0 nodes is
plain decoding.

Also here, because drafter/ and verifier/ both need it and may not import each
other: `ragged_tree_forward`, one model forward over a batch of trees of
different sizes (padded, then the padding rolled back out of the cache).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class TokenTree:
    token_ids: torch.Tensor            # [T] int64   token of node i
    parent_ids: torch.Tensor           # [T] int64   parent node of i; -1 = child of the root
    depths: torch.Tensor               # [T] int64   1 for children of the root
    draft_probs: torch.Tensor | None   # [T+1, V] float32: q the root's (row 0) / node i's (row i+1)
                                       #   children were sampled from; None = a verification that
                                       #   reads no q: greedy, or seeded (its walk is the seed's)
    prefix_len: int                    # committed tokens (root included) the tree was drafted for
    epoch: int = 0                     # bumped on every rollback; stale trees are dropped
    draft_columns: torch.Tensor | None = None   # [V'] int64 ascending: the token ids of draft_probs'
    #                                     columns (a reduced draft head's rows; q is 0 elsewhere);
    #                                     None: draft_probs spans the vocabulary

    def __post_init__(self) -> None:
        T = self.token_ids.shape[0]
        if self.parent_ids.shape != (T,) or self.depths.shape != (T,):
            raise ValueError(f"token_ids, parent_ids, depths must all be [T={T}]")
        if self.draft_probs is not None and self.draft_probs.shape[0] != T + 1:
            raise ValueError(f"draft_probs must be [T+1={T + 1}, V], got {tuple(self.draft_probs.shape)}")
        if self.draft_columns is not None and (self.draft_probs is None
                                               or self.draft_columns.shape != (self.draft_probs.shape[1],)):
            raise ValueError("draft_columns name each column of draft_probs")
        if T and bool((self.parent_ids >= torch.arange(T)).any()):
            raise ValueError("nodes must be topologically ordered (parent index < node index)")

    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def dense_draft_probs(self, vocab: int) -> torch.Tensor | None:
        """draft_probs over the whole vocabulary, [T+1, vocab] (0 off `draft_columns`); None without q."""
        if self.draft_probs is None or self.draft_columns is None:
            return self.draft_probs
        dense = torch.zeros(self.draft_probs.shape[0], vocab, dtype=self.draft_probs.dtype)
        dense[:, self.draft_columns] = self.draft_probs
        return dense

    @classmethod
    def empty(cls, prefix_len: int, epoch: int = 0) -> "TokenTree":
        """T = 0: the verifier decodes one token on its own."""
        none = torch.zeros(0, dtype=torch.long)
        return cls(none, none.clone(), none.clone(), None, prefix_len, epoch)

    @classmethod
    def chain(
        cls,
        token_ids: Sequence[int] | torch.Tensor,   # [K]
        draft_probs: torch.Tensor | None,          # [K+1, V] or None ([K+1, V'] with draft_columns)
        prefix_len: int,
        epoch: int = 0,
        draft_columns: torch.Tensor | None = None,   # [V'] int64 ascending, or None
    ) -> "TokenTree":
        """A chain of K drafted tokens: node i's parent is node i-1."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        K = ids.shape[0]
        return cls(ids, torch.arange(K) - 1, torch.arange(1, K + 1), draft_probs, prefix_len, epoch, draft_columns)

    def tree_mask(self) -> torch.Tensor:
        """[T, T] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        return ancestor_mask(self.parent_ids)

    def verification_mask(self) -> torch.Tensor:
        """[T+1, T+1] bool over [root] + nodes: the root sees itself, every node sees the root."""
        T = self.num_nodes
        mask = torch.zeros(T + 1, T + 1, dtype=torch.bool)
        mask[:, 0] = True
        mask[1:, 1:] = self.tree_mask()
        return mask

    def row_paths(self) -> list[list[int]]:
        """Per verification row ([root] + nodes): the drafted tokens before it (`row_paths`)."""
        return row_paths(self.parent_ids.tolist(), self.token_ids.tolist())

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (inclusive)."""
        path, parents = [], self.parent_ids.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def row_paths(parent_ids: Sequence[int], token_ids: Sequence[int]) -> list[list[int]]:
    """The tokens between the root and each row: `[[]]` for the root's row, then for node i the
    tokens of its path, root's child to i inclusive (parents precede children). What the
    history-dependent sampling transforms read per node (`models.sampling.TokenHistory`)."""
    paths: list[list[int]] = [[]]
    for parent, token in zip(parent_ids, token_ids):
        paths.append(paths[parent + 1] + [int(token)])
    return paths


def ancestor_mask(parent_ids: torch.Tensor) -> torch.Tensor:   # [T] -> [T, T] bool
    """mask[i, j] = node j is node i or its ancestor; parents precede children."""
    T = parent_ids.shape[0]
    mask = torch.eye(T, dtype=torch.bool)
    for i, parent in enumerate(parent_ids.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


PAD_ROWS = 16        # padding a group of a packed forward may carry regardless of its size
PAD_SHARE = 0.5      # and beyond that, at most this share of its real rows
SPAN = 2.0           # the longest context in a group at most SPAN x its shortest (+ SPAN_SLACK)
SPAN_SLACK = 64


def pack_groups(lengths: Sequence[int], contexts: Sequence[int] | None = None) -> list[list[int]]:
    """Sequences (their indices) grouped for one packed forward, in order of their contexts
    (`contexts[i]`: the tokens sequence i attends to, cached + new; None: its new tokens), a
    group closed when the next would pad its rows by more than `PAD_ROWS` and `PAD_SHARE` of
    the real ones, or stretch its attention span (every sequence of a group attends over the
    longest one's) past `SPAN`. Small trees of similar contexts stay one group; a prompt's
    chunk beside them, or contexts far apart, get groups of their own."""
    contexts = lengths if contexts is None else contexts
    groups: list[list[int]] = []
    real = shortest = widest = 0        # the open group's real rows, shortest context, longest sequence
    for i in sorted(range(len(lengths)), key=lambda i: (contexts[i], lengths[i])):
        n = max(1, int(lengths[i]))
        if groups:
            padded, total = (len(groups[-1]) + 1) * max(widest, n), real + n
            if padded - total <= max(PAD_ROWS, PAD_SHARE * total) and contexts[i] <= SPAN * shortest + SPAN_SLACK:
                groups[-1].append(i)
                real, widest = total, max(widest, n)
                continue
        groups.append([i])
        real, shortest, widest = n, contexts[i], n
    return groups


def _pack_inputs(groups: list[list[int]], sizes: list[int], seq_ids, input_ids, positions, tree_masks,
                 features, hidden_size: int):
    """`ragged_tree_forward`'s groups as `PackedInput`s, each sequence padded to its group's
    longest (a padding token sees only itself and the prefix; its position repeats the last);
    returns them and, per sequence, (its first row in the packed forward, its group's T)."""
    from models.transformer import PackedInput

    inputs, row_of, start = [], {}, 0
    for members in groups:
        T = max(1, max(sizes[b] for b in members))
        B = len(members)
        if B == 1 and sizes[members[0]] == T:   # one sequence: its own rows, nothing to pad
            b = members[0]
            inputs.append(PackedInput([seq_ids[b]], input_ids[b][None], positions[b][None], tree_masks[b][None],
                                      None if features is None else features[b][None]))
            row_of[b] = (start, T)
            start += T
            continue
        ids = torch.zeros(B, T, dtype=torch.long)
        pos = torch.zeros(B, T, dtype=torch.long)
        mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)                 # [B, T, T]
        feats = None if features is None else torch.zeros(B, T, hidden_size, dtype=features[0].dtype)
        for j, b in enumerate(members):
            n = sizes[b]
            ids[j, :n], pos[j, :n] = input_ids[b], positions[b]
            pos[j, n:] = positions[b][-1] if n else 0
            mask[j, :n, :n] = tree_masks[b]
            if feats is not None:
                feats[j, :n] = features[b]
            row_of[b] = (start + j * T, T)
        inputs.append(PackedInput([seq_ids[b] for b in members], ids, pos, mask, feats))
        start += B * T
    return inputs, row_of


def ragged_tree_forward(
    model,                                   # models.Transformer
    cache,                                   # models.PagedKVCache
    seq_ids: Sequence[Hashable],
    input_ids: Sequence[torch.Tensor],       # B x [T_b] int64
    positions: Sequence[torch.Tensor],       # B x [T_b] int64 RoPE positions
    tree_masks: Sequence[torch.Tensor],      # B x [T_b, T_b] bool
    logit_positions: Sequence[torch.Tensor], # B x [L_b] int64 indices into T_b
    logit_rows: torch.Tensor | None = None,  # [V'] int64 rows of the LM head
    lm_head: torch.Tensor | None = None,     # [V', hidden]: those rows, selected once by the caller
    features: Sequence[torch.Tensor] | None = None,   # B x [T_b, hidden]: a feature-conditioned draft's input
    return_hidden: bool = False,
    head_pack=None,                          # models.linear.PackedWeight kept with `lm_head`
):                                           # B x [L_b, V or V'] float32 (, B x [T_b, hidden])
    """One forward over B trees of different sizes; each sequence grows by exactly T_b.

    Sequences of similar sizes are padded to their longest and attend together; very
    different sizes go to groups of their own (`pack_groups`), all in one packed forward
    (`models.Transformer.forward_packed`): a 64-token prompt chunk beside eight 5-node
    trees costs its 64 rows, not 9 x 64. A padding token sees only the prefix and itself,
    no real token sees it, and its K/V slots are truncated away after. The LM head reads
    only the `logit_positions` rows. With `lm_head` (a reduced head kept by the caller,
    e.g. a draft's `logit_rows`) the logits come from that, so the rows are not gathered
    again on every call. With `return_hidden`, also each sequence's final-norm hidden
    states (the features the LM head read).
    """
    sizes = [int(x.shape[0]) for x in input_ids]
    before = [cache.seq_len(s) for s in seq_ids]
    # on the CPU a group's attention is padded to its longest context; the GPU kernel reads each
    # sequence's own length (and one group keeps a forward on its CUDA graph)
    on_cpu = model.embed_tokens.weight.device.type == "cpu"
    contexts = [p + n for p, n in zip(before, sizes)] if on_cpu else None
    inputs, row_of = _pack_inputs(pack_groups(sizes, contexts), sizes, seq_ids, input_ids, positions,
                                  tree_masks, features, model.config.hidden_size)
    hidden = model.forward_packed(inputs, cache)                              # [N, hidden]
    device = hidden.device
    picks = torch.cat([row_of[b][0] + logit_positions[b].long() for b in range(len(seq_ids))]).to(device)
    picked = hidden.index_select(0, picks)                                    # [sum L_b, hidden]
    if lm_head is None:
        logits = model.logits(picked, logit_rows)                            # [sum L_b, V']
    else:
        logits = (torch.nn.functional.linear(picked, lm_head) if head_pack is None
                  else head_pack.matmul(picked, lm_head, None)).float()
    out, hiddens, at = [], [], 0
    for b, s in enumerate(seq_ids):
        first, T = row_of[b]
        if T > sizes[b]:
            cache.truncate(s, before[b] + sizes[b])
        m = int(logit_positions[b].shape[0])
        out.append(logits[at:at + m])
        at += m
        hiddens.append(hidden[first:first + sizes[b]])
    return (out, hiddens) if return_hidden else out
