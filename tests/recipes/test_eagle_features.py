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


def test_aux_features_line_up_with_the_rows_and_a_mismatch_is_refused(tiny_target, tmp_path):
    """`eagle_features.py --aux-layers`: one `[T, k * H]` tensor per row of each shard (the
    residual stream after those layers: models.Transformer.set_feature_layers), read back by
    `eagle_train.load_rows(..., aux)` beside the rows; shards that do not line up are refused."""
    import pytest

    from eagle_train import aux_layers_of, load_rows
    from models.loader import load_model

    model = load_model(tiny_target)
    rows_dir, aux_dir = tmp_path / "rows", tmp_path / "aux"
    rows_dir.mkdir()
    rows = [eagle_features.training_row({"domain": "code", "heldout": h, "prompt_ids": [1, 2]}, ids,
                                        *eagle_features.features(model, ids))
            for h, ids in ((False, [1, 2, 40, 41, 42]), (True, [1, 2, 50]))]
    torch.save(rows[:1], rows_dir / "shard_train-00000.pt")
    torch.save(rows[1:], rows_dir / "shard_heldout-00000.pt")
    eagle_features.add_aux(model, rows_dir, aux_dir, (0,), ("train", "heldout"))
    assert aux_layers_of(aux_dir) == (0,)
    loaded = load_rows(rows_dir, aux_dir)
    H = model.config.hidden_size
    for row in loaded:
        assert row["aux"].shape == (len(row["ids"]), H)
        model.set_feature_layers((0,))
        wide = eagle_features.features(model, row["ids"].tolist())[0]        # [T, 2H]: layer 0, then f
        torch.testing.assert_close(row["aux"], wide[:, :H])
        torch.testing.assert_close(row["hidden"], wide[:, H:])
        model.set_feature_layers(())
    torch.save([torch.zeros(3, H)], aux_dir / "shard_train-00000.pt")      # 5 positions in the row
    with pytest.raises(ValueError, match="does not match"):
        load_rows(rows_dir, aux_dir)
