"""Structured output through the asynchronous pipeline (issue 24, item 4): the grammar rides to
the drafter actor in the stream's parameters (wire version 5), each actor compiles it against
the tokenizer directory it names, and greedy output equals the target alone under the grammar
(the in-process engine, speculation off)."""
from __future__ import annotations

import asyncio
import re

from cluster.local import InProcessEngine, speculation_for
from models import SamplingParams, load_model
from models.grammar import GrammarSpec, register_vocabulary
from speculation.requests import GenerationRequest, SpeculationOptions

from .pipeline_helpers import collect, run

PATTERN = r"\{\"id\": [0-9]{2,4}, \"tag\": \"[a-e]{1,5}\"\}"


def test_greedy_under_a_grammar_through_the_pipeline(make_engine, tiny_target, close_draft):
    from transformers import AutoTokenizer

    key = register_vocabulary(str(tiny_target), AutoTokenizer.from_pretrained(tiny_target))
    prompts = [[256, 72, 105], [256, 65, 66, 67, 68], [256, 120]]

    def params():
        return SamplingParams(temperature=0.0, max_tokens=40, grammar=GrammarSpec("regex", PATTERN, key))

    alone = InProcessEngine(load_model(tiny_target))
    expected = [o.token_ids for o in alone.generate([GenerationRequest(f"a{i}", p, params(), speculation_for("off", 1, 1))
                                                     for i, p in enumerate(prompts)])]
    # a loaded host can keep the drafter silent past the 2 s default (compiling the grammar,
    # prefilling): the verifier would rightly decode alone, and nothing here would be drafted
    engine = make_engine(tiny_target, close_draft, num_blocks=256, max_tree_wait_s=20.0, drafter_timeout_s=30.0)

    async def all_of(mode, width):
        return await asyncio.gather(*(collect(engine, GenerationRequest(
            f"{mode}-{i}", p, params(), SpeculationOptions(mode=mode, spec_len=3, tree_width=width))) for i, p in enumerate(prompts)))

    for mode, width in (("chain", 1), ("tree", 2)):
        results = run(all_of(mode, width), timeout=300)
        assert [tokens for tokens, _ in results] == expected, mode
        assert all(last.finish_reason == "stop" for _, last in results)
        assert sum(last.num_drafted for _, last in results) > 0
    text = bytes(t for t in expected[0] if t < 256).decode()
    assert re.fullmatch(PATTERN, text), text
