"""CUDA graphs for the small forwards: plain decoding steps, tree verification, drafting.

On a GPU these forwards are bound by the host, not the device: an 8B-shaped
target's one-token forward issued ~1200 kernels and took 32.8 ms of wall time
for 5.7 ms of device time on an H200 (`bench/gpu_forward.py`, 2026-11-30;
bench/README.md, "On a GPU"). A CUDA graph issues the same kernels with one
launch. vLLM and SGLang capture their decode batches the same way.

`GraphedLayers` replaces `Transformer._layers` (embedding → layers → final norm)
for forwards of at most `max_tokens` rows. A graph is keyed by the batch size B,
the tokens per sequence T, the block-table width rounded up to a power of two
and the cache (a forward on another cache drops the graphs of the one before,
which would otherwise keep it allocated); its inputs live in static buffers
that each call fills (token ids, RoPE positions, block table padded with block
0, prefix lengths, tree mask). The tree attention kernel reads only the pages below each prefix length
plus T, so the padding is never read; its split count follows the padded
width. A key's first forward runs eagerly (it compiles the Triton kernels), its
second captures, later ones replay. What the host did around `_layers` (cache
reservations, the LM head, truncation on error) is unchanged.

A feature-conditioned draft (`models.eagle.EagleDraft`) is graphed the same way,
its input features [B, T, hidden] one more static buffer (copied into the model's
dtype, as its eager `_inputs` casts them).

`GraphedLayers.warm_up(cache, rows)` captures, at start-up, every key of the
given rows per sequence (the planner's shape set: `speculation.planner.
verify_rows` / `draft_rows`) at every block-table width bucket the cache can
hold, smallest contexts first while `max_graphs` allows; a key never warmed up
still gets the lazy path above, but only up to the most rows per sequence warmed
up: after a warm-up, longer forwards (a prompt's prefill or catch-up) stay eager,
so no capture lands inside a request (a first-seen prompt length would otherwise
be captured on its second use, hundreds of ms on an 8B).

Not graphed: more rows than `max_tokens` (prefill), models with dynamic RoPE
(their frequencies depend on the positions' values), keys beyond `max_graphs`.
Those run eagerly.

Switch: `SPECFLASH_CUDA_GRAPHS=0` keeps every forward eager (vLLM's
`enforce_eager`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_GRAPHS = 64


def wanted() -> bool:
    """Graphs unless SPECFLASH_CUDA_GRAPHS is 0 / false / off."""
    return os.environ.get("SPECFLASH_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "off", "no")


def enable(model, max_tokens: int = DEFAULT_MAX_TOKENS, max_graphs: int = DEFAULT_MAX_GRAPHS,
           capture: "Callable | None" = None) -> bool:
    """Give `model` (a models.Transformer or a feature-conditioned draft on CUDA) graphed small
    forwards; False where it cannot have them (CPU, dynamic RoPE, a subclass with other inputs),
    unless `capture` is given (tests: a stand-in for CUDA capture)."""
    from models.transformer import Transformer

    # a feature-conditioned draft (`needs_features`, models.eagle) reads its features as one more input
    plain = type(model)._inputs is Transformer._inputs
    if not (plain or getattr(model, "needs_features", False)) or getattr(model, "_dynamic_rope", False):
        return False
    if capture is None and (model.embed_tokens.weight.device.type != "cuda" or not wanted()):
        return False
    model.graphs = GraphedLayers(model, max_tokens, max_graphs, capture)
    return True


def _bucket(width: int) -> int:
    return 1 << max(0, width - 1).bit_length()


def _cuda_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """Run `fn` once on a side stream (its work is real: it writes the K/V a replay writes again),
    then capture it. Returns (replay, output buffer)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: a CUDA call from another thread of the process (an actor's I/O) during the
    # capture is neither captured nor an error
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def stand_in_capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Callable[[], None], torch.Tensor]:
    """A CPU stand-in for `_cuda_capture` (tests; `enable(..., capture=stand_in_capture)`): each
    'replay' re-runs `fn` on the static buffers and writes into the same output tensor, as a
    graph's replay does."""
    out = fn()
    return (lambda: out.copy_(fn())), out


class _Entry:
    """One captured forward and its static inputs."""

    def __init__(self, model, cache, B: int, T: int, width: int, capture, pool, features: bool) -> None:
        device = model.embed_tokens.weight.device
        self.ids = torch.zeros(B, T, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, T, dtype=torch.long, device=device)
        self.table = torch.zeros(B, width, dtype=torch.int32, device=device)
        self.prefix_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.mask = torch.zeros(B, T, T, dtype=torch.bool, device=device)
        self.features = None if not features else torch.zeros(
            B, T, model.config.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
        self._fn = lambda: model._layers(self.ids, self.positions, cache, self.table, self.prefix_lens, self.mask,
                                         self.features)
        self._capture, self._pool = capture, pool
        self.replay: Callable[[], None] | None = None
        self.out: torch.Tensor | None = None

    def fill(self, ids, positions, table, prefix_lens, mask, features=None) -> None:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        w = table.shape[1]
        self.table[:, :w].copy_(table)
        if w < self.table.shape[1]:
            self.table[:, w:].zero_()
        self.prefix_lens.copy_(prefix_lens)
        self.mask.copy_(mask)
        if features is not None:
            self.features.copy_(features)

    def run(self) -> torch.Tensor:
        if self.replay is None:
            self.replay, self.out = self._capture(self._fn, self._pool)
        self.replay()
        return self.out.clone()   # the buffer is the next replay's; callers may keep what they get


class GraphedLayers:
    def __init__(self, model, max_tokens: int = DEFAULT_MAX_TOKENS, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 capture: "Callable | None" = None) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.max_graphs = max_graphs
        self._capture = capture or _cuda_capture
        self._pool = torch.cuda.graph_pool_handle() if capture is None else None
        self._entries: dict[tuple, _Entry] = {}
        self._seen: dict[tuple, int] = {}
        self._cache: int | None = None      # the cache the graphs write (its K tensor's address)
        self.captures = 0
        self.replays = 0
        self.eager = 0
        self.features = bool(getattr(model, "needs_features", False))   # an EAGLE head: features in
        self.row_cap: int | None = None     # after `warm_up`: the most rows per sequence graphed

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, table: torch.Tensor,
                 tree_mask: torch.Tensor, prefix: Sequence[int],
                 features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states [B, T, hidden] from a graph, or None: run eagerly. `table`: the
        sequences' block table [B, w] int32 on the device (`cache.block_table`); `features`
        [B, T, hidden]: a feature-conditioned draft's input (exactly when it is one)."""
        B, T = input_ids.shape
        if B * T == 0 or B * T > self.max_tokens or (features is not None) != self.features \
                or (self.row_cap is not None and T > self.row_cap):
            self.eager += 1
            return None
        key = (B, T, _bucket(table.shape[1]), cache.k.data_ptr(), self.model.feature_layers)
        if key[3] != self._cache:
            # another cache (one re-allocated larger): graphs of the old one would keep it alive
            self._entries.clear()
            self._seen.clear()
            self._cache = key[3]
        entry = self._entries.get(key)
        if entry is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen < 2 or len(self._entries) >= self.max_graphs:
                self.eager += 1
                return None
            entry = self._entries[key] = _Entry(self.model, cache, B, T, key[2], self._capture, self._pool,
                                                self.features)
            self.captures += 1
        prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        entry.fill(input_ids, positions, table, prefix_lens, tree_mask, features)
        self.replays += 1
        return entry.run()

    def stats(self) -> dict:
        return dict(graphs=len(self._entries), captures=self.captures, replays=self.replays, eager=self.eager)

    def warm_up(self, cache, rows: Sequence[int], batch_sizes: Sequence[int] = (1,),
                max_len: int | None = None) -> int:
        """Capture now the graphs of forwards of `rows` tokens per sequence (`speculation.planner.
        verify_rows` / `draft_rows`: the planner's shape set), for each batch size, at every
        block-table width bucket of contexts up to `max_len` tokens (None: what `cache` holds for
        a batch, at most the model's context), smallest contexts first while `max_graphs`
        allows. Each key's forwards run on dummy sequences of zeros, as `__call__` would: the
        first eagerly (compiling its kernels), the second captured. `cache` is left as it was.
        From now on forwards of more rows per sequence than `rows` holds run eagerly.
        Returns how many graphs it captured."""
        from models.transformer import causal_mask

        before, bs = self.captures, cache.block_size
        self.row_cap = max(self.row_cap or 0, max(rows, default=0))
        device = self.model.embed_tokens.weight.device
        hidden = self.model.config.hidden_size
        bucket = 1
        while True:
            live = False
            for B in batch_sizes:
                limit = min(cache.num_blocks // B * bs, self.model.config.max_position_embeddings)
                limit = limit if max_len is None else min(limit, max_len)
                if (bucket // 2) * bs >= limit:            # this bucket (and every later) out of reach
                    continue
                live = True
                # the longest context of this bucket that still fits (width = bucket blocks)
                end = min(bucket * bs, limit)
                for T in rows:
                    if len(self._entries) >= self.max_graphs:
                        return self.captures - before
                    if B * T > self.max_tokens or end - T < 0 or _bucket(-(-end // bs)) != bucket:
                        continue
                    self._warm_key(cache, B, T, end - T, device, hidden, causal_mask(B, T, device))
            if not live:
                return self.captures - before
            bucket *= 2

    def _warm_key(self, cache, B: int, T: int, prefix: int, device, hidden: int, mask) -> None:
        """Two forwards of B dummy sequences of `prefix` cached tokens and T new ones (eager,
        then captured), each rolled back; the sequences are freed after."""
        seqs = [("__graphs_warm_up__", b) for b in range(B)]
        ids = torch.zeros(B, T, dtype=torch.long, device=device)
        positions = (prefix + torch.arange(T, device=device)).expand(B, T)
        features = torch.zeros(B, T, hidden, device=device) if self.features else None
        try:
            for s in seqs:
                cache.add_sequence(s)
                cache.reserve(s, prefix)
            with torch.inference_mode():
                for _ in range(2):
                    self.model(ids, positions, cache, seqs, mask, features=features)
                    for s in seqs:
                        cache.truncate(s, prefix)
        finally:
            for s in seqs:
                cache.free(s)
