"""A feature-conditioned draft head (EAGLE, Li et al. 2024).

The draft reads, at position j, fc([embedding(t_j), f_{j-1}]) where f_{j-1} is the
target's final-norm hidden state at the previous position (the vector the target's
LM head reads), runs it through its own decoder layer(s) and final norm, and
predicts f_j; its LM head is the target's (tied embedding rows). Committed tokens
read the target's true features (the verifier returns them); tree nodes read the
draft's own prediction at their parent. `drafter.EagleProposer` drives it.

Checkpoint: an HF Llama directory of the head's layers (the target's embeddings
included) plus two extra tensors, `eagle.fc.weight` [H, 2H] and `eagle.fc.bias` [H];
`models.load_model` returns an `EagleDraft` for any checkpoint that has them.
"""
from __future__ import annotations

import torch

from models.config import ModelConfig
from models.linear import Linear
from models.transformer import Transformer

FC_WEIGHT, FC_BIAS = "eagle.fc.weight", "eagle.fc.bias"


class EagleDraft(Transformer):
    needs_features = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.fc = Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        self.requires_grad_(False)

    def _inputs(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            raise ValueError("a feature-conditioned (EAGLE) draft needs the target's features as input")
        if features.shape[:-1] != input_ids.shape:
            raise ValueError(f"features {tuple(features.shape)} do not match input ids {tuple(input_ids.shape)}")
        return self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))


def is_eagle_checkpoint(hf_weights: dict) -> bool:
    return FC_WEIGHT in hf_weights


def is_eagle_dir(path) -> bool:
    """Whether a checkpoint directory holds a feature-conditioned draft (reads tensor names only)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    path = Path(path)
    if (path / "model.safetensors.index.json").is_file():
        return FC_WEIGHT in json.loads((path / "model.safetensors.index.json").read_text()).get("weight_map", {})
    if not (path / "model.safetensors").is_file():
        return False
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return FC_WEIGHT in f.keys()
