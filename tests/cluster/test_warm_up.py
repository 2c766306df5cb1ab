"""The actors' warm-up (cluster/backends.py): on a GPU each side runs a dummy sequence through
the shapes requests meet before it serves. Forced here on the CPU: it must leave nothing
behind — every KV block free, no sequence state — and change no later result."""
from __future__ import annotations

import torch

from cluster.backends import DraftSide, PipelineSettings, TargetSide
from models.sampling import SamplingParams


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
        assert warmed.warm_up(4) == 0.0                       # nothing to compile on a CPU
        assert warmed.warm_up(4, on_cpu=True) > 0.0
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
        prompt = [5, 9, 2, 7, 3, 8]
        assert _greedy(warmed, prompt, 6) == _greedy(fresh, prompt, 6)
    finally:
        torch.set_num_threads(threads)


def test_draft_warm_up_leaves_no_trace(tiny_target, close_draft):
    threads = torch.get_num_threads()
    try:
        settings = PipelineSettings(num_blocks=32)
        fresh = DraftSide(str(close_draft), str(tiny_target), settings)
        warmed = DraftSide(str(close_draft), str(tiny_target), settings)
        assert warmed.warm_up(3) == 0.0
        assert warmed.warm_up(3, on_cpu=True) > 0.0
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
        prefix = [5, 9, 2, 7, 3, 8, 1, 4]

        def draft(side):
            item = ("y", prefix, SamplingParams(temperature=0.0), torch.Generator().manual_seed(0), 3, 1, 0, False)
            d = side.propose([item])[0][0]
            side.release("y")
            return d.tree.token_ids.tolist(), d.outcome

        assert draft(warmed) == draft(fresh)
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
    finally:
        torch.set_num_threads(threads)
