"""The one switch between the tree attention kernels (DESIGN.md §5).

CUDA tensors go to the Triton split-K kernel (`kernels.tree_decode_attention`),
imported lazily so CPU-only installs never touch Triton; everything else goes
to the pure-torch reference `kernels.ref.tree_decode_attention`, or, when the
model passes the per-forward `CpuAttentionContext`, to the same computation
with the layer-independent work (slots, masks) done once per forward.
"""
from __future__ import annotations

import math

import torch

from kernels import cpu as cpu_kernels
from kernels import ref


def tree_attention(
    q: torch.Tensor,             # [B, T, Hq, D]
    k_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]  tree keys already written
    v_cache: torch.Tensor,       # [N_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    prefix_lens: torch.Tensor,   # [B] int32
    tree_mask: torch.Tensor,     # [B, T, T] bool
    sm_scale: float | None = None,
    context: "CpuAttentionContext | None" = None,
    sliding_window: int | None = None,   # this layer's window (ModelConfig.window_of); None = full
) -> torch.Tensor:               # [B, T, Hq, D]
    if q.is_cuda:
        from kernels import tree_decode_attention   # Triton; lazy on purpose

        return tree_decode_attention(
            q.contiguous(), k_cache, v_cache, block_tables, prefix_lens, tree_mask, sm_scale=sm_scale,
            sliding_window=sliding_window,
        )
    if context is not None:
        return context.attend(q, k_cache, v_cache, sm_scale, windowed=sliding_window is not None)
    return ref.tree_decode_attention(
        q, k_cache, v_cache, block_tables, prefix_lens, tree_mask, sm_scale=sm_scale,
        sliding_window=sliding_window,
    )


class CpuAttentionContext:
    """The layer-independent half of the CPU tree attention, built once per forward.

    The reference (`kernels.ref.tree_decode_attention`) gathers each sequence's
    pages and builds its mask again in every layer, a score of small ops per
    sequence and layer. Which cache slots a forward reads, and which of them each
    query may see, are the same in every layer: this holds the flat slots of
    every sequence's prefix + tree, padded to the longest ([B * S]), and the
    visibility ([B, T, S]). In fp32 with the C kernels built, a layer is one call
    (`kernels.cpu.tree_attention`) over each row's visible slots in order
    (`ordered()`, built on first use), the same operations for a path's token in
    any tree; otherwise two gathers, one baddbmm under an additive mask laid out for
    the grouped query heads (`bias()`, [B * Hkv, G * T, S]), a softmax and one bmm,
    whatever B is. Same arithmetic as the reference (fp32 scores, softmax, weighted
    sum), to rounding. With `sliding_window` (the model's; layers may or may not use
    it) it also holds the windowed visibility, which `attend(..., windowed=True)` uses.
    """

    def __init__(self, block_tables: torch.Tensor, prefix_lens: torch.Tensor, tree_mask: torch.Tensor,
                 block_size: int, num_heads: int, num_kv_heads: int, sliding_window: int | None = None) -> None:
        B, T = tree_mask.shape[0], tree_mask.shape[1]
        device = tree_mask.device
        P = prefix_lens.to(device=device, dtype=torch.long)                          # [B]
        S = int(P.max()) + T
        pos = torch.arange(S, device=device)                                         # [S]
        table = block_tables.to(device=device, dtype=torch.long)
        # past its own end a row repeats its last slot (masked): it never reads another sequence's pages
        own = torch.minimum(pos[None, :], (P + T - 1)[:, None])                      # [B, S]
        self.slots = (table.gather(1, own // block_size) * block_size + own % block_size).reshape(B * S)
        rel = pos[None, :] - P[:, None]                                              # [B, S] offset into the tree
        in_tree = (rel >= 0) & (rel < T)

        def visible_of(tree_mask: torch.Tensor, prefix_visible: torch.Tensor) -> torch.Tensor:   # [B, T, S]
            tree_part = tree_mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S))
            return torch.where(in_tree[:, None, :], tree_part, prefix_visible)

        self.visible = {False: visible_of(tree_mask, (rel < 0)[:, None, :])}
        if sliding_window is not None:   # node i sits at P + depth i and sees positions > it - window
            query_pos = P[:, None] + ref.tree_depths(tree_mask)                        # [B, T]
            recent = pos[None, None, :] > (query_pos - sliding_window)[:, :, None]       # [B, T, S]
            self.visible[True] = visible_of(ref.window_tree_mask(tree_mask, sliding_window),
                                            (rel < 0)[:, None, :] & recent)
        self.G = num_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self.B, self.T, self.S = B, T, S
        self._bias: dict[bool, torch.Tensor] = {}
        self._ordered: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}

    def bias(self, windowed: bool = False) -> torch.Tensor:   # [B * Hkv, G * T, S]: 0 visible, -inf not
        if windowed not in self._bias:
            B, T, S = self.B, self.T, self.S
            bias = torch.zeros(B, T, S, device=self.slots.device).masked_fill_(~self.visible[windowed], float("-inf"))
            self._bias[windowed] = bias[:, None, None].expand(B, self.num_kv_heads, self.G, T, S).reshape(
                B * self.num_kv_heads, self.G * T, S)
        return self._bias[windowed]

    def ordered(self, windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slots each query row sees, in position order (its prefix, its ancestors,
        itself): [B * T, S] int64, the first counts[r] of row r valid; counts [B * T] int64."""
        if windowed not in self._ordered:
            B, T, S = self.B, self.T, self.S
            vis = self.visible[windowed].reshape(B * T, S)
            order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)        # visible first, in order
            slots = self.slots.view(B, 1, S).expand(B, T, S).reshape(B * T, S)
            self._ordered[windowed] = (slots.gather(1, order).contiguous(), vis.sum(1))
        return self._ordered[windowed]

    @staticmethod
    def ordered_rows(contexts: "list[CpuAttentionContext]", windowed: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """`ordered(windowed)` of the groups of one packed forward, their rows one after the
        other ([N, max S] int64, padded past each row's count; [N] int64)."""
        parts = [c.ordered(windowed) for c in contexts]
        if len(parts) == 1:
            return parts[0]
        S = max(v.shape[1] for v, _ in parts)
        return (torch.cat([torch.nn.functional.pad(v, (0, S - v.shape[1])) for v, _ in parts]),
                torch.cat([n for _, n in parts]))

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               sm_scale: float | None = None, windowed: bool = False) -> torch.Tensor:  # [B, T, Hq, D]
        B, T, S = self.B, self.T, self.S
        assert windowed in self.visible, "context built without the sliding window"
        Hq, D = q.shape[2], q.shape[3]
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
        if cpu_kernels.layer_ops_apply(q, D) and k_cache.dtype == torch.float32:
            return cpu_kernels.tree_attention(q, k_cache, v_cache, *self.ordered(windowed), scale)
        bias = self.bias(windowed)
        Hkv = k_cache.shape[2]
        G = Hq // Hkv
        k = k_cache.reshape(-1, Hkv, D).index_select(0, self.slots).float()        # [B*S, Hkv, D]
        v = v_cache.reshape(-1, Hkv, D).index_select(0, self.slots).float()
        k = k.view(B, S, Hkv, D).permute(0, 2, 3, 1).reshape(B * Hkv, D, S)
        v = v.view(B, S, Hkv, D).permute(0, 2, 1, 3).reshape(B * Hkv, S, D)
        qg = q.float().reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B * Hkv, G * T, D)
        probs = torch.softmax(torch.baddbmm(bias, qg, k, alpha=scale), dim=-1)  # [B*Hkv, G*T, S]
        out = torch.bmm(probs, v).view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4)        # [B, T, Hkv, G, D]
        return out.reshape(B, T, Hq, D).to(q.dtype)
