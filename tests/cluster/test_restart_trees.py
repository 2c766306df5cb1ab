"""Restart trees (`restart_depth`, drafter/streams.py): after a contradicted outcome the
verifier waits for the drafter's short restart chain after the committed prefix instead of
decoding a token alone; the output stays the target's own."""
from __future__ import annotations

import pytest

from .pipeline_helpers import assert_greedy_exact_beside_sampled, collect, hf_greedy, prompts, request, run


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue


@pytest.mark.parametrize("draft,depth", [("far_draft", 1), ("close_draft", 2)])
def test_pipeline_with_restart_trees_is_exact(make_engine, tiny_target, hf_target, draft, depth,
                                              request_fixture):
    """Greedy requests through a pipeline with `restart_depth` set in the cluster config are
    token for token the target alone, with a far draft (nearly every tree contradicted:
    restarts after restarts) and a close one; a sampled request beside them finishes. Each
    restart tree verified is a chain of at most `restart_depth` nodes."""
    engine = make_engine(tiny_target, request_fixture(draft), drafters=1, speculation={"restart_depth": depth})
    assert_greedy_exact_beside_sampled(engine, hf_target, prompts(3, seed=31), seed=5)
    stats = run(engine.stats())
    assert stats["bridge_chains"] == 0
    assert stats["restart_trees"] <= stats["restarts"]
    assert stats["restart_accepted"] <= stats["restart_drafted"] <= depth * stats["restart_trees"]
    if draft == "far_draft":
        assert stats["drafter_rollbacks"] > 0
        assert stats["restarts"] > 0 and stats["restart_trees"] > 0, stats


def test_a_drafter_killed_while_the_verifier_waits_for_restarts_leaves_the_output_exact(
        make_engine, tiny_target, far_draft, hf_target):
    """A sequence waiting for a restart tree from a dead drafter is not held: past its
    patience it decodes alone, and when Ray has restarted the drafter speculation resumes;
    a greedy request with a far draft (restarting nearly every step) completes token for
    token as the target alone."""
    from .test_pipeline_faults import kill_after

    engine = make_engine(tiny_target, far_draft, drafters=1, drafter_timeout_s=1.0,
                         speculation={"restart_depth": 1})
    prompt = prompts(1, seed=33)[0]
    killed_at = []
    tokens, last = run(collect(engine, request("victim", prompt, 60, "chain", 4),
                               kill_after(engine.pipelines[0].drafters[0], 6, killed_at)), 180)
    assert killed_at and killed_at[0] < 60, "the drafter must die mid-generation"
    assert tokens == hf_greedy(hf_target, prompt, 60) and last.finish_reason == "length"
    assert run(engine.stats())["restarts"] > 0


@pytest.mark.parametrize("restart_depth", [-1, 0])
def test_a_lone_overlapped_stream_restarts_by_default(make_engine, tiny_target, far_draft, hf_target,
                                                      restart_depth):
    """By default (`restart_depth` -1) a lone stream overlapped with its drafter answers a
    contradicted outcome with a restart chain of up to `LONE_RESTART_DEPTH` tokens, which the
    verifier chose and its step signal told the drafter (`Signal.restart`); with 0 it bridges.
    Either way a greedy request with a far draft (contradicted nearly every step) is the
    target alone, token for token."""
    from speculation.policy import LONE_RESTART_DEPTH

    engine = make_engine(tiny_target, far_draft, drafters=1,
                         speculation={"restart_depth": restart_depth, "lockstep_alone": False,
                                      "lockstep_measured": False})
    prompt = prompts(1, seed=37)[0]
    tokens, last = run(collect(engine, request("alone", prompt, 40, "chain", 4)), 180)
    assert tokens == hf_greedy(hf_target, prompt, 40) and last.finish_reason == "length"
    stats = run(engine.stats())
    assert stats["drafter_rollbacks"] > 0, stats
    if restart_depth:
        assert stats["restarts"] > 0 and stats["restart_trees"] > 0, stats
        assert stats["restart_drafted"] <= LONE_RESTART_DEPTH * stats["restart_trees"]
    else:
        assert stats["restarts"] == stats["restart_trees"] == 0, stats
