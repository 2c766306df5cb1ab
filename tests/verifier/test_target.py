"""The target's warm-up (verifier/target.py): before serving it runs a dummy sequence through
the shapes requests meet, on a GPU and on the CPU (the drafter's is in
tests/drafter/test_draft_side.py). It must leave nothing behind — every KV block free, no
sequence state — change no later result, and fit any cache: shortened, or skipped."""
from __future__ import annotations

import torch

from models.sampling import SamplingParams
from verifier.target import TargetSide


def _greedy(side: TargetSide, prompt: list[int], steps: int) -> list[int]:
    from models.tree import TokenTree
    from verifier import VerifyRequest

    committed, gen = list(prompt), torch.Generator().manual_seed(0)
    side.prefill("x", committed)
    for _ in range(steps):
        tree = TokenTree.chain([committed[-1]] * 2, None, len(committed))
        res = side.verify([VerifyRequest("x", committed[-1], tree, SamplingParams(temperature=0.0), gen)])[0][0]
        committed += res.token_ids
    side.release("x")
    return committed[len(prompt):]


def test_target_warm_up_leaves_no_trace(tiny_target):
    threads = torch.get_num_threads()
    try:
        fresh = TargetSide(str(tiny_target), num_blocks=32)
        warmed = TargetSide(str(tiny_target), num_blocks=32)
        assert warmed.warm_up(4) > 0.0                        # on the CPU too
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
        prompt = [5, 9, 2, 7, 3, 8]
        assert _greedy(warmed, prompt, 6) == _greedy(fresh, prompt, 6)
    finally:
        torch.set_num_threads(threads)


def test_warm_up_captures_every_verification_shape_of_the_planner():
    """With (stand-in) CUDA graphs, the warm-up captures the planner's whole verification shape
    set (`speculation.planner.verify_rows`), so chains of every length up to K at growing
    contexts then replay graphs only: the one eager forward left is the prompt's prefill."""
    from models import cuda_graphs
    from models.presets import random_model

    for warm in (True, False):
        model = random_model("random:tiny")
        cuda_graphs.enable(model, capture=cuda_graphs.stand_in_capture)
        side = TargetSide("", num_blocks=16, model=model)       # 256 tokens: widths of 1..16 blocks
        if warm:
            side.warm_up(4)
            assert side.cache.num_free_blocks == side.cache.num_blocks
        before = side.graphs.stats()
        from models.tree import TokenTree
        from verifier import VerifyRequest

        committed, gen = [5, 9, 2, 7, 3, 8, 1, 4, 6], torch.Generator().manual_seed(0)   # prefill: 8 rows
        side.prefill("x", committed)
        for step in range(40):
            k = step % 5                                         # plain steps and chains of 1..4
            tree = TokenTree.empty(len(committed)) if k == 0 else \
                TokenTree.chain([committed[-1]] * k, None, len(committed))
            res = side.verify([VerifyRequest("x", committed[-1], tree, SamplingParams(temperature=0.0), gen)])[0][0]
            committed += res.token_ids
        after = side.graphs.stats()
        if warm:
            assert after["captures"] == before["captures"], (before, after)
            assert after["eager"] - before["eager"] == 1, (before, after)       # the prefill
        else:                                                    # the control: captured while serving
            assert after["captures"] > before["captures"] and after["eager"] - before["eager"] > 5


def test_warm_up_fits_its_dummy_in_a_small_cache_or_skips_it():
    """A cache too small for the 32-token dummy and its trees gets a shorter one; one that cannot
    hold even 2 tokens plus a tree is skipped (0 s); nothing raises and every block is free."""
    from models.presets import random_model

    model = random_model("random:tiny")
    for num_blocks, block_size, warms in ((3, 4, True), (2, 4, True), (1, 4, False), (1, 1, False)):
        side = TargetSide("", num_blocks=num_blocks, block_size=block_size, model=model)
        assert (side.warm_up(4) > 0.0) == warms, (num_blocks, block_size)
        assert side.cache.num_free_blocks == num_blocks and not side.cache._lens
