"""BENCHMARK ONLY: is a speculative output the target's own greedy output, up to near-ties?

bench/gpu_e2e.py runs an 8B-shaped target with random weights in bf16. Its top two logits
are often close, and a 1-row forward and a (K+1)-row forward of the same tokens round
differently (other kernels, other tile shapes), so greedy decoding through different shapes
can flip a token at a near-tie and continue differently from there, with every step of both
runs the target's own greedy choice. Exact token equality is therefore checked against a
reference that runs the target alone through the same shapes (gpu_e2e: chains that accept
nothing, so every step is a (K+1)-row forward emitting its first row), and every output,
equal or not, is also scored here by the target in the same dtype, teacher-forced:

- `margins`: at each output position, how far the emitted token's logit is below the
  target's largest (0 where it is the argmax);
- `tie_tolerance`: twice the largest logit difference between two shapes of the same
  forward over the reference (one prefill-shaped forward against chunks of 1 and of K+1
  rows after the prompt): the most rounding alone can move a top-2 gap, measured, not
  assumed;
- `check`: an output passes when it equals the reference, or when every emitted token is
  within that tolerance of the argmax (a near-tie flip); it reports the first divergence and
  the margin there. A wrong token (a draft token the verifier should have rejected) sits far
  below the argmax and fails (tests/bench/test_gpu_e2e.py: the mutation control).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _cache(model, tokens: int):
    cache = model.new_cache(tokens // 16 + 2, 16)
    cache.add_sequence(0)
    return cache


@torch.inference_mode()
def score(model, prompt: Sequence[int], output: Sequence[int], chunk: int | None = None) -> torch.Tensor:
    """The target's logits before each output token [len(output), V] float32, teacher-forced:
    one forward over prompt + output (chunk None), or the prompt but its last token, then
    chunks of `chunk` rows (the verifier's shapes: 1 for plain steps, K+1 for chains)."""
    from models.transformer import causal_mask

    device = model.embed_tokens.weight.device
    tokens = list(prompt) + list(output)
    cache = _cache(model, len(tokens))

    def forward(start: int, stop: int) -> torch.Tensor:      # logits of positions start..stop-1
        ids = torch.tensor([tokens[start:stop]], device=device)
        pos = torch.arange(start, stop, device=device)[None]
        return model(ids, pos, cache, [0], causal_mask(1, stop - start, device))[0].float()

    n, first = len(tokens) - 1, len(prompt) - 1            # logits at position i predict token i + 1
    if chunk is None:
        return forward(0, n)[first:].cpu()
    if first:
        forward(0, first)
    return torch.cat([forward(i, min(i + chunk, n)) for i in range(first, n, chunk)]).cpu()


def margins(logits: torch.Tensor, output: Sequence[int]) -> list[float]:
    """max logit - logit of the emitted token, per position (logits [n, V], output n tokens)."""
    emitted = logits.gather(1, torch.tensor(list(output))[:, None])[:, 0]
    return (logits.max(dim=1).values - emitted).tolist()


def tie_tolerance(model, prompt: Sequence[int], reference: Sequence[int], chunks: Sequence[int]) -> float:
    """2 x the largest |logit difference| between a prefill-shaped scoring of `reference` and
    chunked scorings of it (`chunks` rows each): a top-2 gap smaller than this may flip from
    one forward shape to another."""
    whole = score(model, prompt, reference)
    return 2.0 * max(float((score(model, prompt, reference, c) - whole).abs().max()) for c in chunks)


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token that differs (or where one ends early); None when equal."""
    i = next((i for i, (x, y) in enumerate(zip(output, reference)) if x != y), None)
    if i is None and len(output) != len(reference):
        i = min(len(output), len(reference))
    return i


def check(output: Sequence[int], reference: Sequence[int], margin: Sequence[float], tol: float) -> dict:
    """Whether `output` is the target's greedy output: equal to `reference`, or every emitted
    token within `tol` of the argmax (`margin`: `margins` of `output`). Reports where it first
    leaves the reference and the margin there."""
    at = first_divergence(output, reference)
    worst = max(margin, default=0.0)
    return {"equal": at is None, "first_divergence": at,
            "margin_at_divergence": None if at is None or at >= len(margin) else margin[at],
            "max_margin": worst, "ties_ok": worst <= tol, "ok": at is None or worst <= tol}
