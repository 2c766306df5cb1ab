"""A greedy draft chain's levels in one C call (kernels/cpu/decoder_layer.c, `sf_draft_chains`).

Drafting a chain level by level from Python costs, per level, a forward's worth of per-call
work (packing the rows, the attention layout, the RoPE, the C operands, the logits' trip
back, the builder's top-1) around a few-row forward that itself takes about as long on a
2-core CPU. For a greedy chain every level's row is known but for its token: its position
and cache slot follow the last one, and it sees its prefix and the chain above it. So the
rows of all levels are laid out at once (one `kernels.cpu.visible_slots` call, one RoPE
call) and the C loop runs level after level: embedding, every decoder layer, the final
norm, the head and the choice of the largest logit, which becomes the next level's token.

Each step is the function the one-level path runs (`Transformer.forward_packed` on 1 to 16
rows: the whole-layer C call, the C final norm, the head's few-row matmul), so the logits
are the same bits; the choice is the first largest logit where the one-level path takes
the first largest log-probability (equal but for logits a rounding apart).
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from kernels import cpu as cpu_kernels
from models.transformer import Transformer, _reserve_all, causal_mask


def applies(model, rows: int, levels: int) -> bool:
    """Whether `greedy_chains` runs this model's chains: a plain `Transformer` (not a
    feature-conditioned draft) in CPU float32 without a sliding window, 1 to 16 rows, the
    C decoder layer built, at least one level."""
    c = model.config
    weight = model.embed_tokens.weight
    return (type(model) is Transformer and levels >= 1 and 1 <= rows <= cpu_kernels.MAX_ROWS
            and c.sliding_window is None and model.graphs is None and not model.feature_layers
            and model.layers[0].qkv_proj.weight.dtype == torch.float32
            and cpu_kernels.layer_ops_apply(weight, c.head_dim) and cpu_kernels.decoder_layer_available())


@torch.inference_mode()
def greedy_chains(
    model: Transformer,
    cache,                                    # models.PagedKVCache
    seq_ids: Sequence[Hashable],
    first: Sequence[int],                     # B tokens: each chain's first drafted token, fed at level 0
    levels: int,
    lm_head: torch.Tensor | None = None,      # [V', hidden]: a reduced head's rows (the caller's)
    head_pack=None,                           # models.linear.PackedWeight kept with `lm_head` (with it)
    rows: torch.Tensor | None = None,         # [V'] int64: the token id of each of its rows
) -> tuple[torch.Tensor, torch.Tensor]:       # tokens [B, levels] int64, log q [B, levels] float32
    """`levels` forwards of B one-row chains (`applies` must hold): level d feeds each chain's
    token at the position after its cache (first[b], then what level d - 1 chose) and chooses
    the token of its largest logit. Each sequence grows by `levels` (the fed tokens' K/V); on
    any error every cache is left as it was."""
    B = len(seq_ids)
    prefix = [cache.seq_len(s) for s in seq_ids]
    _reserve_all(cache, seq_ids, levels)
    try:
        return _run(model, cache, seq_ids, first, levels, lm_head, head_pack, rows, prefix, B)
    except BaseException:
        for s, p in zip(seq_ids, prefix):
            cache.truncate(s, p)
        raise


def _run(model, cache, seq_ids, first, levels, lm_head, head_pack, rows, prefix, B):
    c = model.config
    P = torch.tensor(prefix, dtype=torch.long)
    S = max(prefix) + levels
    visible, counts, slots = cpu_kernels.visible_slots(cache.block_table(seq_ids), P, causal_mask(B, levels),
                                                       cache.block_size, None, S)
    # the layout is sequence-major ([B, levels]); the C loop reads level by level
    visible = visible.view(B, levels, S).transpose(0, 1).contiguous()
    counts, slots = counts.view(B, levels).t().contiguous(), slots.view(B, levels).t().contiguous()
    positions = P[None, :] + torch.arange(levels)[:, None]                      # [levels, B]
    cos, sin = model.rope(positions.reshape(-1))                                 # [levels * B, 1, D/2]
    step = cpu_kernels.DecoderStep(B, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                                   c.rms_norm_eps, 1.0 / math.sqrt(c.head_dim), cos[:B], sin[:B], slots[0],
                                   {False: (visible[0], counts[0])})
    operands = [layer._c_operand(cache.k[i], cache.v[i]) for i, layer in enumerate(model.layers)]
    if lm_head is None:
        lm_head, head_pack = model.lm_head_weight, model._lm_head_pack
    head = head_pack.operand(lm_head, None)
    tokens, log_q = cpu_kernels.draft_chains(step, operands, torch.tensor(list(first), dtype=torch.long), cos, sin,
                                             slots, visible, counts, model.embed_tokens.weight, model.norm, head,
                                             lm_head.shape[0], rows)
    return tokens.t(), log_q.t()
