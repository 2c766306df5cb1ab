"""Per-request sampling parameters and the one logits → probabilities transform.

Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) holds for
the *processed* distributions only if the target's p and the draft's q go
through the same transform, so every caller uses these two functions, in order:

1. `process_logits` — what depends on the tokens before a row: `logit_bias`, `min_tokens`
   (EOS and stop ids masked while fewer tokens were generated), `repetition_penalty` (over
   prompt and output, as in vLLM / CTRL, Keskar et al. 2019), then `frequency_penalty` and
   `presence_penalty` (over the output, as OpenAI defines them). A tree node's row reads the
   committed tokens plus the path to it (`TokenHistory`), so p and q of every node see the
   same context, and a rollback restores it by construction (it is recomputed from the path).
   Last, a grammar (`grammar`, structured output: `models.grammar`) masks the tokens it does
   not allow after that same context, on both sides (the draft's q only with `GrammarSpec.draft`).
2. `logits_to_probs` — temperature, then `min_p` (relative to the most likely token, vLLM's
   order), then top-k, then top-p (nucleus, Holtzman et al. 2020), in float32.
   Temperature 0 is greedy: a one-hot at the argmax of the processed logits.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kernels import cpu as cpu_kernels
from models.grammar import GrammarSpec, grammar_mask

MAX_LOGIT_BIAS = 100.0      # OpenAI's range for a logit_bias value
MAX_LOGPROBS = 20           # OpenAI's limit on top log-probabilities per token


@dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    seed: int | None = None         # None = not reproducible
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0   # subtracted once from a token already in the output; [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output; [-2, 2]
    repetition_penalty: float = 1.0  # > 1 discourages tokens of prompt and output; 1 = off
    logit_bias: list[tuple[int, float]] = field(default_factory=list)   # (token, bias in [-100, 100])
    min_p: float = 0.0              # drop tokens below min_p x the top token's probability; 0 = off
    min_tokens: int = 0             # EOS and stop ids are masked until this many are generated
    logprobs: int | None = None     # None: none; k: each token's log-probability and the top k
    prompt_logprobs: int | None = None   # the same for the prompt's tokens (an echo); None: none
    grammar: GrammarSpec | None = None   # structured output: only tokens it allows (a dict on the wire)
    # Set by the engine when it admits the request (both sides read them): where the output
    # starts in the committed tokens, and the EOS ids `min_tokens` masks beside stop_token_ids.
    prompt_len: int = 0
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {m!r}")
        bad = [s for s in self.stop_token_ids if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad!r}")
        self.temperature, self.top_p = float(t), float(p)
        self.stop_token_ids = list(self.stop_token_ids)
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                             ("repetition_penalty", 0.0, math.inf), ("min_p", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not lo <= v <= hi or (name == "repetition_penalty" and v == 0):
                raise ValueError(f"{name} must be a number in {'(0, inf)' if hi == math.inf else [lo, hi]}, "
                                 f"got {v!r}")
            setattr(self, name, float(v))
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")
        for name in ("min_tokens", "prompt_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        pairs = sorted((int(tok), float(b)) for tok, b in bias)    # a dict, or pairs (the wire's form)
        if any(tok < 0 or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for tok, b in pairs):
            raise ValueError(f"logit_bias maps token ids >= 0 to numbers in [-100, 100], got {pairs[:5]!r}")
        self.logit_bias = pairs
        self.eos_token_ids = list(self.eos_token_ids)
        if isinstance(self.grammar, dict):
            self.grammar = GrammarSpec(**self.grammar)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec or None, got {self.grammar!r}")
        if self.grammar is not None and (self.min_tokens or self.ignore_eos):
            raise ValueError(f"{'min_tokens' if self.min_tokens else 'ignore_eos'} cannot be combined with "
                             f"structured output: the grammar decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """A seeded sampled request: its tokens are `argmax(log p + G)` with Gumbel noise keyed by
        (seed, output position) (`gumbel_noise`), the same whatever drafted them."""
        return self.seed is not None and not self.greedy

    @property
    def reads_q(self) -> bool:
        """Whether verification reads the draft's q (rejection sampling: unseeded sampling). Greedy
        and seeded requests walk the tree on one token a row, so their trees ship none."""
        return not self.greedy and not self.coupled

    @property
    def reads_history(self) -> bool:
        """Whether a row's distribution depends on the tokens before it (`process_logits`)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.grammar is not None)

    @property
    def stop_ids(self) -> list[int]:
        """The tokens that end the output, sorted: the engine's EOS ids and the request's stop ids
        (what min_tokens masks and a grammar's end accepts)."""
        return sorted(set(self.eos_token_ids) | set(self.stop_token_ids))


@dataclass
class TokenHistory:
    """The tokens before each row of a logits matrix: the sequence's committed tokens (prompt
    + output, `params.prompt_len` of them the prompt), then per row the tree path to it."""

    committed: Sequence[int]         # prompt + committed output
    paths: Sequence[Sequence[int]]   # per row: the drafted tokens after `committed` ([] = the root's row)
    draft: bool = False              # the rows are the draft's q (a grammar may leave q free)


def process_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory | None,
                   columns: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] → logits [N, V] float32 after the history-dependent transforms (module doc);
    `logits` itself unchanged when `params.reads_history` is false. `columns` [V'] int64: the
    logits are those tokens' alone ([N, V'], a reduced draft head's rows): every transform is
    the token's own, so each column gets what the whole vocabulary's would at its token."""
    if not params.reads_history:
        return logits
    if history is None or len(history.paths) != logits.shape[0]:
        raise ValueError("these sampling parameters need the tokens before each row (a TokenHistory)")
    logits = logits.float().clone()
    vocab = logits.shape[1] if columns is None else int(columns.max()) + 1    # the token ids the columns reach
    column_of = _column_map(columns, vocab, logits.device)                     # token id -> column, -1: none
    if params.logit_bias:
        tokens = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab]).to(logits.device)
        at = column_of[tokens.to(logits.device)]
        logits[:, at[at >= 0]] += bias[at >= 0]
    output = torch.tensor(list(history.committed[params.prompt_len:]), dtype=torch.long)
    paths = [torch.tensor(list(p), dtype=torch.long) for p in history.paths]
    if params.min_tokens:
        stops = torch.tensor(params.stop_ids, dtype=torch.long)
        stops = column_of[stops[stops < vocab].to(logits.device)]
        stops = stops[stops >= 0]
        short = torch.tensor([len(output) + len(p) < params.min_tokens for p in paths])   # [N]
        if len(stops) and short.any():
            rows = short.nonzero().squeeze(1).to(logits.device)
            logits[rows[:, None], stops[None, :]] = float("-inf")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        logits = _penalise(logits, params, history, output, paths, vocab, column_of)
    if params.grammar is not None and (params.grammar.draft or not history.draft):
        allowed = grammar_mask(params.grammar, params.stop_ids, output.tolist(), history.paths, vocab)
        allowed = allowed if columns is None else allowed[:, columns.to(allowed.device)]
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    return logits


@dataclass
class HistoryColumns:
    """One sequence's history transforms laid out over a draft head's columns, for a pass that
    applies them level by level itself (`models.draft_chain`, C's sf_history_apply): the same
    rules as `process_logits`, each drafted token joining `counts` and `seen` as it is drawn."""

    bias: torch.Tensor               # [V'] float32: logit_bias at each column's token (0: none)
    counts: torch.Tensor             # [V'] float32: the token's count in the output so far
    seen: torch.Tensor               # [V'] uint8: the token in the prompt or the output (repetition_penalty)
    stops: torch.Tensor              # [V'] uint8: a stop token (EOS or stop id), which min_tokens masks
    stop_levels: int                 # rows from the root's (path length 0) whose stops min_tokens masks
    penalties: tuple[float, float, float]   # (presence, frequency, repetition)


def history_columns(params: SamplingParams, committed: Sequence[int], columns: torch.Tensor | None,
                    vocab: int) -> HistoryColumns:
    """`committed` (prompt + output, `params.prompt_len` of them the prompt) as `HistoryColumns`
    over `columns` [V'] (token ids; None: all `vocab`); no grammar (its masks are not per token)."""
    if params.grammar is not None:
        raise ValueError("history_columns: a grammar's masks are not a column's own")
    column_of = _column_map(columns, vocab, "cpu")
    width = vocab if columns is None else columns.shape[0]
    cols = torch.arange(vocab) if columns is None else columns.long()
    bias = torch.zeros(width)
    for token, b in params.logit_bias:
        if token < vocab and column_of[token] >= 0:
            bias[column_of[token]] += b
    output = torch.tensor(list(committed[params.prompt_len:]), dtype=torch.long)
    counts = torch.bincount(output, minlength=vocab)[:vocab].float()
    prompt = torch.tensor(list(committed[:params.prompt_len]), dtype=torch.long)
    seen = counts > 0
    seen[prompt[prompt < vocab]] = True
    stops = torch.zeros(vocab, dtype=torch.bool)
    if params.min_tokens:
        ids = torch.tensor(params.stop_ids, dtype=torch.long)
        stops[ids[ids < vocab]] = True
    return HistoryColumns(bias, counts[cols], seen[cols].to(torch.uint8), stops[cols].to(torch.uint8),
                          max(0, params.min_tokens - len(output)) if params.min_tokens else 0,
                          (params.presence_penalty, params.frequency_penalty, params.repetition_penalty))


def _column_map(columns: torch.Tensor | None, vocab: int, device) -> torch.Tensor:   # -> [vocab] int64
    """Each token id's column among `columns` (-1: not a column); the identity without them."""
    if columns is None:
        return torch.arange(vocab, device=device)
    column_of = torch.full((vocab,), -1, dtype=torch.long, device=device)
    column_of[columns.to(device)] = torch.arange(columns.shape[0], device=device)
    return column_of


def _penalise(logits: torch.Tensor, params: SamplingParams, history: TokenHistory, output: torch.Tensor,
              paths: list[torch.Tensor], vocab: int, column_of: torch.Tensor) -> torch.Tensor:
    """`repetition_penalty`, then frequency and presence penalties, per row (`process_logits`),
    on the logits' columns (`column_of` [vocab]: each token id's column, -1: none). Only the tokens of the history
    (the output, each row's path, the prompt for repetition) can change: the rest are left as
    they are (x - 0 - 0 = x), and the few hundred that can are worked on alone."""
    prompt = torch.tensor(list(history.committed[:params.prompt_len]), dtype=torch.long)
    parts = [output, *paths] + ([prompt] if params.repetition_penalty != 1.0 else [])
    touched = torch.cat(parts).unique()                                           # sorted token ids
    touched = touched[touched < vocab]
    at = column_of[touched.to(column_of.device)].cpu()
    touched, at = touched[at >= 0], at[at >= 0]                                   # the columns' tokens
    if not len(touched):
        return logits
    counts = torch.stack([torch.bincount(torch.searchsorted(touched, t[torch.isin(t, touched)]),
                                         minlength=len(touched)) for t in (torch.cat([output, p]) for p in paths)])
    counts = counts.float().to(logits.device)                                     # [N, touched]
    at = at.to(logits.device)
    x = logits[:, at]
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | torch.isin(touched, prompt).to(logits.device)
        r = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    logits[:, at] = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
    return logits


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → probabilities [..., V] float32 after temperature, min-p, top-k, top-p
    (the logits already through `process_logits`)."""
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.min_p > 0:
        p = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), float("-inf"))
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]        # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))        # ties with the k-th stay
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        flat = probs.reshape(-1, vocab)
        probs = probs.masked_fill(_top_p_drop(flat, params.top_p).view_as(probs), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


TOP_P_FIRST = 64         # a top-p cut first looks among each row's 64 largest probabilities
TOP_P_BUCKETS = 4        # else: probability buckets per power of two in its histogram
TOP_P_MARGIN = 1e-4      # the mass beyond top_p the candidates must hold: float32 rounding of the sums


def _top_p_drop(probs: torch.Tensor, top_p: float) -> torch.Tensor:   # probs [R, V] -> [R, V] bool
    """Top-p (nucleus): in each row, sorted by probability descending (ties: lower token id
    first), drop every token whose probability mass before it is at least `top_p`; the first
    always stays. A full sort of the vocabulary costs ~3.5 ms a row here, and the cut lies among
    the largest probabilities: only candidates are sorted, tokens that hold more than top_p and
    are each larger than every other token, which the full sort drops too (its mass before ≥ the
    candidates'). The candidates: each row's tokens at least its `TOP_P_FIRST`-th largest
    probability; where those hold too little, the top buckets of a histogram of log2 p
    (`_top_p_buckets`). The cumulative sum of a prefix is the prefix of the cumulative sum, so
    the cut is the full sort's. On a GPU the sort is cheap and the candidates' host syncs are not:
    it sorts."""
    vocab = probs.shape[-1]
    if vocab > TOP_P_FIRST and probs.device.type == "cpu":
        top = probs.topk(TOP_P_FIRST, dim=-1).values                          # [R, 64], descending
        if bool((top.sum(-1) >= top_p + TOP_P_MARGIN).all()):
            return _top_p_drop_among(probs, probs >= top[:, -1:], top_p)
        cand = _top_p_buckets(probs, top_p)
        if cand is not None:
            return _top_p_drop_among(probs, cand, top_p)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p                   # the first token always stays
    return torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)


def _top_p_buckets(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:   # -> [R, V] bool
    """The tokens of each row's top log2 buckets (`TOP_P_BUCKETS` a power of two, down to 2**-64)
    that hold more than top_p, or None where some row's would not leave out most of the vocabulary."""
    rows, vocab = probs.shape
    n_buckets = 64 * TOP_P_BUCKETS
    bucket = (probs.log2() * -TOP_P_BUCKETS).nan_to_num_(n_buckets - 1.0).clamp_(0, n_buckets - 1).long()
    mass = probs.new_zeros(rows, n_buckets).scatter_add_(1, bucket, probs).cumsum(1)   # [R, buckets]
    last = (mass < top_p + TOP_P_MARGIN).sum(1, keepdim=True)                # [R, 1] the last bucket kept
    if not bool((last < n_buckets - 1).all()):
        return None
    cand = bucket <= last
    return cand if int(cand.sum(-1).max()) <= vocab // 4 else None


def _top_p_drop_among(probs: torch.Tensor, cand: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_top_p_drop` where each row's candidates `cand` [R, V] hold more than top_p and every other
    token is smaller: the candidates, in token order, gathered into a padded [R, C] (pad -1 sorts
    last), sorted stably."""
    row, col = cand.nonzero(as_tuple=True)                                    # row-major: token order
    counts = torch.bincount(row, minlength=probs.shape[0])                    # [R]
    start = counts.cumsum(0) - counts
    slot = torch.arange(row.numel(), device=probs.device) - start[row]
    small = probs.new_full((probs.shape[0], int(counts.max())), -1.0)
    small[row, slot] = probs[row, col]
    sorted_p, order = small.sort(dim=-1, descending=True, stable=True)
    drop_sorted = sorted_p.cumsum(-1) - sorted_p >= top_p
    keep_small = torch.zeros_like(drop_sorted).scatter_(-1, order, ~drop_sorted)   # [R, C], in slot order
    drop = torch.ones_like(cand)
    drop[row, col] = ~keep_small[row, slot]
    return drop


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the `k` most likely tokens at its position, under
    the distribution its sampler saw: the logits after `process_logits` and temperature (1 when
    greedy), before min-p / top-k / top-p truncation (vLLM's "processed" log-probabilities)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]    # (token id, logprob), most likely first; k of them


def token_logprobs(logits: torch.Tensor, params: SamplingParams, token_ids: Sequence[int],
                   top: int | None = None) -> list[TokenLogprob]:
    """logits [N, V] (already through `process_logits`), the token sampled at each row [N] →
    N `TokenLogprob`s with `top` (default `params.logprobs`) alternatives each."""
    scale = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)                 # [N, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist()               # [N]
    k = (params.logprobs if top is None else top) or 0
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return [TokenLogprob(int(t), float(c), list(zip(i, v)))
            for t, c, i, v in zip(token_ids, chosen, top_i.tolist(), top_v.tolist())]


_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele, Lea and Flood 2014) on int64 lanes (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def _position_keys(seed: int, positions: Sequence[int]) -> torch.Tensor:   # -> [N] int64
    """The key of each output position of the request seeded `seed`: SplitMix64 over (seed, position)."""
    key = _splitmix64(torch.tensor([_signed(seed)], dtype=torch.long))                  # [1]
    return _splitmix64(key ^ torch.tensor(list(positions), dtype=torch.long))           # [N]


def exponential(shape: Sequence[int], generator: torch.Generator | None) -> torch.Tensor:   # -> shape float32
    """Exponential(1) draws for an unseeded request's sampler, from its generator: -log U over
    float64 uniforms (torch's own `exponential_` costs 0.83 ms for a 49K vocabulary here, these
    0.28). U = 0, a 2^-53 chance a draw, gives inf: that token is not drawn that once."""
    return torch.rand(tuple(shape), generator=generator, dtype=torch.float64).log_().neg_().float()


def gumbel_noise(seed: int, positions: Sequence[int], vocab: int,
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:   # -> [N, V] float32 ([N, V'])
    """Standard Gumbel noise for output positions `positions` of the request seeded `seed`: a
    counter-based generator (SplitMix64 over (seed, position, token)), so the noise of position
    t is the same however many draws came before, on either side, in any batch. `token_ids`
    [V'] int64: only those tokens' columns (a reduced head's rows), each the same value the
    full [N, vocab] noise holds at that token. In C where the CPU kernels are built
    (`kernels.cpu.gumbel_noise`), else from torch operators (the same up to the logarithms'
    last bit)."""
    keys = _position_keys(seed, positions)
    tokens = None if token_ids is None else token_ids.long().cpu()
    if cpu_kernels.gumbel_available():
        return cpu_kernels.gumbel_noise(keys, vocab, tokens)
    tokens = torch.arange(vocab, dtype=torch.long) if tokens is None else tokens
    bits = _splitmix64(keys[:, None] ^ tokens[None, :])                                 # [N, V or V']
    u = (_shr(bits, 11).double() + 0.5) * 2.0 ** -53                                     # (0, 1)
    return (-torch.log(-torch.log(u))).float()


def coupled_scores(probs: torch.Tensor, params: SamplingParams, positions: Sequence[int],
                   token_ids: torch.Tensor | None = None, top: int | None = None) -> torch.Tensor:
    """probs [N, V] (after `logits_to_probs`) at output positions [N] -> `log p + G` [N, V]: its
    argmax is an exact sample of p, a function of the seed alone (Daliri, Musco and Suresh,
    "Coupling without communication and drafter-invariant speculative decoding"). With
    `token_ids` [V']: probs [N, V'] over those tokens alone (zero at every other token). With
    `top` (1 to 16; CPU probs, the C kernels built): only the scores that can be among each row's
    `top` largest, -inf elsewhere (`kernels.cpu.coupled_top`: the same largest, without the
    noise of the tokens too unlikely to reach them)."""
    if top is not None and 1 <= top <= 16 and probs.device.type == "cpu" and cpu_kernels.gumbel_available():
        tokens = None if token_ids is None else token_ids.long().cpu()
        return cpu_kernels.coupled_top(probs, _position_keys(params.seed, positions), tokens, top)
    noise = gumbel_noise(params.seed, positions, probs.shape[-1], token_ids).to(probs.device)
    return probs.log() + noise
