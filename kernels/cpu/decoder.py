"""A whole decoder layer in one call (kernels/cpu/decoder_layer.c), and a greedy draft chain's
levels in one call: the ctypes structures the C side reads, `DecoderStep` (what a forward's
layers share) and `draft_chains`. Re-exported by `kernels.cpu`."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import MAX_ROWS, CpuKernelError, _holds_panels, _load, lay_cuts

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64
_KINDS = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
_PANELS = 3


class SfWeight(ctypes.Structure):
    """A matmul's weight as `decoder_layer` reads it (the C sf_weight): raw pointers, so whoever
    builds one keeps its tensors alive."""

    _fields_ = [("w", _ptr),           # [out, in] float32, float16 or int8, contiguous
                ("scales", _ptr),      # [out] float32 (int8 only) or NULL
                ("bias", _ptr),        # [out] float32 or NULL
                ("kind", _i64)]        # 0 float32, 1 float16, 2 int8, 3 float32 panels (`panel_pack`)


class SfLayer(ctypes.Structure):
    """A decoder layer's parameters and cache pages (the C sf_layer)."""

    _fields_ = [("attn_norm", _ptr), ("mlp_norm", _ptr),              # [H] float32
                ("qkv", SfWeight), ("o", SfWeight), ("gate_up", SfWeight), ("down", SfWeight),
                ("k_cache", _ptr), ("v_cache", _ptr),                 # [.., block_size, Hkv, D] float32
                ("windowed", _i64)]                                   # reads the windowed visibility


class SfForward(ctypes.Structure):
    """What every layer of one forward shares (the C sf_forward; `DecoderStep` owns its tensors)."""

    _fields_ = [("N", _i64), ("H", _i64), ("Hq", _i64), ("Hkv", _i64), ("D", _i64), ("I", _i64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("cos", _ptr), ("sin", _ptr),                         # [N, D/2]
                ("slots", _ptr),                                      # [N] int64
                ("vis", _ptr * 2), ("counts", _ptr * 2), ("S", _i64 * 2),   # full, windowed
                ("xn", _ptr), ("qkv", _ptr), ("attn", _ptr), ("tmp", _ptr), ("gu", _ptr), ("act", _ptr),
                ("scratch", _ptr),
                ("threads", _i64)]


def decoder_layer_available() -> bool:
    lib = _load()
    return lib is not None and hasattr(lib, "sf_decoder_layers")


def weight_operand(weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scales: torch.Tensor | None = None) -> SfWeight:
    """weight [out, in] (float32, float16, or int8 with `scales` [out]) and bias [out] as an SfWeight."""
    if weight.dtype not in _KINDS or weight.dim() != 2 or not weight.is_contiguous() or weight.device.type != "cpu":
        raise ValueError("a decoder_layer weight is a contiguous 2-D CPU float32, float16 or int8 tensor")
    if (weight.dtype == torch.int8) != (scales is not None):
        raise ValueError("an int8 weight takes scales (float32, one per weight row), and only it")
    _check_rows_vectors(weight.shape[0], scales, bias)
    return SfWeight(weight.data_ptr(), 0 if scales is None else scales.data_ptr(),
                    0 if bias is None else bias.data_ptr(), _KINDS[weight.dtype])


def _check_rows_vectors(n: int, *vectors: torch.Tensor | None) -> None:
    """A decoder_layer weight's scales and bias: each None or contiguous float32 [n]."""
    for v in vectors:
        if v is not None and (v.dtype != torch.float32 or v.shape != (n,) or not v.is_contiguous()):
            raise ValueError(f"scales and bias must be contiguous float32 [{n}]")


def panel_operand(panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> SfWeight:
    """The `panel_pack` panels of a float32 weight [n, K] and its bias [n] as an SfWeight."""
    if not _holds_panels(panels, n):
        raise ValueError(f"not the panels of a weight of {n} rows")
    _check_rows_vectors(n, bias)
    return SfWeight(panels.data_ptr(), 0, 0 if bias is None else bias.data_ptr(), _PANELS)


def layer_operand(attn_norm: torch.Tensor, mlp_norm: torch.Tensor, weights: list[SfWeight],
                  k_cache: torch.Tensor, v_cache: torch.Tensor, windowed: bool) -> SfLayer:
    """A layer's SfLayer: its norms, its qkv, o, gate_up and down weights (`weight_operand`),
    its cache pages and whether it reads the windowed visibility."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == torch.float32):
        raise ValueError("decoder_layer takes contiguous float32 cache pages")
    return SfLayer(attn_norm.data_ptr(), mlp_norm.data_ptr(), *weights, k_cache.data_ptr(), v_cache.data_ptr(),
                   int(windowed))


class DecoderStep:
    """One forward's shared half of `decoder_layer`: N rows (1 to MAX_ROWS) of hidden size H, the
    model's shapes, the rows' RoPE (cos, sin: N * D/2 values each) and cache slots [N] int64, and
    each row's ordered visible slots (`ordered[windowed]` = ([N, S] int64, [N] int64), see
    `tree_attention`; `ordered[True]` only where the model has a sliding window). Holds the
    scratch rows every layer reuses."""

    def __init__(self, rows: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, ordered: dict[bool, tuple[torch.Tensor, torch.Tensor]]) -> None:
        N, D = rows, head_dim
        if not 1 <= N <= MAX_ROWS:
            raise ValueError(f"decoder_layer takes 1 to {MAX_ROWS} rows, got {N}")
        full = ordered[False]
        windowed = ordered.get(True, full)
        self._keep = [t.contiguous() for t in (cos, sin, slots, *full, *windowed)]
        cos, sin, slots, vis0, cnt0, vis1, cnt1 = self._keep
        if not (cos.numel() == sin.numel() == N * D // 2 and slots.numel() == N and vis0.shape[0] == N
                and vis1.shape[0] == N and slots.dtype == vis0.dtype == vis1.dtype == torch.long):
            raise ValueError("DecoderStep: rope, slots and visible rows must match the rows")
        threads = torch.get_num_threads()
        S = max(vis0.shape[1], vis1.shape[1], 1)
        e = lambda *shape: torch.empty(*shape, dtype=torch.float32)   # noqa: E731
        self._scratch = [e(N, hidden), e(N, (num_heads + 2 * num_kv_heads) * D), e(N, num_heads * D),
                         e(N, hidden), e(N, 2 * intermediate), e(N, intermediate), e(max(threads, 1) * S)]
        p = [t.data_ptr() for t in self._scratch]
        self._f = SfForward(N, hidden, num_heads, num_kv_heads, D, intermediate, eps, scale,
                            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                            (_ptr * 2)(vis0.data_ptr(), vis1.data_ptr()), (_ptr * 2)(cnt0.data_ptr(), cnt1.data_ptr()),
                            (_i64 * 2)(vis0.shape[1], vis1.shape[1]), *p, threads)
        self._ref = ctypes.byref(self._f)
        self.rows, self.hidden = N, hidden

    def layers(self, table, h: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """h [N, H] float32 contiguous, updated in place by the decoder layers table[start:stop]
        in turn (`table`: a ctypes array of SfLayer, `layer_table`), in one call; returns h."""
        stop = len(table) if stop is None else stop
        if h.shape != (self.rows, self.hidden) or not h.is_contiguous():
            raise ValueError(f"decoder_layer: h must be contiguous [{self.rows}, {self.hidden}]")
        if not 0 <= start <= stop <= len(table):
            raise ValueError(f"decoder_layer: layers {start}..{stop} of {len(table)}")
        rc = _load().sf_decoder_layers(ctypes.byref(table, start * ctypes.sizeof(SfLayer)), stop - start,
                                       self._ref, h.data_ptr())
        if rc != 0:
            raise CpuKernelError(f"sf_decoder_layer failed ({rc})")
        return h


def layer_table(layers: list[SfLayer]):
    """The layers' operands as the contiguous ctypes array `DecoderStep.layers` and
    `draft_chains` read."""
    return (SfLayer * len(layers))(*layers)


def draft_chains(step: DecoderStep, table, first_tokens: torch.Tensor, first_pick: torch.Tensor,
                 levels: int, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
                 counts: torch.Tensor, embed: torch.Tensor, norm: torch.Tensor, head: SfWeight, vocab: int,
                 rows: torch.Tensor | None, fc: SfWeight | None = None,
                 first_features: torch.Tensor | None = None, temps: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, cuts: tuple[torch.Tensor, ...] | None = None,
                 history: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor | None, ...]:
    """A greedy draft pass of B chains in one call (sf_draft_chains), through the layers of
    `table` (`layer_table`): the catch-up's rows feed
    first_tokens [R] (R = step.rows >= B), chain b's root at row first_pick[b], and choose each
    chain's first token; then `levels` levels of one row a chain each choose the next. cos,
    sin [R + levels * B, D/2], slots [..], visible [.., S] and counts [..] are the rows', the
    catch-up's first, then level by level; embed [V_all, H] and norm [H] float32, the head
    [vocab, H] as an SfWeight, `rows` [vocab] int64 its rows' token ids or None →
    (tokens [levels + 1, B] int64: each level's choice, log q [levels + 1, B] float32, features,
    q).

    A feature-conditioned draft (EAGLE) passes its `fc` [H, 2H] as an SfWeight and the
    catch-up's features `first_features` [R, H] float32; each level's rows read their parent's
    final-norm state, which come back as features [levels + 1, B, H] float32 (level d's: what
    chain b's node at depth d predicted; else None). Sampled chains pass `temps` [B] float32 (0:
    that chain greedy) and `noise` [levels + 1, B, vocab] float32 (Gumbel); each level draws its
    token as the largest logit / temperature + noise, and q [levels + 1, B, vocab] float32 comes
    back, the softmax each draw came from (else None). `cuts`: each chain's min-p [B] float32,
    top-k [B] int64 and top-p [B] float32 (0, 0, 1: none), applied to its draws as
    `models.sampling.logits_to_probs` applies them (sample_cut.c); q is then the cut's.
    `history` (with temps): each chain's history transforms, (bias [B, vocab] float32, counts
    [B, vocab] float32, seen [B, vocab] uint8, stops [B, vocab] uint8, stop_levels [B] int64,
    penalties [B, 3] float32) as `models.draft_chain._stack_history` lays them out, applied to
    each level's logits before its pick (sf_history_apply); counts and seen are updated in place."""
    R, B, H = step.rows, first_pick.shape[0], step.hidden
    total = R + levels * B
    tensors = [t.contiguous() for t in (first_tokens, first_pick, cos, sin, slots, visible, counts, embed, norm)]
    first_tokens, first_pick, cos, sin, slots, visible, counts, embed, norm = tensors
    if not (first_tokens.shape == (R,) and 1 <= B <= R and slots.shape == (total,) and counts.shape == (total,)
            and visible.shape == (total, step._f.S[0]) and cos.numel() == sin.numel() == total * step._f.D // 2
            and embed.shape[1] == H and norm.shape == (H,) and (rows is None or rows.shape == (vocab,))
            and 0 <= int(first_pick.min()) and int(first_pick.max()) < R):
        raise ValueError("draft_chains: the rows do not match the step")
    if (fc is None) != (first_features is None):
        raise ValueError("draft_chains: a feature-conditioned draft passes fc and the catch-up's features together")
    sampled = _sampled_operands(B, levels, vocab, temps, noise, cuts, history)
    features = x2 = None
    if fc is not None:
        first_features = first_features.contiguous()
        if first_features.shape != (R, H) or first_features.dtype != torch.float32:
            raise ValueError(f"draft_chains: the catch-up's features must be float32 [{R}, {H}]")
        features, x2 = torch.empty(levels + 1, B, H), torch.empty(R, 2 * H)
    tokens = torch.empty(levels + 1, B, dtype=torch.long)
    log_q = torch.empty(levels + 1, B, dtype=torch.float32)
    h, picked_h, hn = torch.empty(R, H), torch.empty(B, H), torch.empty(B, H)
    logits, picked = torch.empty(B, vocab), torch.empty(B, dtype=torch.long)
    rows_c = None if rows is None else rows.to(torch.long).contiguous()
    ptr = lambda t: None if t is None else t.data_ptr()   # noqa: E731
    rc = _load().sf_draft_chains(table, len(table), ctypes.byref(step._f), B, R, first_tokens.data_ptr(),
                                 first_pick.data_ptr(), levels, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                                 visible.data_ptr(), counts.data_ptr(), embed.data_ptr(), norm.data_ptr(),
                                 ctypes.byref(head), vocab, ptr(rows_c), tokens.data_ptr(), log_q.data_ptr(),
                                 h.data_ptr(), picked_h.data_ptr(), hn.data_ptr(), logits.data_ptr(),
                                 picked.data_ptr(), None if fc is None else ctypes.byref(fc), ptr(first_features),
                                 ptr(features), ptr(x2), *sampled.pointers())
    if rc != 0:
        raise CpuKernelError(f"sf_draft_chains failed ({rc})")
    return tokens, log_q, features, sampled.q


@dataclass
class _Sampled:
    """`draft_chains`' sampled operands, checked and laid out for C (all None: a greedy pass)."""

    temps: torch.Tensor | None = None       # [B] float32, 0: that chain greedy
    noise: torch.Tensor | None = None       # [levels + 1, B, vocab] float32 Gumbel
    q: torch.Tensor | None = None           # [levels + 1, B, vocab] float32, written by C
    min_p: torch.Tensor | None = None       # [B] float32
    top_k: torch.Tensor | None = None       # [B] int64
    top_p: torch.Tensor | None = None       # [B] float32
    history: list[torch.Tensor] | None = None   # bias, counts, seen, stops [B, vocab]; stop_levels [B];
                                                # penalties [B, 3] (`draft_chains`' doc)

    def pointers(self) -> list:
        """The operands' data pointers in sf_draft_chains' order (None where absent)."""
        history = self.history or [None] * 6
        return [None if t is None else t.data_ptr()
                for t in (self.temps, self.noise, self.q, self.min_p, self.top_k, self.top_p, *history)]


def _sampled_operands(B: int, levels: int, vocab: int, temps, noise, cuts, history) -> _Sampled:
    """Checks `draft_chains`' temps, noise, cuts and history (its doc) and lays them out."""
    out = _Sampled()
    if (temps is None) != (noise is None):
        raise ValueError("draft_chains: sampled chains pass their temperatures and their noise together")
    if temps is None:
        if cuts is not None or history is not None:
            raise ValueError("draft_chains: cuts and history transforms come with the sampled pass's operands")
        return out
    out.temps, out.noise = temps.float().contiguous(), noise.float().contiguous()
    if out.temps.shape != (B,) or out.noise.shape != (levels + 1, B, vocab):
        raise ValueError(f"draft_chains: temps [{B}] and noise [{levels + 1}, {B}, {vocab}] expected")
    out.q = torch.empty(levels + 1, B, vocab)
    if cuts is not None:
        out.min_p, out.top_k, out.top_p = lay_cuts(cuts)
        if not out.min_p.shape == out.top_k.shape == out.top_p.shape == (B,):
            raise ValueError(f"draft_chains: min-p, top-k and top-p [{B}] expected")
    if history is not None:
        dtypes = (torch.float32, torch.float32, torch.uint8, torch.uint8, torch.long, torch.float32)
        out.history = [t.to(dtype).contiguous() for t, dtype in zip(history, dtypes)]
        shapes = [(B, vocab)] * 4 + [(B,), (B, 3)]
        if [tuple(t.shape) for t in out.history] != shapes:
            raise ValueError(f"draft_chains: history transforms {shapes} expected")
    return out
