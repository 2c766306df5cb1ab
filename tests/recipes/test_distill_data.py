"""The draft distillation's data helpers: the reduced head's rows and the prompt set."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import draft_prompts  # noqa: E402
from draft_train import vocab_subset  # noqa: E402


def _record(answer: list[int], topk: list[list[int]], probs: list[list[float]]) -> dict:
    return {"answer_ids": answer, "topk_ids": torch.tensor(topk, dtype=torch.int32),
            "topk_logp": torch.tensor(probs).log().to(torch.float16)}


def _reference(train: list[dict], size: int, eos_id: int) -> list[int]:
    """The rows by their definition, one token at a time."""
    greedy = Counter(t for r in train for t in r["answer_ids"])
    mass: dict[int, float] = {}
    for r in train:
        for ids, logp in zip(r["topk_ids"].tolist(), r["topk_logp"].float().exp().tolist()):
            for t, p in zip(ids, logp):
                mass[t] = mass.get(t, 0.0) + p
    rows = [eos_id] + [t for t, _ in greedy.most_common() if t != eos_id]
    rows += sorted((t for t in mass if t not in rows), key=lambda t: (-mass[t], t))
    return rows[:size]


def test_rows_are_eos_then_greedy_by_count_then_alternatives_by_mass():
    g = torch.Generator().manual_seed(0)
    train = []
    for _ in range(30):
        n = int(torch.randint(1, 12, (1,), generator=g))
        answer = torch.randint(0, 40, (n,), generator=g).tolist()
        topk = torch.stack([torch.randperm(200, generator=g)[:4] for _ in range(n)]).tolist()
        probs = torch.rand(n, 4, generator=g).add(0.01).tolist()
        train.append(_record(answer, topk, probs))
    for size in (5, 40, 120, 10_000):
        rows = vocab_subset(train, size, eos_id=2)
        assert rows == _reference(train, size, eos_id=2)
        assert rows[0] == 2 and len(rows) == len(set(rows))
    counts = Counter(t for r in train for t in r["answer_ids"])
    full = vocab_subset(train, 10_000, eos_id=2)
    greedy_part = full[1:1 + len(set(counts) - {2})]
    assert set(greedy_part) == set(counts) - {2}
    assert [counts[t] for t in greedy_part] == sorted((counts[t] for t in greedy_part), reverse=True)


def test_equal_mass_alternatives_come_in_token_order():
    train = [_record([1], [[9, 7, 8]], [[0.5, 0.25, 0.25]])]
    assert vocab_subset(train, 10, eos_id=0) == [0, 1, 9, 7, 8]


def test_prompts_are_distinct_and_held_out_ones_never_train():
    rows = draft_prompts.build_prompts(400, seed=3)
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == len(set(prompts))
    held = {r["prompt"] for r in rows if r["heldout"]}
    assert held and not held & {r["prompt"] for r in rows if not r["heldout"]}
    by_domain = Counter(r["domain"] for r in rows if r["heldout"])
    assert set(by_domain) == {"code", "math", "chat"}
    for r in rows:      # a style suffix never runs into an unfinished sentence
        for suffix in draft_prompts.STYLE_SUFFIXES:
            if suffix and r["prompt"].endswith(suffix):
                assert r["prompt"][: -len(suffix)][-1] in '.?!"'


def test_a_corpus_drawn_beside_another_shares_none_of_its_prompts():
    import argparse

    import distill_draft

    first = {r["prompt"] for r in draft_prompts.build_prompts(300, seed=0)}
    args = argparse.Namespace(beside=300, seed=5)
    second = draft_prompts.build_prompts(300, seed=5, exclude=distill_draft.excluded(args))
    plain = draft_prompts.build_prompts(300, seed=5)
    overlap = {r["prompt"] for r in plain} & first
    assert overlap, "the templated sets overlap when drawn alone: the exclusion has work to do"
    assert second and not {r["prompt"] for r in second} & first
    assert [r for r in plain if r["prompt"] not in first] == second
    assert distill_draft.excluded(argparse.Namespace(beside=0, seed=5)) == set()
    with pytest.raises(SystemExit, match="--seed"):      # seed 0 would draw the same set again
        distill_draft.excluded(argparse.Namespace(beside=300, seed=0))
