"""EAGLE training rows recorded while the target answers (`distill_draft.answer_batch(features=True)`)
are the rows `eagle_features.py` computes with a forward over each finished sequence."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

import distill_draft  # noqa: E402
import eagle_features  # noqa: E402


def test_rows_recorded_while_answering_match_a_forward_over_each_answer(tiny_target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.loader import load_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    rows = [{"domain": d, "prompt": p, "heldout": h} for d, p, h in
            (("code", "def f(x):", False), ("math", "What is 12 + 30, in words?", True), ("chat", "hi", False))]
    records = distill_draft.answer_batch(model, tokenizer, rows, max_new_tokens=12, k=4, features=True)
    ours = load_model(tiny_target)
    assert len({len(r["prompt_ids"]) for r in records}) == 3          # left padding in play
    for record in records:
        row, prompt, answer = record["eagle"], record["prompt_ids"], record["answer_ids"]
        assert (row["domain"], row["heldout"], row["answer_start"]) == (record["domain"], record["heldout"], len(prompt))
        assert row["ids"].tolist() == prompt + answer[:-1]            # the last token's successor was never chosen
        hidden, argmax = eagle_features.features(ours, row["ids"].tolist())
        assert row["hidden"].shape == hidden.shape
        torch.testing.assert_close(row["hidden"].float(), hidden.float(), atol=2e-3, rtol=2e-3)
        assert row["argmax"].tolist() == argmax.tolist()
        assert row["argmax"][len(prompt) - 1:].tolist() == answer     # after the prompt: the answer itself
