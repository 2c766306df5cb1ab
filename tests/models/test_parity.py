"""Our Transformer, loaded from `save_pretrained` output, against transformers' own models."""
from __future__ import annotations

import pytest
import torch

from models import load_model
from models.transformer import causal_mask

from .conftest import prefill, save_hf

ATOL = 1e-4


def hf_logits_incremental(hf, ids: torch.Tensor, split: int) -> torch.Tensor:
    """HF logits [T, V] for ids [T]: prefill ids[:split], then one token at a time with its cache."""
    with torch.no_grad():
        out = hf(ids[None, :split], use_cache=True)
        rows, past = [out.logits[0]], out.cache
        for t in range(split, ids.shape[0]):
            out = hf(ids[None, t : t + 1], cache=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.cache
    return torch.cat(rows)


def ours_incremental(model, ids: torch.Tensor, split: int) -> torch.Tensor:
    cache = model.new_cache(num_blocks=16, block_size=4)
    with torch.no_grad():
        rows = [prefill(model, cache, 0, ids[:split])]
        for t in range(split, ids.shape[0]):
            out = model(ids[None, t : t + 1], torch.tensor([[t]]), cache, [0], causal_mask(1, 1))
            rows.append(out[0])
    assert cache.seq_len(0) == ids.shape[0]
    return torch.cat(rows)


CASES = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                              "rope_theta": 500.0}),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "dynamic-rope": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
                               "max_position_embeddings": 12}),
    "yarn-rope": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32}}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": 4096, "head_dim": 32}),
    # sliding windows shorter than the 21 tokens: every layer (Mistral), layers >= 1 (Qwen2)
    "mistral-window": ("mistral", {"sliding_window": 6, "head_dim": 32}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_decode_match_hf(tmp_path, case):
    arch, overrides = CASES[case]
    hf, path = save_hf(tmp_path, arch, **overrides)
    model = load_model(path)
    ids = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(7))
    expected = hf_logits_incremental(hf, ids, split=21)
    with torch.no_grad():
        got = prefill(model, model.new_cache(16, 4), "s", ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # incremental decode, crossing block edges (block_size 4) and, for dynamic, the trained context
    expected = hf_logits_incremental(hf, ids, split=5)
    torch.testing.assert_close(ours_incremental(model, ids, split=5), expected, atol=ATOL, rtol=0)


def test_sharded_checkpoint_matches_hf(tmp_path):
    hf, path = save_hf(tmp_path, "llama", max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    ids = torch.arange(3, 13)
    with torch.no_grad():
        got = prefill(load_model(path), load_model(path).new_cache(8, 4), 0, ids)
    torch.testing.assert_close(got, hf_logits_incremental(hf, ids, 10), atol=ATOL, rtol=0)


@pytest.mark.parametrize("case, window_layers", [("mistral-window", [0, 1]), ("qwen2-window", [1])])
def test_the_window_is_applied_where_transformers_applies_it(tmp_path, case, window_layers):
    """Mutation control for the windowed cases above: the same weights with full attention
    differ from transformers past the window, so those parity checks cannot pass vacuously."""
    arch, overrides = CASES[case]
    hf, path = save_hf(tmp_path, arch, **overrides)
    model = load_model(path)
    assert [i for i in range(model.config.num_layers) if model.config.window_of(i)] == window_layers
    assert model.config.max_position_embeddings == 256      # the context cap is the model's, not the window
    ids = torch.randint(0, 96, (21,), generator=torch.Generator().manual_seed(7))
    expected = hf_logits_incremental(hf, ids, split=21)
    for layer in model.layers:
        layer.sliding_window = None
    with torch.no_grad():
        full = prefill(model, model.new_cache(16, 4), "s", ids)
    assert (full[6:] - expected[6:]).abs().max() > 1e-2
    torch.testing.assert_close(full[:5], expected[:5], atol=ATOL, rtol=0)  # inside the window: same


@pytest.mark.parametrize("case", ["mistral-window", "qwen2-window"])
def test_tree_queries_near_the_window_edge_match_hf(tmp_path, case):
    """A tree over a prefix longer than the window: each node's logits equal transformers' last
    logits on prefix + that node's path, so the window counts from each node's own depth."""
    from .test_tree_forward import PARENTS, paths, tree_logits

    arch, overrides = CASES[case]
    hf, path = save_hf(tmp_path, arch, **overrides)
    prefix = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3))
    tokens = torch.tensor([4, 18, 60, 22, 7, 51, 33, 2])
    got = tree_logits(load_model(path), prefix, tokens)                # [T, V]
    with torch.no_grad():
        for i, node_path in enumerate(paths(PARENTS)):
            want = hf(torch.cat([prefix, tokens[node_path]])[None]).logits[0, -1]
            torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0, msg=f"node {i}")
