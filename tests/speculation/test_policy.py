"""Decisions both sides make alike from their own views (speculation/policy.py): bridge chains,
restart trees, the threads of a plain step, a GPU shared by drafter and verifier."""
from __future__ import annotations

from models.sampling import SamplingParams


def test_bridge_chain_depth_is_decided_alike_from_settings_params_and_budget():
    from speculation.policy import bridge_chain_depth
    from speculation.settings import MAX_BRIDGE_DEPTH, EngineSettings

    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    on = EngineSettings(bridge_depth=2)
    assert bridge_chain_depth(on, greedy, 5) == 2
    assert bridge_chain_depth(on, greedy, 1) == 1           # within the budget the verifier sent
    assert bridge_chain_depth(on, greedy, 0) == 0           # speculation off: decode alone
    assert bridge_chain_depth(on, sampled, 5) == 0          # sampling: the drafter cannot know the chain
    assert bridge_chain_depth(on, greedy, 5, proposer="ngram") == 0   # prompt lookup drafts no chain
    assert bridge_chain_depth(EngineSettings(bridge_depth=0), greedy, 5) == 0
    assert bridge_chain_depth(EngineSettings.model_construct(bridge_depth=9), greedy, 16) == MAX_BRIDGE_DEPTH


def test_after_a_contradiction_the_drafter_drafts_the_restart_tree_the_verifier_chose():
    """`restart_tree_depth` is the verifier's choice, told with the step's signal: s > 0 gives
    a restart chain of min(s, budget) for every stream; the default (-1) gives a lone
    overlapped stream a chain of min(`LONE_RESTART_DEPTH`, budget) and bridges streams that
    share a drafter;
    0 and a budget of 0 bridge. The drafter's next tree after a contradicted outcome is that
    chain with no bridge before it exactly where the verifier does not bridge, and otherwise
    a bridge (plainly, or after a bridge chain); without a contradiction nothing changes."""
    from speculation.policy import LONE_RESTART_DEPTH, next_tree_shape, restart_tree_depth
    from speculation.settings import EngineSettings

    assert EngineSettings().restart_depth == -1 and LONE_RESTART_DEPTH == 3
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8)
    for settings in (EngineSettings(restart_depth=1), EngineSettings(restart_depth=3),
                     EngineSettings(), EngineSettings(restart_depth=0), EngineSettings(bridge_depth=2)):
        for lone in (True, False):
            for params in (greedy, sampled):
                for budget in ((0, 0), (1, 1), (2, 2), (6, 1)):
                    restart = restart_tree_depth(settings, budget[0], lone)
                    auto = LONE_RESTART_DEPTH if lone else 0
                    chosen = settings.restart_depth if settings.restart_depth >= 0 else auto
                    assert restart == min(chosen, budget[0]), (settings, lone, budget)
                    depth, width, bridge = next_tree_shape(settings, params, budget, True, restart=restart)
                    assert (bridge > 0) == (restart == 0), (settings, budget)
                    assert (depth, width) == ((restart, 1) if restart else budget)
                    assert next_tree_shape(settings, params, budget, False, restart=restart) == (*budget, 0)
    assert restart_tree_depth(EngineSettings(), 6, True) == 3 and restart_tree_depth(EngineSettings(), 2, True) == 2
    assert restart_tree_depth(EngineSettings(), 6, False) == 0
    assert restart_tree_depth(EngineSettings(restart_depth=0), 4, True) == 0
    assert next_tree_shape(EngineSettings(restart_depth=3), greedy, (6, 2), True, restart=3) == (3, 1, 0)
    assert next_tree_shape(EngineSettings(bridge_depth=2), greedy, (6, 1), True) == (6, 1, 3)
    assert next_tree_shape(EngineSettings(bridge_depth=2), sampled, (6, 1), True) == (6, 1, 1)


def test_plain_step_threads_rule():
    from speculation.policy import plain_step_threads

    here = [{"node": "n1", "cpus": 1.0}]
    assert plain_step_threads(-1, 1, "cpu", "n1", here) == 2                       # borrows the drafter's core
    assert plain_step_threads(-1, 2, "cpu", "n1", here + [{"node": "n1", "cpus": 2}]) == 5
    assert plain_step_threads(-1, 1, "cpu", "n1", [{"node": "n2", "cpus": 4}]) == 1   # another node's cores
    assert plain_step_threads(-1, 1, "cpu", "", [{"node": "", "cpus": 1}]) == 1       # where unknown: no
    assert plain_step_threads(0, 1, "cpu", "n1", here) == 1                        # switched off
    assert plain_step_threads(3, 1, "cpu", "n1", []) == 3                          # fixed
    assert plain_step_threads(-1, 1, "cuda", "n1", here) == 1                      # GPUs: threads don't matter


def test_shares_gpu_rule():
    from speculation.policy import shares_gpu

    assert shares_gpu("n1", ["0"], "n1", ["0"])                  # half a GPU each, the same one
    assert shares_gpu("n1", ["0", "1"], "n1", ["1"])
    assert not shares_gpu("n1", ["0"], "n1", ["1"])              # two GPUs of one node
    assert not shares_gpu("n1", ["0"], "n2", ["0"])              # GPU 0 of two nodes
    assert shares_gpu("n1", [], "n1", [])                        # none named: both on the first
    assert not shares_gpu("n1", [], "n1", ["0"])
    assert not shares_gpu("n1", None, "n1", None)                # CPUs
    assert not shares_gpu("", ["0"], "", ["0"])                  # where unknown: no
