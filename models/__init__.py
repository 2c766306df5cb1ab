"""Llama-family transformer with a paged KV cache, HF checkpoint loading and sampling.

Contract: docs/internals.md, `models` section. `models.embedded` (the default
model pair) is imported on its own, not from here.
"""
from models.config import ModelConfig
from models.kv_cache import OutOfBlocks, PagedKVCache
from models.loader import ModelLoadError, load_model, load_tokenizer
from models.sampling import SamplingParams
from models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "PagedKVCache",
    "OutOfBlocks",
    "Transformer",
    "load_model",
    "load_tokenizer",
    "ModelLoadError",
    "SamplingParams",
]
