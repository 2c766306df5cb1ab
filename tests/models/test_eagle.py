"""The EAGLE draft head (models/eagle.py): loaded as such, and a forward without the target's
features refused."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from models.eagle import EagleDraft
from models.transformer import Transformer, causal_mask


def test_loader_recognises_an_eagle_checkpoint(tiny_target, eagle_draft):
    draft = load_model(eagle_draft)
    assert isinstance(draft, EagleDraft) and draft.needs_features
    assert type(load_model(tiny_target)) is Transformer
    cache = draft.new_cache(4)
    cache.add_sequence("s")
    with pytest.raises(ValueError, match="needs the target's features"):
        draft(torch.tensor([[1, 2]]), torch.arange(2)[None], cache, ["s"], causal_mask(1, 2))
    assert cache.seq_len("s") == 0          # a refused forward leaves the cache as it was
    target = load_model(tiny_target)
    tcache = target.new_cache(4)
    tcache.add_sequence("s")
    with pytest.raises(ValueError, match="takes no input features"):
        target(torch.tensor([[1, 2]]), torch.arange(2)[None], tcache, ["s"], causal_mask(1, 2),
               features=torch.zeros(1, 2, target.config.hidden_size))
