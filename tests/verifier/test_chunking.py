"""The prefill's token budget (verifier/chunking.py): a chunk that rides in the decoding streams'
verification forward, sized so that it adds at most a share of their step, measured as the step's
time less that of a step without a chunk; no budget where nothing decodes or chunking is off."""
from __future__ import annotations

from verifier.chunking import MIN_CHUNK, PrefillBudget


def run(budget: PrefillBudget, fixed_s: float, token_s: float, step_s: float, steps: int = 40,
        plain_first: int = 3, rows: int = 40) -> list[int]:
    """`plain_first` steps of streams decoding in `step_s`, then `steps` more, each beside a
    chunk of c tokens that adds fixed_s + token_s * c to it: the chunk sizes the budget chose."""
    for _ in range(plain_first):
        budget.observe_step(step_s, rows)
    sizes = []
    for _ in range(steps):
        c = budget.tokens(decoding=True)
        sizes.append(c)
        budget.observe_step(step_s + fixed_s + token_s * c, rows, c)
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
    assert all(a <= b <= 2 * a for a, b in zip(sizes, sizes[1:]))    # it grows, at most doubling, never overshoots
    # and shrinks when the prefix it attends to makes each token dearer
    b = PrefillBudget(128, 0.5)
    run(b, 0.010, 0.001, 0.100)
    assert run(b, 0.010, 0.004, 0.100, plain_first=0)[-1] == 8        # 10 + 4 * 10 = 50 ms: 8 of the multiples of 4


def test_the_cap_and_the_floor():
    assert set(run(PrefillBudget(16, 0.5), 0.0, 0.0001, 0.100)[-5:]) == {16}     # at most prefill_chunk
    # a chunk whose fixed cost alone exceeds the share: the smallest chunk, so the prompt still progresses
    assert set(run(PrefillBudget(128, 0.5), 0.060, 0.001, 0.100)) == {MIN_CHUNK}
    assert PrefillBudget(2, 0.5).tokens(decoding=True) == 2                       # a cap below the floor


def test_without_a_step_free_of_chunks_the_first_chunk_step_is_split_by_rows():
    """Streams that began decoding while a prompt was already being chunked: no baseline step;
    the chunk still grows towards the share and never past it."""
    sizes = run(PrefillBudget(128, 0.5), fixed_s=0.0, token_s=0.001, step_s=0.100, plain_first=0)
    assert sizes[0] == MIN_CHUNK and sizes[-1] > 4 * MIN_CHUNK
    assert all(c <= 52 for c in sizes)                               # 0.5 x ~100 ms / 1 ms


def test_a_chunk_step_measured_faster_than_the_baseline_does_not_blow_the_budget_open():
    """Step times are noisy: a chunk step that came out quicker than the average step counts each
    of its tokens at least a quarter of a row, so the next chunk stays bounded."""
    b = PrefillBudget(1024, 0.5)
    for _ in range(3):
        b.observe_step(0.100, 40)
    b.observe_step(0.080, 40, 8)                 # faster than the baseline with a chunk
    assert b.tokens(decoding=True) <= int(0.5 * 0.100 / (0.25 * 0.080 / 48)) + MIN_CHUNK


def test_one_costly_chunk_shrinks_the_next_fast_and_a_cheap_one_grows_it_slowly():
    b = PrefillBudget(256, 0.5)
    run(b, 0.0, 0.001, 0.100)                    # settled at 48 tokens (0.5 x 100 ms / 1 ms)
    assert b.tokens(decoding=True) == 48
    b.observe_step(0.100 + 0.048 * 4, 40, 48)    # the same chunk cost 4x as much once: ~2.5 ms a token now
    assert b.tokens(decoding=True) == 16
    b.observe_step(0.100 + 0.016 * 0.001, 40, 16)   # then next to nothing: a step towards 48, not a jump
    assert 16 < b.tokens(decoding=True) <= 28
