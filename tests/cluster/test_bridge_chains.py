"""Bridge chains (`bridge_depth`, drafter/streams.py): after a contradicted outcome the
verifier verifies the draft's own greedy chain, drafted by its copy of the draft, and the
drafter drafts its restart tree after the same path, through the pipeline (the two sides'
drafting is in tests/drafter/test_draft_side.py)."""
from __future__ import annotations

import pytest
import torch

from .pipeline_helpers import assert_greedy_exact_beside_sampled, collect, hf_greedy, prompts, request, run


def test_a_verifier_asked_to_bridge_with_chains_needs_the_draft(tiny_target):
    from cluster.actors import VerifierActor

    threads = torch.get_num_threads()
    try:
        with pytest.raises(ValueError, match="bridge_depth"):
            VerifierActor(str(tiny_target), {"num_blocks": 64, "bridge_depth": 2})
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("draft", ["far_draft", "close_draft"])
def test_pipeline_with_bridge_chains_is_exact(make_engine, tiny_target, hf_target, draft, request_fixture):
    """Greedy requests through a pipeline with `bridge_depth` 2 (set in the cluster config)
    are token for token the target alone, with a far draft (nearly every tree contradicted:
    chains after chains) and a close one; a sampled request beside them bridges plainly and
    finishes."""
    engine = make_engine(tiny_target, request_fixture(draft), drafters=1, speculation={"bridge_depth": 2})
    assert_greedy_exact_beside_sampled(engine, hf_target, prompts(3, seed=21))
    stats = run(engine.stats())
    if draft == "far_draft":
        assert stats["bridge_chains"] > 0, stats
        assert stats["bridge_chain_drafted"] >= stats["bridge_chains"]
        assert stats["drafter_rollbacks"] > 0
    assert stats["bridge_chain_accepted"] <= stats["bridge_chain_drafted"]


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue


def test_a_drafter_killed_while_chains_bridge_leaves_the_output_exact(make_engine, tiny_target, far_draft,
                                                                     hf_target):
    """Bridge chains are the verifier's own: with the drafter killed mid-generation (Ray
    restarts it) a greedy request with a far draft — bridging nearly every step — still
    completes token for token as the target alone."""
    from .test_pipeline_faults import kill_after

    engine = make_engine(tiny_target, far_draft, drafters=1, drafter_timeout_s=1.0,
                         speculation={"bridge_depth": 2, "restart_depth": 0})   # a lone stream: no restarts
    prompt = prompts(1, seed=23)[0]
    killed_at = []
    tokens, last = run(collect(engine, request("victim", prompt, 60, "chain", 4),
                               kill_after(engine.pipelines[0].drafters[0], 6, killed_at)), 180)
    assert killed_at and killed_at[0] < 60, "the drafter must die mid-generation"
    assert tokens == hf_greedy(hf_target, prompt, 60) and last.finish_reason == "length"
    assert run(engine.stats())["bridge_chains"] > 0
