"""models.grammar: compiling a request's grammar, and its masks along tree paths (issue 24, item 4)."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from models.grammar import GrammarError, GrammarSpec, grammar_mask, register_vocabulary
from models.sampling import SamplingParams, TokenHistory, process_logits

HEX = "0123456789abcdef"
STOP = 15
PATTERN = r"(1[0-4]|[2-5][5-9a-c])[0-7]"


@pytest.fixture(scope="module")
def hex16():
    return register_vocabulary("hex16-unit", tokens=list(HEX), stop_ids=[STOP])


def allowed_ids(mask_row: torch.Tensor) -> set[int]:
    return set(mask_row.nonzero().squeeze(1).tolist())


def test_branches_in_different_grammar_states(hex16):
    """Siblings "1" and "2" leave the grammar in different states; each row gets its own."""
    spec = GrammarSpec("regex", PATTERN, vocabulary=hex16)
    rows = grammar_mask(spec, [STOP], [], [[], [1], [2], [1, 3], [2, 5], [1, 9], [2, 5, 0]], 16)
    assert allowed_ids(rows[0]) == {1, 2, 3, 4, 5}
    assert allowed_ids(rows[1]) == set(range(5))
    assert allowed_ids(rows[2]) == set(range(5, 13))
    assert allowed_ids(rows[3]) == allowed_ids(rows[4]) == set(range(8))
    assert allowed_ids(rows[5]) == set(range(16))          # unreachable: "19" is refused
    assert allowed_ids(rows[6]) == {STOP}                   # complete: only its end


def test_rollback_to_a_shorter_or_other_output(hex16):
    """The cursor follows the committed output both ways: a rejection is a rollback."""
    spec = GrammarSpec("regex", PATTERN, vocabulary=hex16)
    assert allowed_ids(grammar_mask(spec, [STOP], [2, 5], [[]], 16)[0]) == set(range(8))
    assert allowed_ids(grammar_mask(spec, [STOP], [1], [[]], 16)[0]) == set(range(5))
    assert allowed_ids(grammar_mask(spec, [STOP], [], [[]], 16)[0]) == {1, 2, 3, 4, 5}
    assert allowed_ids(grammar_mask(spec, [STOP], [3, 9, 7, STOP], [[]], 16)[0]) == {STOP}


def test_process_logits_masks_both_sides_and_a_free_draft(hex16):
    params = SamplingParams(grammar=GrammarSpec("regex", PATTERN, vocabulary=hex16, draft=False),
                            stop_token_ids=[STOP], prompt_len=2)
    logits = torch.zeros(2, 16)
    history = TokenHistory([0, 0], [[], [1]])
    p = process_logits(logits, params, history)
    assert set(torch.isfinite(p[1]).nonzero().squeeze(1).tolist()) == set(range(5))
    q = process_logits(logits, params, TokenHistory([0, 0], [[], [1]], draft=True))
    assert torch.isfinite(q).all()                           # draft=False: q is left free


def test_the_spec_crosses_the_wire_as_a_dict(hex16):
    params = SamplingParams(grammar=GrammarSpec("choice", json.dumps(["yes", "no"]), vocabulary=hex16))
    again = SamplingParams(**asdict(params))
    assert again.grammar == params.grammar and isinstance(again.grammar, GrammarSpec)
    assert set(asdict(params)["grammar"]) == {"kind", "source", "vocabulary", "strict", "draft"}


@pytest.mark.parametrize("spec, field", [
    (GrammarSpec("json_schema", '{"type": "nonsense"}'), "response_format.json_schema.schema"),
    (GrammarSpec("json_schema", "{not json"), "response_format.json_schema.schema"),
    (GrammarSpec("regex", "([a-"), "guided_regex"),
    (GrammarSpec("choice", "[]"), "guided_choice"),
])
def test_bad_grammars_name_their_field(hex16, spec, field):
    from dataclasses import replace
    from models.grammar import compile_grammar

    with pytest.raises(GrammarError) as e:
        compile_grammar(replace(spec, vocabulary=hex16))
    assert e.value.field == field


def test_unknown_kind_min_tokens_and_ignore_eos_are_refused():
    with pytest.raises(GrammarError):
        GrammarSpec("yaml")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(grammar=GrammarSpec("json_object"), min_tokens=2)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=GrammarSpec("json_object"), ignore_eos=True)


def test_greedy_tree_children_all_follow_the_grammar(hex16):
    """A greedy tree drafted under a grammar: every node is allowed after its own path, and
    siblings branch into different grammar states."""
    from drafter.tree_search import ROOT, TreeBuilder
    from models.tree import row_paths

    params = SamplingParams(temperature=0.0, stop_token_ids=[STOP], prompt_len=1,
                            grammar=GrammarSpec("regex", PATTERN, vocabulary=hex16))
    b = TreeBuilder(params, torch.Generator().manual_seed(0), width=3, max_nodes=20, vocab_size=16, committed=[0])
    gen = torch.Generator().manual_seed(1)
    root = torch.randn(1, 16, generator=gen)
    root[0, [1, 2, 3]] += 5.0                            # "1" and "2"/"3" lead to different states
    root[0, [6, 9]] += 9.0                               # the draft's favourites, refused at the root
    b.expand([ROOT], root)
    for depth in (1, 2):
        nodes = b.frontier(depth, 3)
        b.expand(nodes, torch.randn(len(nodes), 16, generator=gen))
    paths = row_paths(b.parent_ids, b.token_ids)[1:]
    spec = params.grammar
    for node, path in enumerate(paths):
        prefix = path[:-1]
        assert path[-1] in allowed_ids(grammar_mask(spec, [STOP], [], [prefix], 16)[0]), path
    assert {p[0] for p in paths} == {1, 2, 3}
    assert {p[1] for p in paths if len(p) > 1 and p[0] == 1} <= set(range(5))
    assert {p[1] for p in paths if len(p) > 1 and p[0] != 1} <= set(range(5, 13))


def test_a_model_directorys_vocabulary_preloads_once_however_many_ask(tmp_path, monkeypatch):
    """A pipeline actor loads its target's tokenizer for grammars while it is built
    (`preload_vocabulary`), under the key the server names it by; threads asking for a
    directory's vocabulary at once share one load."""
    import threading

    import models.grammar as grammar
    from tests.conftest import byte_tokenizer

    assert grammar.preload_vocabulary(str(tmp_path)) is None        # no tokenizer here: nothing to load
    byte_tokenizer().save_pretrained(tmp_path / "model")
    loads = []
    real = grammar.register_vocabulary

    def counted(key, *args, **kwargs):
        loads.append(key)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(grammar, "register_vocabulary", counted)
    key = str((tmp_path / "model").resolve())
    keys = []
    threads = [threading.Thread(target=lambda: keys.append(grammar.preload_vocabulary(str(tmp_path / "model" / "."))))
               for _ in range(2)]
    for t in threads:
        t.start()
    compiled = grammar.compile_grammar(GrammarSpec("regex", "[a-c]{2}", vocabulary=key))
    for t in threads:
        t.join(60)
    assert loads == [key] and keys == [key, key] and compiled is not None
    mask = grammar_mask(GrammarSpec("regex", "[a-c]{2}", vocabulary=key), [], [ord("a")], [[]], 259)
    assert allowed_ids(mask[0]) == {ord("a"), ord("b"), ord("c")}
