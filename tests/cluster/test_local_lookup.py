"""The in-process engine's prompt lookup in "auto" mode: where the draft model drafts for no
sequence of a step, lookup chains are verified instead; greedy output stays the target's."""
from __future__ import annotations

import pytest

from speculation.cost_model import CostModel
from cluster.local import InProcessEngine
from speculation.requests import GenerationRequest, SpeculationOptions
from models import SamplingParams, load_model

from .test_local_greedy import hf_greedy

CYCLE = list(b"abcdefghijkl")            # the copying target walks this cycle (tests/conftest.py)
PROMPTS = [CYCLE * 2 + CYCLE[:5], list(b"xyz") + CYCLE[3:] + CYCLE, list(b"no cycle here")]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def models(copying_target, far_draft):
    return load_model(copying_target), load_model(far_draft)


def _engine(target, draft, **kw) -> InProcessEngine:
    """An engine whose planners see fixed step costs: 50 ms + 1 ms a row (about the embedded
    target's shape on this CPU) and 5 ms a draft level, not this tiny model's noisy timings."""
    engine = InProcessEngine(target, draft, **kw)
    costs = CostModel(a=0.05, b=0.001, d=0.005, overlap=False)
    costs.observe_verify = lambda *a: None
    costs.observe_draft = lambda *a: None
    # in process the drafter and the target take turns (lockstep); lookup chains are priced on
    # the steps without a drafter's tree (the verify half of that model)
    engine.scheduler.costs.lockstep = engine.scheduler.costs.overlap = costs
    return engine


def _run(engine: InProcessEngine, mode: str = "auto", **sampling) -> list:
    sampling = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
    return engine.generate([GenerationRequest(f"r{i}", p, SamplingParams(**sampling),
                                              SpeculationOptions(mode=mode, spec_len=4))
                            for i, p in enumerate(PROMPTS)])


def test_auto_with_a_far_draft_verifies_lookup_chains_exactly(models, copying_target):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(copying_target).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    target, draft = models
    on = _run(_engine(target, draft))
    off = _run(_engine(target, draft, lookup=False))
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == expected
    steps_on = sum(o.stats.num_steps for o in on)
    steps_off = sum(o.stats.num_steps for o in off)
    accepted_on = sum(o.stats.num_accepted for o in on)
    accepted_off = sum(o.stats.num_accepted for o in off)
    # the far draft rarely lands a token; the cycle's lookups do, so far fewer steps
    assert accepted_on > accepted_off + 20 and steps_on < 0.7 * steps_off
    assert on[0].stats.mean_accepted_len > 2.0       # the prompt that walked the cycle


def test_lookup_state_is_released_and_sampling_runs(models):
    target, draft = models
    engine = _engine(target, draft)
    outs = _run(engine, temperature=0.8, seed=3)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    sch = engine.scheduler
    assert not sch.lookup.planner.seqs and not sch.adaptive.seqs and not sch.lookup.indexes
    # "off" and the fixed modes never look up
    for mode in ("off", "chain"):
        engine = _engine(target, draft)
        outs = _run(engine, mode=mode)
        assert (sum(o.stats.num_drafted for o in outs) > 0) == (mode == "chain")
        assert not engine.scheduler.lookup.planner.seqs
    engine = _engine(target, draft)
    looked = []
    real = engine.scheduler._lookup_trees

    def spy(batch, alone):           # how many of the step's trees are lookup chains
        real(batch, alone)
        looked.append(sum(it.header is None and it.tree.num_nodes > 0 for it in batch))
    engine.scheduler._lookup_trees = spy
    _run(engine, mode="chain")
    assert looked and not any(looked)
