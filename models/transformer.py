"""Llama-family decoder (Llama, Qwen2, Mistral shapes) over a paged KV cache.

Pre-norm blocks: RMSNorm (Zhang & Sennrich 2019) → grouped-query attention
(Ainslie et al. 2023) with RoPE → RMSNorm → SwiGLU MLP (Shazeer 2020). The
q/k/v projections are one fused matmul, as are gate/up (the loader
concatenates the checkpoint's weights once).

One `forward` serves prefill, plain decoding and tree verification: the new
tokens of each sequence are appended to its cache slots and attend to the
whole cached prefix plus the new tokens that `tree_mask` allows (a prompt is a
chain, so prefill passes a causal mask). Contract: docs/internals.md, `models`.

Weights are created with `requires_grad=False`: this is an inference engine.
Run it under `torch.no_grad()` / `torch.inference_mode()` all the same.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu as cpu_kernels
from models.attention import CpuAttentionContext, tree_attention
from models.config import ModelConfig, rope_inv_freq
from models.kv_cache import OutOfBlocks, PagedKVCache
from models import linear as linear_module
from models.linear import Linear, PackedWeight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; normalised in float32, scaled in the weight's dtype (as the checkpoints were trained)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [B, T, H, D]; cos, sin: [B, T, 1, D/2] → [B, T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, sliding_window: int | None = None) -> None:
        super().__init__()
        self.c = c
        self.sliding_window = sliding_window   # this layer's window (c.window_of(i)); None = full attention
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.attn_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = Linear(c.hidden_size, q_dim + 2 * kv_dim, bias=c.attention_bias)
        self.o_proj = Linear(q_dim, c.hidden_size, bias=c.attention_out_bias)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)
        self._c_layer: cpu_kernels.SfLayer | None = None
        self._c_seen: tuple | None = None    # what `_c_layer` was last found built from (`_c_watched`)

    def forward(
        self,
        h: torch.Tensor,           # [N, hidden]   every group's rows, packed (AttentionGroup)
        rope: tuple[torch.Tensor, torch.Tensor],   # cos, sin: [N, 1, D/2]
        k_cache: torch.Tensor,     # [N_blocks, block_size, Hkv, D]  this layer's pages
        v_cache: torch.Tensor,     # [N_blocks, block_size, Hkv, D]
        slots: torch.Tensor,       # [N] int64 cache slot of each row
        groups: "Sequence[AttentionGroup]",
    ) -> torch.Tensor:             # [N, hidden]
        """Token-wise work (norms, projections, MLP) on all N rows at once; attention per group.
        On a CPU in fp32 the work between the matmuls takes the C layer operators
        (kernels/cpu/layer_ops.c): four calls instead of ~40 torch operators. For 1 to 16 rows
        `Transformer._packed_layers` runs the layers in C instead (`kernels.cpu.DecoderStep.layers`
        over `_c_operand`s: the same steps in the same order)."""
        c = self.c
        Hq, D = c.num_heads, c.head_dim
        fused = all(g.context is not None for g in groups) and cpu_kernels.layer_ops_apply(h, D)
        norm = cpu_kernels.rms_norm if fused else rms_norm
        qkv = self.qkv_proj(norm(h, self.attn_norm, c.rms_norm_eps))      # [N, (Hq+2Hkv)*D]
        q = self._rope_store(qkv, rope, k_cache, v_cache, slots, fused)     # [N, Hq, D]
        parts = []
        for g in groups:
            qg = q[g.start:g.start + g.batch * g.length].view(g.batch, g.length, Hq, D)
            parts.append(tree_attention(qg, k_cache, v_cache, g.block_tables, g.prefix_lens, g.tree_mask,
                                        context=g.context, sliding_window=self.sliding_window
                                        ).reshape(g.batch * g.length, Hq * D))
        attn = parts[0] if len(parts) == 1 else torch.cat(parts)
        h = h + self.o_proj(attn)

        gate_up = self.gate_up_proj(norm(h, self.mlp_norm, c.rms_norm_eps))   # [N, 2I]
        if fused:
            return h + self.down_proj(cpu_kernels.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def __getstate__(self) -> dict:
        """Copies and pickles leave the C operand behind (raw pointers into this layer's tensors)."""
        return {**self.__dict__, "_c_layer": None, "_c_seen": None}

    def _c_operand(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "cpu_kernels.SfLayer":
        """This layer for `kernels.cpu.DecoderStep.layers`, built again when a norm, a weight or a
        bias (changed in place or replaced), the format of a weight's few-row copy
        (`PackedWeight._few_row_copy`) or the cache pages change. Every forward asks each
        layer: while the same tensors at the same versions, the same formats and the same pages
        are found (`_c_watched`, no `nn.Module` lookups), the operand is the one found last."""
        tensors, formats = self._c_watched()
        seen = (k_cache.data_ptr(), v_cache.data_ptr(), formats, [t._version for t in tensors])
        last = self._c_seen
        if last is not None and last[0] == seen and all(a is b for a, b in zip(last[1], tensors)):
            return self._c_layer
        self._c_layer = self._c_build(k_cache, v_cache)
        self._c_seen = (seen, tensors)
        return self._c_layer

    def _c_watched(self) -> tuple[list[torch.Tensor], tuple]:
        """What the C operand is built from, read from the modules' dicts: the norms and the
        four linears' weights and biases, and the formats their few-row copies take."""
        params, modules = self.__dict__["_parameters"], self.__dict__["_modules"]
        tensors, formats = [params["attn_norm"], params["mlp_norm"]], [linear_module.FP32_PANELS]
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            m = modules[name].__dict__
            tensors.append(m["_parameters"]["weight"])
            if m["_parameters"]["bias"] is not None:
                tensors.append(m["_parameters"]["bias"])
            formats.append(m["_pack"].low)
        return tensors, tuple(formats)

    def _c_build(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "cpu_kernels.SfLayer":
        linears = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        copies = [m._pack._few_row_copy(m.weight) for m in linears]   # what the operands point into
        weights = [m._pack.operand(m.weight, m.bias, c) for m, c in zip(linears, copies)]
        return cpu_kernels.layer_operand(self.attn_norm, self.mlp_norm, weights, k_cache, v_cache,
                                         self.sliding_window is not None)

    def _rope_store(self, qkv, rope, k_cache, v_cache, slots, fused: bool) -> torch.Tensor:   # [N, Hq, D]
        """RoPE on the rows' q and k, their k and v written to their cache slots; returns q."""
        c = self.c
        N = qkv.shape[0]
        Hq, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        if fused:                          # in place, in one C call
            qkv = qkv.contiguous()
            cpu_kernels.rope_store(qkv, rope[0], rope[1], k_cache, v_cache, slots, Hq, Hkv, D)
            return qkv[:, :Hq * D].view(N, Hq, D)
        qk = apply_rope(qkv[:, : (Hq + Hkv) * D].view(N, Hq + Hkv, D), *rope)
        q, k = qk[:, :Hq], qk[:, Hq:]                                        # [N, Hq|Hkv, D]
        v = qkv[:, (Hq + Hkv) * D :].reshape(N, Hkv, D)
        k_cache.view(-1, Hkv, D).index_copy_(0, slots, k.reshape(N, Hkv, D))
        v_cache.view(-1, Hkv, D).index_copy_(0, slots, v)
        return q


@dataclass
class AttentionGroup:
    """Sequences of one forward whose new tokens attend together, padded to the longest of them
    (a packed forward holds several: `Transformer.forward_packed`). Rows of the packed [N, ...]
    tensors: `start` + b * `length` + t for sequence b's token t."""

    start: int                   # the group's first row
    batch: int                   # B_g sequences
    length: int                  # T_g rows each (padded)
    block_tables: torch.Tensor   # [B_g, W] int32
    prefix_lens: torch.Tensor    # [B_g] int32 cached tokens before this forward
    tree_mask: torch.Tensor      # [B_g, T_g, T_g] bool
    context: CpuAttentionContext | None = None   # on the CPU, built once per forward


@dataclass
class PackedInput:
    """One group's inputs to `Transformer.forward_packed`: B_g sequences of T_g new tokens."""

    seq_ids: list                # B_g cache sequence ids
    input_ids: torch.Tensor      # [B_g, T_g] int64
    positions: torch.Tensor      # [B_g, T_g] int64 RoPE positions
    tree_mask: torch.Tensor      # [B_g, T_g, T_g] bool
    features: torch.Tensor | None = None   # [B_g, T_g, hidden]: a feature-conditioned draft's input


class Transformer(nn.Module):
    graphs = None   # models.cuda_graphs.GraphedLayers once enabled (CUDA only)
    # with `return_hidden`, the outputs of these layers (0-based, increasing) come before the
    # final-norm state: hidden [..., feature_width] (an EAGLE-3 head fuses them; `set_feature_layers`)
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, config.window_of(i)) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (
            None if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.requires_grad_(False)
        self._lm_head_pack = PackedWeight(transposed_gemv=True)
        rope_type = (config.rope_scaling or {}).get("rope_type", "default")
        self._dynamic_rope = rope_type == "dynamic"
        inv_freq, self._rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)   # [D/2] float32
        self._c_table: tuple | None = None   # (the layers' C operands, their ctypes array): `_c_layers`

    def __getstate__(self) -> dict:
        """Copies and pickles leave the C layer table behind (raw pointers, `_c_layers`)."""
        return {**super().__getstate__(), "_c_table": None}

    def set_feature_layers(self, layers) -> None:
        """Return the outputs of `layers` (0-based, increasing) beside the final-norm state from now on."""
        layers = tuple(int(i) for i in layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < self.config.num_layers for i in layers):
            raise ValueError(f"feature layers {list(layers)} must be increasing layer indices of "
                             f"a {self.config.num_layers}-layer model")
        self.feature_layers = layers

    @property
    def feature_width(self) -> int:
        """The width of the hidden states `return_hidden` gives: (len(feature_layers) + 1) * hidden."""
        return (len(self.feature_layers) + 1) * self.config.hidden_size

    @property
    def lm_head_weight(self) -> torch.Tensor:   # [V, hidden]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False) -> PagedKVCache:
        """A cache shaped for this model, on its device and in its dtype."""
        c, w = self.config, self.embed_tokens.weight
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, w.dtype, w.device,
                            prefix_caching=prefix_caching)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., T] int64 → cos, sin [..., T, 1, D/2] in the model dtype."""
        inv_freq = self.inv_freq
        if self._dynamic_rope:
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
            inv_freq = rope_inv_freq(self.config, seq_len)[0].to(positions.device)
        angles = positions[..., None].float() * inv_freq                # [B, T, D/2]
        dtype = self.embed_tokens.weight.dtype
        cos = (angles.cos() * self._rope_scale).to(dtype).unsqueeze(-2)
        sin = (angles.sin() * self._rope_scale).to(dtype).unsqueeze(-2)
        return cos, sin

    def forward(
        self,
        input_ids: torch.Tensor,     # [B, T] int64
        positions: torch.Tensor,     # [B, T] int64 RoPE positions
        cache: PagedKVCache,
        seq_ids: Sequence[Hashable],
        tree_mask: torch.Tensor,     # [B, T, T] bool: node j is node i or its ancestor
        logit_rows: torch.Tensor | None = None,       # [V'] int64 rows of the LM head
        return_hidden: bool = False,
        logit_positions: torch.Tensor | None = None,  # [T'] or [B, T'] int64 indices into T
        features: torch.Tensor | None = None,         # [B, T, hidden]: a feature-conditioned draft's input
    ):
        """Append T tokens per sequence to the cache and return their logits.

        Returns logits `[B, T, V] float32` (`T'` for `logit_positions`, `V'` for
        `logit_rows`), or `(logits, hidden [B, T, feature_width])` with `return_hidden`;
        hidden is the final-norm output that the LM head reads (after the `feature_layers`'
        outputs, where set). Each sequence is
        T longer afterwards; on any error the cache is left as it was.
        """
        B, T = input_ids.shape
        prefix = [cache.seq_len(s) for s in seq_ids]
        _reserve_all(cache, seq_ids, T)
        try:
            hidden = self._hidden(input_ids, positions, cache, seq_ids, tree_mask, prefix, features)
        except BaseException:
            for s, p in zip(seq_ids, prefix):
                cache.truncate(s, p)
            raise
        logits = self.logits(hidden, logit_rows, logit_positions)
        return (logits, hidden) if return_hidden else logits

    def _inputs(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """The first layer's input [B, T, hidden]: the token embeddings."""
        if features is not None:
            raise ValueError(f"{type(self).__name__} takes no input features (only a feature-conditioned draft does)")
        return self.embed_tokens(input_ids)

    def _hidden(self, input_ids, positions, cache, seq_ids, tree_mask, prefix, features=None) -> torch.Tensor:
        """Run the layers; returns the final-norm hidden states [B, T, hidden]."""
        block_tables = cache.block_table(seq_ids)                              # [B, W] int32
        if self.graphs is not None:
            hidden = self.graphs(input_ids, positions, cache, block_tables, tree_mask, prefix, features)
            if hidden is not None:
                return hidden
        prefix_lens = torch.tensor(prefix, dtype=torch.int32, device=input_ids.device)   # [B]
        return self._layers(input_ids, positions, cache, block_tables, prefix_lens, tree_mask, features)

    def _layers(self, input_ids, positions, cache, block_tables, prefix_lens, tree_mask, features=None):
        """The layers on device tensors alone (no host reads): what a CUDA graph captures.
        One group of B sequences, T tokens each → [B, T, hidden]."""
        B, T = input_ids.shape
        group = self._group(0, cache, block_tables, prefix_lens, tree_mask)
        slots = self._slots(cache, group)
        feats = None if features is None else features.reshape(B * T, -1)
        return self._packed_layers(input_ids.reshape(B * T), positions.reshape(B * T), cache, slots, [group],
                                   feats).view(B, T, -1)

    def forward_packed(self, groups: Sequence[PackedInput], cache: PagedKVCache) -> torch.Tensor:
        """One forward over several groups of sequences: each group is padded to its own longest
        sequence only, the token-wise work runs on every group's rows at once and attention per
        group (`models.tree.ragged_tree_forward` groups a batch of very different sizes, such as
        a prompt's chunk beside small trees, this way). Every sequence grows by its group's T_g;
        on any error every cache is left as it was. Returns the final-norm hidden states of all
        rows, [sum of B_g * T_g, feature_width], group by group (`AttentionGroup` rows)."""
        device = self.embed_tokens.weight.device
        seq_ids = [s for g in groups for s in g.seq_ids]
        prefix = [cache.seq_len(s) for s in seq_ids]
        done: list[tuple[Hashable, int]] = []
        try:
            for g in groups:
                _reserve_all(cache, g.seq_ids, int(g.input_ids.shape[1]))
                done += [(s, p) for s, p in zip(g.seq_ids, prefix[len(done):len(done) + len(g.seq_ids)])]
            if len(groups) == 1:          # one group: the plain path (CUDA graphs where captured)
                g = groups[0]
                feats = None if g.features is None else g.features.to(device)
                return self._hidden(g.input_ids.to(device), g.positions.to(device), cache, g.seq_ids,
                                    g.tree_mask.to(device), prefix, feats).flatten(0, 1)
            attn, slots, start, at = [], [], 0, 0
            for g in groups:
                B, T = g.input_ids.shape
                table = cache.block_table(g.seq_ids)
                lens = torch.tensor(prefix[at:at + B], dtype=torch.int32, device=device)
                mask = g.tree_mask.to(device)
                attn.append(self._group(start, cache, table, lens, mask))
                slots.append(self._slots(cache, attn[-1]))
                start, at = start + B * T, at + B
            feats = None
            if any(g.features is not None for g in groups):
                feats = torch.cat([g.features.reshape(-1, g.features.shape[-1]) for g in groups]).to(device)
            return self._packed_layers(torch.cat([g.input_ids.reshape(-1) for g in groups]).to(device),
                                       torch.cat([g.positions.reshape(-1) for g in groups]).to(device),
                                       cache, torch.cat(slots), attn, feats)
        except BaseException:
            for s, p in done:
                cache.truncate(s, p)
            raise

    def _group(self, start: int, cache, block_tables, prefix_lens, tree_mask) -> AttentionGroup:
        B, T = tree_mask.shape[0], tree_mask.shape[1]
        context = None            # on the CPU, what every layer's attention shares, built once
        if not tree_mask.is_cuda:
            context = CpuAttentionContext(block_tables, prefix_lens, tree_mask, cache.block_size,
                                          self.config.num_heads, self.config.num_kv_heads, self.config.sliding_window)
        return AttentionGroup(start, B, T, block_tables, prefix_lens, tree_mask, context)

    def _slots(self, cache, group: AttentionGroup) -> torch.Tensor:    # [B * T] int64
        """The cache slot each new row is written to: laid out by the C call that lays out what
        the rows see where the C attention reads that (`CpuAttentionContext.ordered`)."""
        if group.context is not None and cpu_kernels.layer_ops_apply(cache.k[0], self.config.head_dim):
            group.context.ordered(False)
            return group.context.rows()
        prefix_lens, bs = group.prefix_lens, cache.block_size
        pos = prefix_lens[:, None].long() + torch.arange(group.length, device=prefix_lens.device)   # [B, T]
        return (group.block_tables.long().gather(1, pos // bs) * bs + pos % bs).reshape(-1)

    def _packed_layers(self, input_ids, positions, cache, slots, groups, features=None) -> torch.Tensor:
        """input_ids, positions, slots: [N]; features: [N, hidden] or None → [N, feature_width]."""
        rope = self.rope(positions)
        h = self._inputs(input_ids, features)
        step = self._decoder_step(h, rope, slots, groups, cache)
        taken = []
        if step is not None:                    # the layers in C, h updated in place, one call a run
            h, table, start = h.contiguous().clone(), self._c_layers(cache), 0
            for stop in sorted({i + 1 for i in self.feature_layers} | {len(table)}):
                step.layers(table, h, start, stop)
                if stop - 1 in self.feature_layers:
                    taken.append(h.clone())
                start = stop
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, cache.k[i], cache.v[i], slots, groups)
                if i in self.feature_layers:
                    taken.append(h.clone())
        norm = cpu_kernels.rms_norm if cpu_kernels.layer_ops_apply(h, self.config.head_dim) else rms_norm
        out = norm(h, self.norm, self.config.rms_norm_eps)
        return torch.cat(taken + [out], dim=-1) if taken else out

    def runs_layers_in_c(self, rows: int, x: torch.Tensor, cache) -> bool:
        """Whether a forward of `rows` rows (its activations like `x`) runs its decoder layers in
        the whole-layer C call: 1 to 16 rows, CPU float32 weights, activations and cache, no
        gradient, the C library built."""
        return (1 <= rows <= cpu_kernels.MAX_ROWS and cache.k[0].dtype == torch.float32
                and self.layers[0].qkv_proj.weight.dtype == torch.float32
                and cpu_kernels.layer_ops_apply(x, self.config.head_dim) and cpu_kernels.decoder_layer_available())

    def _c_layers(self, cache):
        """Every layer's C operand (`DecoderLayer._c_operand`) as one ctypes array
        (`kernels.cpu.layer_table`), built again when one of them is."""
        operands = [layer._c_operand(cache.k[i], cache.v[i]) for i, layer in enumerate(self.layers)]
        last = self._c_table
        if last is None or len(last[0]) != len(operands) or any(a is not b for a, b in zip(last[0], operands)):
            self._c_table = last = (operands, cpu_kernels.layer_table(operands))
        return last[1]

    def _decoder_step(self, h, rope, slots, groups, cache) -> "cpu_kernels.DecoderStep | None":
        """The whole-layer C call's per-forward half, where it applies: a CPU fp32 forward of 1 to
        16 rows (the few-row matmul's), every group with its CPU attention context, the C
        library built; else None (each layer runs its steps from Python)."""
        c, N = self.config, h.shape[0]
        if not (groups and all(g.context is not None for g in groups) and self.runs_layers_in_c(N, h, cache)):
            return None
        ordered = {w: CpuAttentionContext.ordered_rows([g.context for g in groups], w)
                   for w in groups[0].context.windows}
        return cpu_kernels.DecoderStep(N, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                       c.intermediate_size, c.rms_norm_eps, 1.0 / math.sqrt(c.head_dim),
                                       rope[0], rope[1], slots, ordered)

    def logits(
        self,
        hidden: torch.Tensor,                         # [B, T, hidden] (or [M, hidden] without positions)
        logit_rows: torch.Tensor | None = None,       # [V'] int64
        logit_positions: torch.Tensor | None = None,  # [T'] or [B, T'] int64
    ) -> torch.Tensor:                                # [B, T' or T, V' or V] float32 ([M, V'])
        H = self.config.hidden_size
        if hidden.shape[-1] != H:                     # [..., feature_width]: the final-norm state is last
            hidden = hidden[..., -H:]
        if logit_positions is not None:
            if logit_positions.dim() == 1:
                hidden = hidden[:, logit_positions]
            else:
                index = logit_positions[..., None].expand(-1, -1, hidden.shape[-1])
                hidden = hidden.gather(1, index)
        if logit_rows is not None:
            return F.linear(hidden, self.lm_head_weight.index_select(0, logit_rows)).float()
        return self._lm_head_pack.matmul(hidden, self.lm_head_weight, None).float()


def _reserve_all(cache: PagedKVCache, seq_ids: Sequence[Hashable], n: int | Sequence[int]) -> None:
    """Reserve n slots (or n[i] in sequence i) in every sequence, or in none (OutOfBlocks re-raised)."""
    counts = [n] * len(seq_ids) if isinstance(n, int) else list(n)
    done: list[tuple[Hashable, int]] = []
    try:
        for s, count in zip(seq_ids, counts):
            length = cache.seq_len(s)
            cache.reserve(s, count)
            done.append((s, length))
    except (OutOfBlocks, KeyError):
        for s, length in done:
            cache.truncate(s, length)
        raise


def causal_mask(batch: int, length: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Tree mask of a chain (prefill or a draft chain): [batch, length, length] bool."""
    mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return mask.expand(batch, length, length)
