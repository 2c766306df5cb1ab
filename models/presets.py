"""Models named by shape instead of a checkpoint: `random:<preset>[:<seed>]`.

Large checkpoints are not at hand where a GPU benchmark runs, and a benchmark of an
8B-shaped target needs only its shapes: `random_model` builds a Transformer of a named
shape (a table of presets, as gpt-fast keeps) with random weights, on a device. `load` and
`config_of` take either such a name or a checkpoint directory, which is how the engines
load their models (verifier/target.py, drafter/draft_side.py).
"""
from __future__ import annotations

import torch

RANDOM_PRESETS = {
    # Llama-3-8B and Llama-3.2-1B shapes (vocabulary 128256, GQA 4:1)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, vocab_size=128256),
    # a one-layer EAGLE-style head of the 8B shape (`models.eagle.EagleDraft`: fc over
    # [embedding, the target's feature], one decoder layer of the target's width, an LM head
    # of its vocabulary): the draft bench/gpu_e2e.py prices with `--draft eagle`
    "llama3-8b-eagle": dict(hidden_size=4096, intermediate_size=14336, num_layers=1, num_heads=32,
                            num_kv_heads=8, vocab_size=128256, eagle=True),
    # CPU smoke shapes
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=512),
    "tiny-draft": dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                       vocab_size=512),
    "tiny-eagle": dict(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                       vocab_size=512, eagle=True),
}


def is_random(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith("random:")


def _preset(spec: str) -> dict:
    _, preset, *_ = spec.split(":")
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; known: {', '.join(RANDOM_PRESETS)}")
    return RANDOM_PRESETS[preset]


def is_random_eagle(spec: str | None) -> bool:
    """Whether `spec` names a random EAGLE-style head (a preset with `eagle`)."""
    return is_random(spec) and bool(_preset(spec).get("eagle"))


def is_eagle_spec(spec) -> bool:
    """Whether a draft named by a directory or a `random:` preset is an EAGLE head."""
    from models.eagle import is_eagle_dir

    if spec is None:
        return False
    return is_random_eagle(str(spec)) if is_random(str(spec)) else is_eagle_dir(spec)


def eagle_feature_layers(spec) -> tuple[int, ...]:
    """The target layers an EAGLE head named by a directory fuses beside the final state (`models.eagle`)."""
    from models.eagle import eagle_dir_aux_layers

    return () if spec is None or is_random(str(spec)) else eagle_dir_aux_layers(spec)


def random_config(spec: str):
    from models.config import ModelConfig

    shape = {k: v for k, v in _preset(spec).items() if k != "eagle"}
    return ModelConfig(arch="llama", head_dim=shape["hidden_size"] // shape["num_heads"],
                       max_position_embeddings=4096, rope_theta=500000.0, **shape)


def random_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """`random:<preset>[:<seed>]` -> a models.Transformer (an `EagleDraft` for an `eagle` preset)
    with N(0, 0.02) weights, eval mode."""
    from models.config import rope_inv_freq
    from models.eagle import EagleDraft
    from models.transformer import Transformer

    parts = spec.split(":")
    seed = int(parts[2]) if len(parts) > 2 else 0
    config = random_config(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = (EagleDraft if is_random_eagle(spec) else Transformer)(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(config)[0].to(device)
    return model.requires_grad_(False).eval()




def load(spec: str, device: str = "cpu", dtype: str = "float32"):
    """A checkpoint directory or `random:<preset>`, as a Transformer on `device`; on a GPU its
    small forwards run as CUDA graphs (`models.cuda_graphs`; SPECFLASH_CUDA_GRAPHS=0: eager)."""
    from models import cuda_graphs

    if is_random(spec):
        model = random_model(spec, device, getattr(torch, dtype))
    else:
        from models.loader import load_model

        model = load_model(spec, device=device, dtype=getattr(torch, dtype))
    cuda_graphs.enable(model)
    return model


def config_of(spec: str):
    """The ModelConfig of a checkpoint directory or `random:<preset>`."""
    if is_random(spec):
        return random_config(spec)
    from models.loader import load_config

    return load_config(spec)


def eos_of(spec: str) -> list[int]:
    """EOS ids of a checkpoint (`models.pair.eos_token_ids`); none for a random model."""
    if is_random(spec):
        return []
    from models.pair import eos_token_ids

    return eos_token_ids(spec)
