"""A draft pass of chains in one C call (kernels/cpu/decoder_layer.c, `sf_draft_chains`).

Drafting a chain level by level from Python costs, per level, a forward's worth of per-call
work (packing the rows, the attention layout, the RoPE, the C operands, the logits' trip
back, the builder's top-1) around a few-row forward that itself takes about as long on a
2-core CPU. For a chain every row of the pass is known but for its token: the
catch-up's rows (the committed tokens the draft has not seen, root last) and, below them,
one row a level, whose position and cache slot follow the last and which sees its prefix
and the chain above it. So all rows are laid out at once (`kernels.cpu.visible_slots`, one
RoPE call) and the C loop runs the catch-up, then level after level: embedding, every
decoder layer, the final norm and the head on one row a chain, and the choice of the
largest logit, which becomes the next level's token. A sampled chain draws it instead as the
largest logit / temperature + Gumbel noise the caller drew (Gumbel-max: an exact draw from the
temperature's softmax), and that softmax comes back as the draw's q; under a request's min-p,
top-k or top-p, the largest log q + noise over what the cut keeps, q the cut's
(kernels/cpu/sample_cut.c: `logits_to_probs`' rules). A chain that reads its history
(penalties, logit_bias, min_tokens) has each level's logits transformed first, each pick joining
its counts (`models.sampling.HistoryColumns`); a grammar's chain is drafted level by level.

A feature-conditioned draft (EAGLE, `models.eagle.EagleDraft`) runs the same way: each row
reads fc([embedding; feature]) instead of the embedding, the catch-up's rows the features
the caller holds (the target's), each level's row its parent's final-norm state, which the
pass returns beside the tokens (what the proposer keeps as the nodes' predicted features).

Each step is the function the one-level path runs (`Transformer.forward_packed` on 1 to 16
rows: the whole-layer C call, fc's and the head's few-row matmuls, the C final norm), so the
logits are the same bits; the choice is the first largest logit where the one-level path takes
the first largest log-probability (equal but for logits a rounding apart; a draw likewise
compares logit / temperature + noise where the one-level path compares log q + noise).
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kernels import cpu as cpu_kernels
from models.eagle import EagleDraft
from models.transformer import Transformer, _reserve_all, causal_mask


@dataclass
class ChainSampling:
    """How `run_chains` draws each chain's tokens when some are sampled."""

    temperatures: torch.Tensor               # [B] float32: each chain's temperature (0: greedy)
    noise: torch.Tensor                      # [B, levels + 1, V'] float32: the Gumbel noise of each draw
                                             # over the head's rows (a greedy chain's is not read)
    min_p: torch.Tensor | None = None        # [B] float32: each chain's min-p (0: none); None: no chain cuts
    top_k: torch.Tensor | None = None        # [B] int64: its top-k (0: none), with min_p
    top_p: torch.Tensor | None = None        # [B] float32: its top-p (1: none), with min_p
    history: list | None = None              # B x models.sampling.HistoryColumns: each chain's history
                                             # transforms (None: no chain reads its history)


@dataclass
class DraftChains:
    """What `run_chains` drafted: B chains of levels + 1 tokens, each level's choice."""

    tokens: torch.Tensor                     # [B, levels + 1] int64: the token chosen at each depth
    log_q: torch.Tensor                      # [B, levels + 1] float32: its log-softmax under the draft
    features: torch.Tensor | None = None     # [B, levels + 1, H] float32: an EAGLE draft's final-norm state
                                             # at the row that chose it (None for a plain draft)
    q: torch.Tensor | None = None            # [B, levels + 1, V'] float32: a sampled chain's q at each
                                             # depth over the head's rows (None unless sampled)


def draws(params) -> bool:
    """Whether a chain of these `models.SamplingParams` is drawn in the one-call pass: greedy or
    sampled (temperature, min-p, top-k, top-p), its history read token by token (penalties,
    logit_bias, min_tokens), no grammar."""
    return params.grammar is None


def applies(model, cache, chains: int, catch_up_rows: int, levels: int) -> bool:
    """Whether `run_chains` runs this pass: a plain `Transformer` or an EAGLE head (fp32 `fc`),
    without a sliding window, whose catch-up (1 to 16 rows in all) runs its layers in C
    (`Transformer.runs_layers_in_c`)."""
    kind = type(model)
    return ((kind is Transformer or (kind is EagleDraft and model.fc.weight.dtype == torch.float32))
            and levels >= 0 and 1 <= chains <= catch_up_rows
            and model.config.sliding_window is None and model.graphs is None and not model.feature_layers
            and model.runs_layers_in_c(catch_up_rows, model.embed_tokens.weight, cache))


@torch.inference_mode()
def run_chains(
    model: Transformer,
    cache,                                    # models.PagedKVCache
    seq_ids: Sequence[Hashable],
    catch_up: Sequence[torch.Tensor],         # B x [n_b] int64: the tokens each chain feeds first, root last
    levels: int,
    lm_head: torch.Tensor | None = None,      # [V', hidden]: a reduced head's rows (the caller's)
    head_pack=None,                           # models.linear.PackedWeight kept with `lm_head` (with it)
    rows: torch.Tensor | None = None,         # [V'] int64: the token id of each of its rows
    features: Sequence[torch.Tensor] | None = None,   # B x [n_b, H] float32: an EAGLE draft's catch-up features
    sampling: ChainSampling | None = None,   # None: every chain greedy
) -> DraftChains:
    """B chains drafted in one call (`applies` must hold): each sequence feeds its `catch_up`
    tokens after its cache, as a chain (the root's row chooses the first token), then `levels`
    more levels of one row, each feeding the token the last one chose at the position after
    it. A chain chooses its largest logit's token, or with `sampling` at a temperature above 0
    draws it: the largest logit / temperature + noise (Gumbel-max, an exact draw from the
    temperature's softmax, which comes back as q). An EAGLE draft's catch-up rows read `features` (its own: the fused
    features its rows read on the one-level path). Each sequence grows by n_b + `levels` (the
    fed tokens' K/V); on any error every cache is left as it was."""
    if (features is None) != (type(model) is not EagleDraft):
        raise ValueError("run_chains: an EAGLE draft's catch-up reads features, and only it")
    prefix = [cache.seq_len(s) for s in seq_ids]
    _reserve_all(cache, seq_ids, [len(ids) + levels for ids in catch_up])
    try:
        return _run(model, cache, seq_ids, catch_up, levels, lm_head, head_pack, rows, prefix, features, sampling)
    except BaseException:
        for s, p in zip(seq_ids, prefix):
            cache.truncate(s, p)
        raise


def _run(model, cache, seq_ids, catch_up, levels, lm_head, head_pack, rows, prefix, features, sampling):
    c, B = model.config, len(seq_ids)
    sizes = [len(ids) for ids in catch_up]
    S = max(p + n for p, n in zip(prefix, sizes)) + levels
    tables = cache.block_table(seq_ids)
    # the catch-up's rows, sequence after sequence (each a chain after its own prefix) ...
    parts = [cpu_kernels.visible_slots(tables[b:b + 1], torch.tensor([prefix[b]]), causal_mask(1, sizes[b]),
                                       cache.block_size, None, S) for b in range(B)]
    # ... then the levels' (sequence-major from the layout; the C loop reads level by level)
    after = torch.tensor([p + n for p, n in zip(prefix, sizes)], dtype=torch.long)
    visible, counts, slots = cpu_kernels.visible_slots(tables, after, causal_mask(B, levels), cache.block_size,
                                                       None, S) if levels else (None, None, None)
    level_major = [] if not levels else [(visible.view(B, levels, S).transpose(0, 1).reshape(-1, S),
                                          counts.view(B, levels).t().reshape(-1), slots.view(B, levels).t().reshape(-1))]
    visible, counts, slots = (torch.cat(x) for x in zip(*parts, *level_major))
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, sizes)]
                          + [(after[None, :] + torch.arange(levels)[:, None]).reshape(-1)])
    cos, sin = model.rope(positions)                                             # [rows, 1, D/2]
    R = sum(sizes)
    step = cpu_kernels.DecoderStep(R, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                                   c.rms_norm_eps, 1.0 / math.sqrt(c.head_dim), cos[:R], sin[:R], slots[:R],
                                   {False: (visible[:R], counts[:R])})
    if lm_head is None:
        lm_head, head_pack = model.lm_head_weight, model._lm_head_pack
    pick = torch.tensor(sizes).cumsum(0) - 1                                     # each root's row
    fc = first_features = None
    if features is not None:
        fc = model.fc._pack.operand(model.fc.weight, model.fc.bias)
        first_features = torch.cat([f.reshape(-1, c.hidden_size) for f in features]).float()
    temps = noise = cuts = history = None
    if sampling is not None:
        temps, noise = sampling.temperatures, sampling.noise.transpose(0, 1)
        cuts = None if sampling.min_p is None else (sampling.min_p, sampling.top_k, sampling.top_p)
        history = None if sampling.history is None else _stack_history(sampling.history)
    tokens, log_q, states, q = cpu_kernels.draft_chains(
        step, model._c_layers(cache), torch.cat(list(catch_up)).long(), pick, levels, cos, sin, slots, visible, counts,
        model.embed_tokens.weight, model.norm, head_pack.operand(lm_head, None), lm_head.shape[0], rows, fc,
        first_features, temps, noise, cuts, history)
    return DraftChains(tokens.t(), log_q.t(), None if states is None else states.transpose(0, 1),
                       None if q is None else q.transpose(0, 1))


def _stack_history(chains: list) -> tuple[torch.Tensor, ...]:
    """B x HistoryColumns -> the C pass's (bias [B, V'], counts [B, V'], seen [B, V'] uint8, stops
    [B, V'] uint8, stop_levels [B] int64, penalties [B, 3] float32); counts and seen are copies,
    which the pass updates as each chain draws."""
    return (torch.stack([h.bias for h in chains]), torch.stack([h.counts for h in chains]),
            torch.stack([h.seen for h in chains]), torch.stack([h.stops for h in chains]),
            torch.tensor([h.stop_levels for h in chains], dtype=torch.long),
            torch.tensor([h.penalties for h in chains], dtype=torch.float32))
