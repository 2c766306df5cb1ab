"""The synchronous engine's "auto" mode: per-sequence depths from running acceptance and step
costs (speculation/planner.py with draft and verify taking turns). A draft far from the target is
switched off (probed now and then); a close one keeps speculating; output stays exact."""
from __future__ import annotations

import pytest

from speculation.cost_model import CostModel
from cluster.local import build_engine
from speculation.requests import GenerationRequest, SpeculationOptions
from models import SamplingParams

from .test_local_greedy import hf_greedy

PROMPTS = [list(b"def add(a, b):\n    return"), list(b"The quick brown fox")]
MAX_TOKENS = 64


def fixed_costs(engine, a=1.0, b=0.1, d=0.2) -> None:
    """Costs like this CPU's (verify ~ a + b.rows, one draft level ~ d), held fixed so the planner's
    choices depend on acceptance only."""
    costs = CostModel(a=a, b=b, d=d, overlap=False)
    costs.observe_verify = lambda rows, seconds: None
    costs.observe_draft = lambda levels, seconds: None
    engine.scheduler.costs.lockstep = costs     # in process the drafter and the target take turns


def run_auto(engine, prompts, K=4, W=1, max_tokens=MAX_TOKENS):
    reqs = [GenerationRequest(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              SpeculationOptions(mode="auto", spec_len=K, tree_width=W))
            for i, p in enumerate(prompts)]
    return engine.generate(reqs)


@pytest.fixture(scope="module")
def references(hf_target):
    return [hf_greedy(hf_target, p, MAX_TOKENS) for p in PROMPTS]


def test_auto_switches_a_far_draft_off_and_stays_exact(tiny_target, far_draft, references):
    engine = build_engine(tiny_target, far_draft).engine
    fixed_costs(engine)
    outs = run_auto(engine, PROMPTS)
    assert [o.token_ids for o in outs] == references
    for o in outs:
        steps_with_tree = o.stats.num_drafted  # upper bound on speculative steps (>= 1 node each)
        # a few steps while the prior gamma (0.6) decays, then only probes every 16 steps
        assert o.stats.num_steps > 40, o.stats
        assert steps_with_tree <= 16, o.stats
    assert engine.scheduler.adaptive.seqs == {}, "finished sequences must leave the planner"


@pytest.mark.parametrize("W", [1, 2])
def test_auto_keeps_a_close_draft_speculating_and_exact(tiny_target, close_draft, references, W):
    engine = build_engine(tiny_target, close_draft).engine
    fixed_costs(engine)
    outs = run_auto(engine, PROMPTS, W=W)
    assert [o.token_ids for o in outs] == references
    for o in outs:
        assert o.stats.mean_accepted_len > 1.5, o.stats
        assert o.stats.num_steps < MAX_TOKENS * 0.7, o.stats


def test_auto_costs_are_measured_when_not_fixed(tiny_target, close_draft, references):
    engine = build_engine(tiny_target, close_draft).engine
    outs = run_auto(engine, PROMPTS)
    assert [o.token_ids for o in outs] == references
    a, b = engine.scheduler.costs.lockstep.coefficients
    assert (a, b) != CostModel().prior, "the step costs must be learned from the steps run"
