"""The model-holding halves of the pipeline, as plain classes the actors wrap.

`TargetSide` owns the target `Transformer`, its paged KV cache and the
`verifier.Verifier`; `DraftSide` owns a proposer (`drafter.ModelProposer` with
its own draft KV cache, or `drafter.NgramProposer`). Both are built from
checkpoint directories inside the actor process (weights never travel through
Ray). No Ray here: the same classes run in a unit test.

The draft side drafts one level deeper than the tree it sends: the extra level
gives the drafter its guess of the bonus token (DESIGN §3 step 2) and its K/V
is needed for the next tree anyway, so it costs no extra forward in steady
state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from cluster.streams import cut_tree, greedy_outcome

MAX_SPEC_LEN = 16
MAX_TREE_WIDTH = 8


@dataclass
class PipelineSettings:
    """Knobs shared by the actors of one pipeline (built from ClusterConfig, cluster/pipeline.py)."""

    mode: str = "auto"               # default speculation mode of a request
    spec_len: int = 4                # default K / tree depth
    tree_width: int = 1
    proposer: str = "model"
    ring_slots: int = 2              # trees in flight per sequence
    max_batch_size: int = 32         # sequences per verifier forward
    num_blocks: int = 1024           # target KV blocks (the drafter gets as many)
    block_size: int = 16
    num_cpus: float = 1.0            # torch threads of each actor
    device: str = "cpu"
    dtype: str = "float32"
    drafter_timeout_s: float = 2.0   # a drafter silent this long is treated as dead
    max_tree_wait_s: float = 0.25    # longest a sequence is held back for a late tree
    poll_s: float = 0.05             # drafter long-poll when it has nothing to draft


def set_threads(num_cpus: float) -> None:
    """One intra-op thread per reserved CPU (at least one): actors must not oversubscribe."""
    torch.set_num_threads(max(1, int(num_cpus)))


def eos_ids_of(target_dir: str | Path) -> list[int]:
    """EOS ids of the target: config.json's plus the tokenizer's, when it has one."""
    from models.loader import load_config

    eos = set(load_config(target_dir).eos_token_ids)
    if any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from models import load_tokenizer

        tok_eos = load_tokenizer(target_dir).eos_token_id
        if tok_eos is not None:
            eos.add(tok_eos)
    return sorted(eos)


class TargetSide:
    """Target model + paged KV cache + Verifier; one forward per verification step."""

    def __init__(self, target_dir: str, num_blocks: int, block_size: int = 16,
                 device: str = "cpu", dtype: str = "float32") -> None:
        from models import load_model
        from verifier import Verifier

        model = load_model(target_dir, device=device, dtype=getattr(torch, dtype))
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_context = model.config.max_position_embeddings
        self.verifier = Verifier(model, model.new_cache(num_blocks, block_size))

    @property
    def cache(self):
        return self.verifier.cache

    def prefill(self, seq_id: str, prompt: list[int]) -> None:
        self.verifier.prefill(seq_id, prompt)

    def verify(self, requests: list) -> tuple[list, float]:
        """`requests`: verifier.VerifyRequest list. Returns (VerifyResult list, seconds)."""
        start = time.perf_counter()
        results = self.verifier.verify(requests)
        return results, time.perf_counter() - start

    def release(self, seq_id: str) -> None:
        self.verifier.release(seq_id)


@dataclass
class Drafted:
    tree: object               # models.tree.TokenTree cut to the requested depth
    outcome: list[int] | None  # assumed committed tokens: greedy path + bonus guess
    path: list[int]            # node indices of that path (for the draft KV)


class DraftSide:
    """A proposer driven on assumed prefixes (draft-ahead) with explicit rollback."""

    def __init__(self, draft_dir: str | None, target_dir: str, num_blocks: int, block_size: int = 16,
                 proposer: str = "model", device: str = "cpu", dtype: str = "float32") -> None:
        from cluster.engine import read_logit_rows
        from drafter import DraftRequest, ModelProposer, NgramProposer
        from models.loader import load_config

        self._request_cls = DraftRequest
        self._has_width = "tree_width" in {f.name for f in fields(DraftRequest)}
        vocab = load_config(target_dir).vocab_size
        if proposer == "ngram" or draft_dir is None:
            self.proposer = NgramProposer(vocab, MAX_SPEC_LEN + 1)
            self.kind = "ngram"
        else:
            from models import load_model

            model = load_model(draft_dir, device=device, dtype=getattr(torch, dtype))
            cache = model.new_cache(num_blocks, block_size)
            self.proposer = ModelProposer(model, cache, MAX_SPEC_LEN + 1, 1, None,
                                          read_logit_rows(draft_dir, vocab), vocab)
            self.kind = "model"

    @property
    def cache(self):
        return getattr(self.proposer, "cache", None)

    def propose(self, items: list[tuple]) -> tuple[list[Drafted], float]:
        """`items`: (seq_id, prefix tokens, params, generator, spec_len, width, epoch).

        One batched call drafts every sequence to depth spec_len + 1; each tree is
        cut to spec_len and the extra level gives the bonus guess. Returns the
        drafts and the seconds the batch took.
        """
        start = time.perf_counter()
        batch = []
        for seq_id, tokens, params, gen, k, width, epoch in items:
            kw = {"epoch": epoch}
            if self._has_width:
                kw["tree_width"] = width
            batch.append(self._request_cls(seq_id, tokens, params, gen, k + 1, **kw))
        trees = self.proposer.propose(batch)
        out = []
        for (seq_id, *_, k, _w, _e), tree in zip(items, trees):
            path, path_tokens, guess = greedy_outcome(tree, k)
            # assume the greedy path of the *cut* tree: the draft keeps its K/V (and the guess's
            # parent), exactly what a fully accepted tree would leave behind
            self.proposer.on_verified(seq_id, tree, path)
            outcome = None if guess is None else path_tokens + [guess]
            out.append(Drafted(cut_tree(tree, k), outcome, path))
        return out, time.perf_counter() - start

    def rollback(self, seq_id: str, keep_len: int) -> None:
        """Forget draft state past the first keep_len tokens (epoch change, DESIGN §3 step 4)."""
        if hasattr(self.proposer, "rollback"):
            self.proposer.rollback(seq_id, keep_len)

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)
