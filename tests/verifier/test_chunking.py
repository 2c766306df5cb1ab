"""The prefill's token budget (verifier/chunking.py): a chunk sized so that it takes at most a share
of the decoding streams' step, measured; no budget where nothing decodes or chunking is off."""
from __future__ import annotations

from verifier.chunking import MIN_CHUNK, PrefillBudget


def run(budget: PrefillBudget, fixed_s: float, token_s: float, step_s: float, steps: int = 40) -> list[int]:
    """Steps of streams decoding in `step_s` beside a prefill whose chunk of c tokens costs
    fixed_s + token_s * c: the chunk sizes the budget chose."""
    sizes = []
    for _ in range(steps):
        c = budget.tokens(decoding=True)
        sizes.append(c)
        budget.observe_prefill(c, fixed_s + token_s * c)
        budget.observe_step(step_s)
    return sizes


def test_no_budget_without_chunking_and_whole_chunks_while_nothing_decodes():
    assert PrefillBudget(0, 0.5).tokens(decoding=True) is None
    b = PrefillBudget(128, 0.5)
    assert b.tokens(decoding=False) == 128
    assert PrefillBudget(128, 0.0).tokens(decoding=True) == 128      # share 0: fixed chunks
    assert b.tokens(decoding=True) == MIN_CHUNK                      # nothing measured: cautious


def test_the_chunk_grows_to_the_largest_that_fits_the_share_of_a_step():
    # a step of 100 ms, half of it for the chunk: 10 ms + 1 ms per token fits 40 tokens
    sizes = run(PrefillBudget(128, 0.5), fixed_s=0.010, token_s=0.001, step_s=0.100)
    assert sizes[0] == MIN_CHUNK and 36 <= sizes[-1] <= 40 and len(set(sizes[-10:])) == 1
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))             # it grows, never overshoots
    # and shrinks when the prefix it attends to makes each token dearer
    b = PrefillBudget(128, 0.5)
    run(b, 0.010, 0.001, 0.100)
    assert run(b, 0.010, 0.004, 0.100)[-1] == 8                      # 10 + 4 * 10 = 50 ms: 8 of the multiples of 4


def test_the_cap_and_the_floor():
    assert set(run(PrefillBudget(16, 0.5), 0.0, 0.0001, 0.100)[-5:]) == {16}     # at most prefill_chunk
    # a forward whose fixed cost alone exceeds the share: the smallest chunk, so the prompt still progresses
    assert set(run(PrefillBudget(128, 0.5), 0.060, 0.001, 0.100)) == {MIN_CHUNK}
    assert PrefillBudget(2, 0.5).tokens(decoding=True) == 2                       # a cap below the floor

