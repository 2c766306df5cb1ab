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


def _forward(model, ids: list[int], **kw):
    cache = model.new_cache(8)
    cache.add_sequence("s")
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, ["s"], causal_mask(1, len(ids)), **kw)


@pytest.mark.parametrize("length", [5, 40])     # 1 to 16 rows take the C layer step, which updates in place
def test_a_target_with_feature_layers_returns_their_outputs_before_its_final_state(tiny_target, hf_target, length):
    target = load_model(tiny_target)
    H, ids = target.config.hidden_size, [(7 * i + 3) % 200 for i in range(length)]
    plain_logits, final = _forward(target, ids, return_hidden=True)
    target.set_feature_layers((0, 1))
    assert target.feature_width == 3 * H
    logits, hidden = _forward(target, ids, return_hidden=True)
    assert hidden.shape == (1, length, 3 * H)
    torch.testing.assert_close(logits, plain_logits)                 # the LM head reads the final state alone
    torch.testing.assert_close(hidden[..., -H:], final)
    with torch.no_grad():       # HF: hidden_states[1] is layer 0's output, the last one the final state
        ref = hf_target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden[..., :H], ref[1], atol=1e-4, rtol=1e-4)
    last = hidden[..., H:2 * H]                                      # the last layer's output, before the norm
    normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps) * target.norm
    torch.testing.assert_close(normed, ref[2], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(hidden[..., :H], hidden[..., H:2 * H], atol=1e-3)
    target.set_feature_layers(())
    torch.testing.assert_close(_forward(target, ids, return_hidden=True)[1], final)
    for bad in ((2,), (1, 0), (0, 0), (-1,)):
        with pytest.raises(ValueError, match="feature layers"):
            target.set_feature_layers(bad)


def test_a_fused_head_loads_with_its_layers_and_fuses_the_targets_features(tiny_target, fused_eagle_draft, eagle_draft,
                                                                           tmp_path):
    from safetensors.torch import load_file, save_file

    from models.eagle import eagle_dir_aux_layers
    from models.loader import ModelLoadError

    draft, plain = load_model(fused_eagle_draft), load_model(eagle_draft)
    H = draft.config.hidden_size
    assert draft.aux_layers == (0, 1) and draft.target_feature_width == 3 * H
    assert eagle_dir_aux_layers(fused_eagle_draft) == (0, 1) and eagle_dir_aux_layers(eagle_draft) == ()
    assert plain.fuse is None and plain.target_feature_width == H
    weights = load_file(str(fused_eagle_draft / "model.safetensors"))
    wide = torch.randn(4, 3 * H)
    normed = torch.cat([wide[:, :H] / wide[:, :H].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(),   # each layer's
                        wide[:, H:2 * H] / wide[:, H:2 * H].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(),  # RMS-normed
                        wide[:, 2 * H:]], dim=-1)                                                       # f as it is
    torch.testing.assert_close(draft.fuse_features(wide), normed @ weights["eagle.fuse.weight"].T)
    torch.testing.assert_close(plain.fuse_features(wide[:, :H]), wide[:, :H])
    with pytest.raises(ValueError, match=r"reads 192 a position \(target layers \[0, 1\]"):
        draft.fuse_features(wide[:, :H])
    # a fusion matrix without the layers it reads (or the other way round) is refused at load
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in fused_eagle_draft.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file({k: v for k, v in weights.items() if k != "eagle.aux_layers"}, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="come together"):
        load_model(broken)
