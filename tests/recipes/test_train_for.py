"""`recipes/draft_train.train_for`: the time-budgeted loop both training recipes share."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

from draft_train import train_for  # noqa: E402


def _records(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 1, generator=g)
    xs = torch.randn(n, 3, generator=g)
    return [(x, x @ w) for x in xs]


def _mse(model: torch.nn.Module, records) -> torch.Tensor:
    x = torch.stack([r[0] for r in records])
    y = torch.stack([r[1] for r in records])
    return torch.nn.functional.mse_loss(model(x), y)


def test_keeps_the_best_evaluated_state_not_the_last():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    scores = iter([1.0, 5.0, 2.0, 0.5] + [0.0] * 10_000)
    snapshots = []

    def evaluate():
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": next(scores)}

    best_step, history = train_for(model, _records(16), lambda rs: _mse(model, rs), evaluate,
                                   seconds=0.4, eval_every=3, lr=1e-2, batch_size=4, seed=0,
                                   score="score", desc="test")
    assert len(history) >= 4 and [h["step"] for h in history[:4]] == [0, 3, 6, 9]
    assert best_step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshots[1][k])
    assert not torch.equal(snapshots[-1]["weight"], snapshots[1]["weight"])   # it did train past it


def test_learns_and_reloads_records_every_epoch():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    train, heldout = _records(8), _records(8)     # same generator seed: same function
    reloads = []

    def reload():
        reloads.append(1)
        return train

    before = _mse(model, heldout).item()
    _, history = train_for(model, train, lambda rs: _mse(model, rs),
                           lambda: {"neg_mse": -_mse(model, heldout).item()},
                           seconds=0.5, eval_every=5, lr=5e-2, batch_size=4, seed=1,
                           score="neg_mse", desc="test", reload=reload)
    steps = history[-1]["step"]
    assert len(reloads) == -(-steps // 2)        # 8 records in batches of 4: a new epoch every 2 steps
    assert _mse(model, heldout).item() < 0.5 * before


def test_no_records_is_a_clear_error():
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="no training records"):
        train_for(model, [], lambda rs: _mse(model, rs), lambda: {"s": 0.0}, seconds=5, eval_every=10,
                  lr=1e-3, batch_size=2, seed=0, score="s", desc="test")
