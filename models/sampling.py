"""Per-request sampling parameters and the one logits → probabilities transform.

Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) holds for
the *processed* distributions only if the target's p and the draft's q go
through the same transform, so every caller uses `logits_to_probs`:
temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), in float32.
Temperature 0 is greedy: a one-hot at the argmax (the limit of temperature → 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    seed: int | None = None         # None = not reproducible
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → probabilities [..., V] float32 after temperature, top-k, top-p."""
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]        # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))        # ties with the k-th stay
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p                    # [..., V]
        drop_sorted = mass_before >= params.top_p                        # the first token always stays
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
