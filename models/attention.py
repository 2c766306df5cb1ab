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
    query may see, are the same in every layer. In fp32 with the C kernels built, a
    layer is one call (`kernels.cpu.tree_attention`) over each row's visible slots in
    order (`ordered()`: its prefix, its ancestors, itself, the same operations for a
    path's token in any tree), which one C call lays out (`kernels.cpu.visible_slots`),
    with the slot each row is written to (`rows()`). Otherwise this holds the flat slots
    of every sequence's prefix + tree, padded to the longest (`slots`, [B * S]), and the
    visibility (`visible(windowed)`, [B, T, S]): two gathers, one baddbmm under an
    additive mask laid out for the grouped query heads (`bias()`, [B * Hkv, G * T, S]),
    a softmax and one bmm, whatever B is. Same arithmetic as the reference (fp32 scores,
    softmax, weighted sum), to rounding. With `sliding_window` (the model's; layers may
    or may not use it) it also holds the windowed visibility, which
    `attend(..., windowed=True)` uses. Each part is built on first use.
    """

    def __init__(self, block_tables: torch.Tensor, prefix_lens: torch.Tensor, tree_mask: torch.Tensor,
                 block_size: int, num_heads: int, num_kv_heads: int, sliding_window: int | None = None) -> None:
        self.B, self.T = tree_mask.shape[0], tree_mask.shape[1]
        self.tables, self.tree_mask, self.block_size = block_tables, tree_mask, block_size
        self.P = prefix_lens.to(device=tree_mask.device, dtype=torch.long)             # [B]
        self.S = (int(self.P.max()) if self.B else 0) + self.T
        self.sliding_window = sliding_window
        self.G = num_heads // num_kv_heads
        self.num_kv_heads = num_kv_heads
        self._slots: torch.Tensor | None = None
        self._visible: dict[bool, torch.Tensor] = {}
        self._bias: dict[bool, torch.Tensor] = {}
        self._ordered: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: torch.Tensor | None = None

    @property
    def windows(self) -> tuple[bool, ...]:
        """The visibilities this context holds: full, and windowed where the model has a window."""
        return (False,) if self.sliding_window is None else (False, True)

    @property
    def slots(self) -> torch.Tensor:   # [B * S] int64
        """Each sequence's cache slots of positions 0 .. S - 1; past its own end a row repeats its
        last slot (masked), so it never reads another sequence's pages."""
        if self._slots is None:
            B, S, P = self.B, self.S, self.P
            pos = torch.arange(S, device=P.device)                                      # [S]
            own = torch.minimum(pos[None, :], (P + self.T - 1)[:, None])                 # [B, S]
            table = self.tables.to(device=P.device, dtype=torch.long)
            self._slots = (table.gather(1, own // self.block_size) * self.block_size
                           + own % self.block_size).reshape(B * S)
        return self._slots

    def visible(self, windowed: bool = False) -> torch.Tensor:   # [B, T, S] bool
        assert windowed in self.windows, "context built without the sliding window"
        if windowed not in self._visible:
            B, T, S, P, tree_mask = self.B, self.T, self.S, self.P, self.tree_mask
            pos = torch.arange(S, device=P.device)                                       # [S]
            rel = pos[None, :] - P[:, None]                                              # [B, S] offset into the tree
            prefix_visible = (rel < 0)[:, None, :]
            if windowed:   # node i sits at P + depth i and sees positions > it - window
                query_pos = P[:, None] + ref.tree_depths(tree_mask)                     # [B, T]
                prefix_visible = prefix_visible & (pos[None, None, :] > (query_pos - self.sliding_window)[:, :, None])
                tree_mask = ref.window_tree_mask(tree_mask, self.sliding_window)
            tree_part = tree_mask.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S))
            in_tree = (rel >= 0) & (rel < T)
            self._visible[windowed] = torch.where(in_tree[:, None, :], tree_part, prefix_visible)
        return self._visible[windowed]

    def bias(self, windowed: bool = False) -> torch.Tensor:   # [B * Hkv, G * T, S]: 0 visible, -inf not
        if windowed not in self._bias:
            B, T, S = self.B, self.T, self.S
            bias = torch.zeros(B, T, S, device=self.P.device).masked_fill_(~self.visible(windowed), float("-inf"))
            self._bias[windowed] = bias[:, None, None].expand(B, self.num_kv_heads, self.G, T, S).reshape(
                B * self.num_kv_heads, self.G * T, S)
        return self._bias[windowed]

    def ordered(self, windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache slots each query row sees, in position order (its prefix, its ancestors,
        itself): [B * T, S] int64, the first counts[r] of row r valid; counts [B * T] int64."""
        if windowed not in self._ordered:
            if cpu_kernels.available() and self.P.device.type == "cpu":
                vis, counts, self._rows = cpu_kernels.visible_slots(
                    self.tables, self.P, self.tree_mask, self.block_size,
                    self.sliding_window if windowed else None, self.S)
                self._ordered[windowed] = (vis, counts)
            else:
                self._ordered[windowed] = self.ordered_in_torch(windowed)
        return self._ordered[windowed]

    def ordered_in_torch(self, windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`ordered`'s layout from torch operators (where the C library is not built): the same
        valid entries; past a row's count, its other slots."""
        B, T, S = self.B, self.T, self.S
        vis = self.visible(windowed).reshape(B * T, S)
        order = torch.argsort((~vis).to(torch.int8), dim=1, stable=True)        # visible first, in order
        slots = self.slots.view(B, 1, S).expand(B, T, S).reshape(B * T, S)
        return slots.gather(1, order).contiguous(), vis.sum(1)

    def rows(self) -> torch.Tensor | None:   # [B * T] int64, or None
        """The cache slot each new row is written to, where `ordered()` laid them out (C)."""
        return self._rows

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
        assert windowed in self.windows, "context built without the sliding window"
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
