"""The drafter's proposers driven on assumed prefixes (drafter/draft_side.py), and the verifier's
copy of the draft for bridge chains: both sides draft the same path; warm-up leaves no trace."""
from __future__ import annotations

import torch

from drafter.draft_side import BridgeDraft, DraftItem, DraftSide
from models.presets import config_of
from models.sampling import SamplingParams
from speculation.proposal import DraftRequest
from speculation.settings import EngineSettings


def _side(draft, target, settings) -> DraftSide:
    return DraftSide.build(str(draft), config_of(str(target)).vocab_size, settings)


def test_the_verifiers_chain_is_the_path_the_drafter_assumes(tiny_target, close_draft, far_draft):
    """Both sides draft the same greedy tokens after the same committed prefix, the drafter
    with its restart tree hanging from them, the verifier as a chain cut to r plus the draft's
    next token as the announced outcome; across successive prefixes (the caught-up cache)."""
    threads = torch.get_num_threads()
    try:
        for draft in (close_draft, far_draft):
            settings = EngineSettings(num_blocks=64, bridge_depth=2)
            drafter, verifier = _side(draft, tiny_target, settings), \
                BridgeDraft(str(draft), str(tiny_target), settings)
            greedy, gen = SamplingParams(temperature=0.0), torch.Generator().manual_seed(0)
            prefix = [5, 9, 2, 7, 3, 8, 1, 4]
            for step in range(4):
                (d,), _ = drafter.propose([DraftItem("s", prefix, greedy, gen, 3, 1, 0, 3)], assume=True)
                (bridge,) = verifier.chains([DraftRequest("s", prefix, greedy, gen, 2)])
                chain, announced = bridge.tree, bridge.outcome
                assert chain.num_nodes == 2 and chain.depths.tolist() == [1, 2]
                assert announced == d.bridge_tokens and len(announced) == 3
                assert chain.token_ids.tolist() == announced[:2]
                assert d.tree.prefix_len == len(prefix) + 3 and d.tree.num_nodes == 3
                drafter.rollback("s", len(prefix) - 1)
                prefix = prefix + [(7 * step + 3) % 50, (5 * step + 1) % 50]    # the prefix grows
            verifier.release("s")
            assert verifier.proposer.cache.num_free_blocks == verifier.proposer.cache.num_blocks
            assert verifier.warm_up(2) > 0.0                        # on the CPU too
            assert verifier.proposer.cache.num_free_blocks == verifier.proposer.cache.num_blocks
    finally:
        torch.set_num_threads(threads)


def test_a_random_benchmark_draft_bridges_like_its_drafter():
    """`random:` models (models/presets.py) have no head rows to read: the
    verifier's copy is built as the drafter's is, and both draft the same path."""
    threads = torch.get_num_threads()
    try:
        settings = EngineSettings(num_blocks=32, bridge_depth=2)
        greedy, gen = SamplingParams(temperature=0.0), torch.Generator()
        drafter = _side("random:tiny-draft", "random:tiny", settings)
        verifier = BridgeDraft("random:tiny-draft", "random:tiny", settings)
        (d,), _ = drafter.propose([DraftItem("s", [1, 2, 3], greedy, gen, 2, 1, 0, 3)])
        (bridge,) = verifier.chains([DraftRequest("s", [1, 2, 3], greedy, gen, 2)])
        announced = bridge.outcome
        assert announced == d.bridge_tokens and len(announced) == 3
    finally:
        torch.set_num_threads(threads)


def test_draft_warm_up_leaves_no_trace(tiny_target, close_draft):
    threads = torch.get_num_threads()
    try:
        settings = EngineSettings(num_blocks=32)
        fresh = _side(close_draft, tiny_target, settings)
        warmed = _side(close_draft, tiny_target, settings)
        assert warmed.warm_up(3) > 0.0                          # on the CPU too
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
        prefix = [5, 9, 2, 7, 3, 8, 1, 4]

        def draft(side):
            item = DraftItem("y", prefix, SamplingParams(temperature=0.0), torch.Generator().manual_seed(0), 3, 1, 0)
            d = side.propose([item])[0][0]
            side.release("y")
            return d.tree.token_ids.tolist(), d.outcome

        assert draft(warmed) == draft(fresh)
        assert warmed.cache.num_free_blocks == warmed.cache.num_blocks
    finally:
        torch.set_num_threads(threads)


def test_draft_warm_up_captures_every_draft_shape_of_an_eagle_head():
    """An EAGLE head's drafts under (stand-in) CUDA graphs: after the warm-up (the planner's
    draft shape set, `speculation.planner.draft_rows`) chains of every depth up to K, with
    partial accepts, replay graphs only; the one eager forward left is the prompt's catch-up.
    Without the warm-up they are captured while drafting (the control)."""
    from drafter.draft_side import model_proposer
    from drafter.ngram import NgramProposer
    from models import cuda_graphs
    from models.presets import random_model

    settings = EngineSettings(num_blocks=16, spec_len=4)
    for warm in (True, False):
        head = random_model("random:tiny-eagle")
        cuda_graphs.enable(head, capture=cuda_graphs.stand_in_capture)
        side = DraftSide({"model": model_proposer(head, 512, settings), "ngram": NgramProposer(512, 5)}, settings)
        assert side.needs_features and side.graphs is head.graphs
        if warm:
            assert side.warm_up(4) > 0
            assert side.cache.num_free_blocks == side.cache.num_blocks
        before = side.graphs.stats()
        prefix, greedy, gen = [5, 9, 2, 7, 3, 8, 1, 4, 6], SamplingParams(temperature=0.0), torch.Generator()
        side.observe_features("s", 0, torch.randn(len(prefix) - 1, 64))
        for step in range(12):
            k = 1 + step % 4
            (d,), _ = side.propose([DraftItem("s", prefix, greedy, gen, k, 1, 0)], assume=False)
            accepted = step % (k + 1)                         # partial and full accepts
            side.rollback("s", len(prefix) + accepted)
            new = prefix + d.tree.token_ids.tolist()[:accepted] + [step % 50]
            side.observe_features("s", len(prefix) - 1, torch.randn(len(new) - len(prefix), 64))
            prefix = new
        after = side.graphs.stats()
        if warm:
            assert after["captures"] == before["captures"], (before, after)
            assert after["eager"] - before["eager"] == 1, (before, after)     # the prompt's catch-up
        else:
            assert after["captures"] > before["captures"]


def test_a_warm_up_leaves_the_prefix_caches_hit_rates_as_they_were(tiny_target, close_draft):
    """Every engine warms up at start-up (on the CPU too): the dummy sequence's lookups must not
    count as the clients' misses (the draft's hit rate is compared with the target's)."""
    from verifier.target import TargetSide

    settings = EngineSettings(num_blocks=64, spec_len=3, prefix_caching=True)
    draft = DraftSide.build(str(close_draft), config_of(str(tiny_target)).vocab_size, settings)
    target = TargetSide(str(tiny_target), 64, 16, prefix_caching=True)
    assert draft.warm_up(3) > 0 and target.warm_up(3) > 0
    for cache in (draft.cache, target.cache):
        stats = cache.prefix_stats()
        assert stats["queries"] == stats["hits"] == 0
        assert cache.num_free_blocks == cache.num_blocks         # nothing of the dummy's held
    draft.cache.add_sequence("real", list(range(40)))               # a client's lookup still counts
    assert draft.cache.prefix_stats()["queries"] == 40


def test_draft_warm_ups_fit_their_dummy_in_a_small_cache_or_skip_it():
    """Both drafts' warm-ups shorten the dummy prompt to what a small cache holds beside the
    drafted levels, or skip it (0 s) where not even that fits; nothing raises, every block free."""
    threads = torch.get_num_threads()
    try:
        for num_blocks, warms in ((3, True), (2, True), (1, False)):
            settings = EngineSettings(num_blocks=num_blocks, block_size=4, spec_len=4, bridge_depth=2)
            side = _side("random:tiny-draft", "random:tiny", settings)
            bridge = BridgeDraft("random:tiny-draft", "random:tiny", settings)
            assert (side.warm_up(4) > 0.0) == (bridge.warm_up(2) > 0.0) == warms, num_blocks
            for cache in (side.cache, bridge.proposer.cache):
                assert cache.num_free_blocks == num_blocks and not cache._lens
    finally:
        torch.set_num_threads(threads)
