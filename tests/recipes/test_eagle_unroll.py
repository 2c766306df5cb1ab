"""`recipes/eagle_train.EagleHead.unrolled`: training-time test sees what drafting sees.

Level d at position j must equal a plain causal pass over the sequence a drafter holds at
level d: the verified prefix with the target's true features, then the chain of the head's own
predictions, one per level.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))

from eagle_train import EagleHead, chain_tokens  # noqa: E402


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    path = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def head(target_path) -> EagleHead:
    h = EagleHead(target_path, init_layer=1, fc_init="random").eval()
    with torch.no_grad():          # a layer far from identity, so a wrong mask shows
        for p in h.model.layers[0].parameters():
            p.add_(0.2 * torch.randn_like(p))
    return h


def _causal(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    return head(ids, feats, torch.ones_like(ids))


@torch.no_grad()
def test_each_level_equals_a_causal_pass_over_the_drafters_sequence(head):
    torch.manual_seed(1)
    L = 12
    ids = torch.randint(0, 96, (2, L))
    feats = torch.randn(2, L, 64)
    levels = head.unrolled(ids, feats, 3)
    assert len(levels) == 3
    torch.testing.assert_close(levels[0], _causal(head, ids, feats), atol=1e-5, rtol=1e-4)
    for j in (3, 7, L - 1):
        # level 2 at j: the prefix up to j-1 reads true features, j reads level 1's guess at j-1
        two = feats[:, :j + 1].clone()
        two[:, j] = levels[0][:, j - 1]
        torch.testing.assert_close(levels[1][:, j], _causal(head, ids[:, :j + 1], two)[:, j], atol=1e-5, rtol=1e-4)
        # level 3 at j: true up to j-2, j-1 reads level 1's guess at j-2, j reads level 2's at j-1
        three = feats[:, :j + 1].clone()
        three[:, j - 1] = levels[0][:, j - 2]
        three[:, j] = levels[1][:, j - 1]
        torch.testing.assert_close(levels[2][:, j], _causal(head, ids[:, :j + 1], three)[:, j], atol=1e-5, rtol=1e-4)
    # and the deeper levels differ from a pass that reads predictions everywhere (the old unroll)
    everywhere = torch.cat([torch.zeros_like(levels[0][:, :1]), levels[0][:, :-1]], dim=1)
    assert not torch.allclose(levels[1], _causal(head, ids, everywhere), atol=1e-3)


def test_chain_tokens_multiplies_the_levels_it_reaches():
    assert chain_tokens([0.5, 0.5]) == pytest.approx(0.5 + 0.25)
    assert chain_tokens([1.0, 1.0, 0.0]) == pytest.approx(2.0)
    assert chain_tokens([]) == 0.0


@torch.no_grad()
def test_a_fused_head_starts_where_its_unfused_warm_start_was(head, target_path, tmp_path):
    """`--aux` on top of `--init-from`: the fusion starts as the final state alone, so every level
    reads as the unfused head's did, whatever the lower layers' features; the export then
    carries the fusion and the layers it reads, and a warm start from it restores both."""
    from safetensors.torch import load_file

    from eagle_train import export, warm_start

    torch.manual_seed(2)
    export(head, list(range(96)), {}, tmp_path / "plain")
    plain = EagleHead(target_path, init_layer=1, fc_init="random").eval()
    fused = EagleHead(target_path, init_layer=1, fc_init="random", aux_layers=(0, 1)).eval()
    for h in (plain, fused):                                            # (the export is fp16)
        warm_start(h, tmp_path / "plain" / "eagle_head.safetensors")
    ids, feats = torch.randint(0, 96, (2, 10)), torch.randn(2, 10, 64)
    wide = torch.cat([torch.randn(2, 10, 128), feats], dim=-1)          # two lower layers' outputs, then f
    for a, b in zip(fused.unrolled(ids, wide, 3), plain.unrolled(ids, feats, 3)):
        torch.testing.assert_close(a, b)
    fused.fuse.weight.add_(0.1 * torch.randn_like(fused.fuse.weight))
    export(fused, list(range(96)), {}, tmp_path / "fused")
    tensors = load_file(str(tmp_path / "fused" / "eagle_head.safetensors"))
    assert tensors["eagle.aux_layers"].tolist() == [0, 1] and tensors["eagle.fuse.weight"].shape == (64, 192)
    again = EagleHead(target_path, init_layer=1, fc_init="random", aux_layers=(0, 1))
    warm_start(again, tmp_path / "fused" / "eagle_head.safetensors")
    torch.testing.assert_close(again.fuse.weight, fused.fuse.weight.half().float())
    with pytest.raises(ValueError, match="give the same --aux"):
        warm_start(EagleHead(target_path, init_layer=1, fc_init="random"),
                   tmp_path / "fused" / "eagle_head.safetensors")
