"""Tiny random HF checkpoints (saved with `save_pretrained`) and helpers shared by the model tests."""
from __future__ import annotations

import torch

from models.transformer import causal_mask

TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


def save_hf(tmp_path, arch: str = "llama", *, seed: int = 0, max_shard_size=None, **overrides):
    """Build a random `{Llama,Qwen2,Mistral}ForCausalLM`, save it, return (hf_model, dir)."""
    import transformers

    cls_config, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    cfg = cls_config(**{**TINY, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = cls_model(cfg).eval()
    # Norm weights start at 1 and biases at 0: perturb them so a mapping error shows up.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / f"{arch}-{seed}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(out, **kwargs)
    return hf, out


def prefill(model, cache, seq_id, ids: torch.Tensor, **kw):
    """Run a prompt [T] through `model` for a fresh sequence; returns logits [T, V]."""
    cache.add_sequence(seq_id)
    T = ids.shape[0]
    positions = torch.arange(T)[None]
    return model(ids[None], positions, cache, [seq_id], causal_mask(1, T), **kw)[0]
