"""The drafter's per-sequence bookkeeping of the asynchronous protocol (DESIGN.md §3).

Plain classes (no Ray), so the protocol's state machine is testable in one
process; drafter/runtime.py drives them (the verifier's side is verifier/stream.py).

Drafter side, `DraftStream`: the prefix the drafter knows to be committed
(`confirmed`, learnt only from the verifier's signals, so always a true prefix)
and the trees in flight, each with the outcome the drafter *assumed* for it
(its greedy path fully accepted plus its own guess of the bonus token). The
next tree is drafted after `confirmed` + all assumed outcomes. A signal that
equals the head tree's assumption changes nothing (the next tree in flight is
already valid); any other signal bumps the epoch, drops every tree in flight
and rolls the draft KV back to the longest prefix still true.

Bridging a rollback. Re-drafting from the true prefix after a contradicted
assumption would leave the verifier idle for a whole draft. Instead both sides
follow one rule: after a verified tree whose outcome differs from the one the
drafter announced (`TreeHeader.outcome`), the verifier decodes the next token
alone at once (a tree of zero nodes, the *bridge*), and the drafter drafts its
restart tree after the committed prefix plus its own guess `g` of that token.
If the target's token equals `g`, the restart tree is valid when the bridge
step ends; if not, it is dropped as stale and the drafter restarts plainly.

Bridge chains (`EngineSettings.bridge_depth` r > 0, greedy requests, a draft
model): the verifier holds a copy of the draft and makes its bridge step verify
the draft's own greedy chain of r tokens after the committed prefix (a short
synchronous step: ~1 + γ + … + γ^r tokens instead of one), announcing the chain
plus the draft's next token as the step's outcome. The drafter drafts the same
greedy path and its restart tree after all r + 1 of those tokens. Since a bridge
step now announces an outcome too, a bridge step that contradicts it is
followed by another bridge (`InFlight.rebridge`). Both sides draft the same path
from the same model and prefix; should they ever differ, a tree is stale, which
costs a step, never exactness.

Restart trees (`EngineSettings.restart_depth` s > 0, replacing bridges): after a
contradicted outcome the verifier does not decode alone; the sequence waits (within
its patience) for the drafter, which drafts a short restart tree, a chain of
min(s, budget) tokens after the committed prefix, sends it at once and drafts its
next tree after the restart tree's assumed outcome. The wait is one hop plus s + 1
draft levels instead of a bridge step; the first token after a rejection is then
verified beside the one the target fixed, and a contradicted restart tree is followed
by another one. The verifier decides s (`speculation.policy.restart_tree_depth`: the setting,
or by default up to 3 for a lone overlapped stream) and the step's signal says it
(`Signal.restart`, `DraftStream.restart`); 0 bridges as before.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from speculation.wire import Signal


@dataclass
class InFlight:
    tree_id: int
    prefix_len: int
    outcome: list[int] | None    # assumed committed tokens of the tree; None = no guess possible
    num_nodes: int
    cached: list[int] | None = None   # tokens whose draft K/V were kept for it (default: outcome)
    rebridge: bool = False       # a bridge chain: contradicted, it is followed by another bridge

    @property
    def assumed(self) -> list[int]:
        return self.cached if self.cached is not None else (self.outcome or [])


class DraftStream:
    def __init__(self, stream: str, tokens: list[int], epoch: int, params, seed: int,
                 proposer: str = "model") -> None:
        self.stream = stream
        self.proposer = proposer                   # "model" | "ngram": what drafts its trees
        self.confirmed = list(tokens)
        self.epoch = epoch
        self.params = params                       # models.SamplingParams
        self.generator = torch.Generator().manual_seed(seed)
        self.inflight: deque[InFlight] = deque()
        self.next_tree_id = 0
        self.budget: tuple[int, int] = (0, 0)      # (spec_len, tree_width) from the verifier
        self.bridge = False                        # next tree drafted after the bridge token
        self.restart = 0                           # ... or a restart tree this deep (the signal's word)

    def position(self) -> list[int] | None:
        """Tokens the next tree is drafted after, or None when an outcome can't be assumed."""
        tokens = list(self.confirmed)
        for f in self.inflight:
            if f.outcome is None:
                return None
            tokens += f.outcome
        return tokens

    def ready(self, slots: int) -> bool:
        return self.budget[0] > 0 and len(self.inflight) < slots and self.position() is not None

    def record(self, prefix_len: int, outcome: list[int] | None, num_nodes: int,
               cached: list[int] | None = None) -> InFlight:
        f = InFlight(self.next_tree_id, prefix_len, outcome, num_nodes, cached)
        self.next_tree_id += 1
        self.inflight.append(f)
        return f

    def record_bridge(self, tokens: list[int] | int) -> None:
        """The verifier's bridge step (id -1) is assumed to commit `tokens`: one token guessed
        for a plain bridge (a tree of zero nodes), or a bridge chain's r tokens plus the
        draft's next one (module doc); a contradicted chain is followed by another bridge."""
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        self.inflight.append(InFlight(-1, len(self.confirmed), tokens, 0, rebridge=len(tokens) > 1))

    def on_step(self, sig: Signal) -> tuple[bool, int | None, int]:
        """Apply a step signal. Returns (epoch bumped, keep_len for the draft KV or None, wasted nodes).

        `keep_len`: the draft cache must be truncated to this many tokens (the
        longest prefix of what it holds that is still true); None = keep all.
        """
        held = self.confirmed + [t for f in self.inflight for t in f.assumed]   # what the draft KV assumed
        self.confirmed.extend(sig.token_ids)
        self.bridge, self.restart = False, sig.restart
        # the root (last committed token) is always fed afresh with the next tree
        keep = min(common_prefix(held, self.confirmed), len(self.confirmed) - 1)
        head = self.inflight[0] if self.inflight else None
        if head is None:
            return False, None, 0                          # nothing was assumed past `confirmed`
        if head.tree_id == sig.tree_id:
            self.inflight.popleft()
            if head.outcome == list(sig.token_ids):
                return False, None, 0                      # the assumption held: nothing to undo
            if head.outcome is None:                       # nothing was drafted past it: no new epoch,
                return False, keep, 0                      # but its assumed path leaves the draft KV
            # a verified tree (or bridge chain) contradicted its announced outcome: the verifier bridges
            self.bridge = sig.tree_id >= 0 or head.rebridge
        wasted = sum(f.num_nodes for f in self.inflight)
        self.inflight.clear()
        self.epoch += 1
        return True, keep, wasted

    def resync(self, tokens: list[int], epoch: int) -> int:
        """Restart from the whole committed prefix; returns the nodes dropped."""
        wasted = sum(f.num_nodes for f in self.inflight)
        self.inflight.clear()
        self.bridge, self.restart = False, 0
        self.confirmed = list(tokens)
        self.epoch = max(self.epoch + 1, epoch)
        return wasted


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def greedy_outcome(tree, depth: int) -> tuple[list[int], list[int], int | None]:
    """The drafter's most likely outcome of `tree` cut at `depth` (DESIGN §3 step 2).

    Follows the first child (the draft's argmax, or its first draw when
    sampling) from the root. Returns (path node indices up to `depth`, their
    tokens, the guessed bonus token: the path's child at depth + 1, or None
    when the path ends before it).
    """
    parents = tree.parent_ids.tolist()
    tokens = tree.token_ids.tolist()
    first_child: dict[int, int] = {}
    for i, p in enumerate(parents):
        first_child.setdefault(p, i)
    path, node = [], -1
    while node in first_child and len(path) < depth:
        node = first_child[node]
        path.append(node)
    guess = None
    if len(path) == depth and node in first_child:
        guess = tokens[first_child[node]]
    return path, [tokens[i] for i in path], guess


def cut_tree(tree, depth: int):
    """The tree without its nodes deeper than `depth` (nodes are in level order)."""
    from models.tree import TokenTree

    keep = int((tree.depths <= depth).sum())
    if keep == tree.num_nodes:
        return tree
    if bool((tree.depths[:keep] > depth).any()):
        raise ValueError("tree nodes are not in level order; cannot cut by depth")
    probs = None if tree.draft_probs is None else tree.draft_probs[: keep + 1]
    return TokenTree(tree.token_ids[:keep], tree.parent_ids[:keep], tree.depths[:keep], probs,
                     tree.prefix_len, tree.epoch, tree.draft_columns)


def reroot(tree, node: int):
    """The subtree under `node` as a tree of its own, drafted after prefix + the tokens of the
    path to `node` (its token and its ancestors').

    Returns (subtree, original index of each subtree node). Level order is kept.
    """
    from models.tree import TokenTree

    parents = tree.parent_ids.tolist()
    inside, order = {node}, []
    for i in range(node + 1, tree.num_nodes):
        if parents[i] in inside:
            inside.add(i)
            order.append(i)
    new_index = {old: new for new, old in enumerate(order)}
    new_index[node] = -1
    idx = torch.tensor(order, dtype=torch.long)
    probs = None
    if tree.draft_probs is not None:
        probs = tree.draft_probs[torch.tensor([node + 1] + [i + 1 for i in order])]    # [T'+1, V or V']
    sub = TokenTree(tree.token_ids[idx], torch.tensor([new_index[parents[i]] for i in order], dtype=torch.long),
                    tree.depths[idx] - int(tree.depths[node]), probs, tree.prefix_len + int(tree.depths[node]),
                    tree.epoch, tree.draft_columns)
    return sub, order
