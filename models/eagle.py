"""A feature-conditioned draft head (EAGLE, Li et al. 2024).

The draft reads, at position j, fc([embedding(t_j), f_{j-1}]) where f_{j-1} is the
target's final-norm hidden state at the previous position (the vector the target's
LM head reads), runs it through its own decoder layer(s) and final norm, and
predicts f_j; its LM head is the target's (tied embedding rows). Committed tokens
read the target's true features (the verifier returns them); tree nodes read the
draft's own prediction at their parent. `drafter.EagleProposer` drives it.

A fused head (EAGLE-3's multi-layer features) reads, instead of f_{j-1} alone,
fuse([rms(a_1), ..., rms(a_k), f_{j-1}]): the outputs of k lower target layers, each
RMS-normalised without a weight (a middle layer's residual stream runs to 10^4 in a few
dimensions, the final state to 50), beside the final state, projected back to H. The
target returns them side by side (`Transformer.set_feature_layers(aux_layers)`, features
[n, (k + 1) H]) and the head fuses them as they arrive (`fuse_features`); its own
predicted features stay H wide.

Checkpoint: an HF Llama directory of the head's layers (the target's embeddings
included) plus two extra tensors, `eagle.fc.weight` [H, 2H] and `eagle.fc.bias` [H]
(a fused head also `eagle.fuse.weight` [H, (k + 1) H] and `eagle.aux_layers` [k], the
target layers it reads); `models.load_model` returns an `EagleDraft` for any checkpoint
that has them.
"""
from __future__ import annotations

import torch

from models.config import ModelConfig
from models.linear import Linear
from models.transformer import Transformer

FC_WEIGHT, FC_BIAS = "eagle.fc.weight", "eagle.fc.bias"
FUSE_WEIGHT, AUX_LAYERS = "eagle.fuse.weight", "eagle.aux_layers"


class EagleDraft(Transformer):
    needs_features = True

    def __init__(self, config: ModelConfig, aux_layers: tuple[int, ...] = ()) -> None:
        super().__init__(config)
        H = config.hidden_size
        self.fc = Linear(2 * H, H, bias=True)
        self.aux_layers = tuple(aux_layers)   # the target layers fused with its final state; () none
        self.fuse = Linear((len(self.aux_layers) + 1) * H, H, bias=False) if self.aux_layers else None
        self.requires_grad_(False)

    @property
    def target_feature_width(self) -> int:
        """The width of the target's features this head reads: (len(aux_layers) + 1) * hidden."""
        return (len(self.aux_layers) + 1) * self.config.hidden_size

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [n, target_feature_width] → the head's input features [n, hidden]."""
        if features.shape[-1] != self.target_feature_width:
            raise ValueError(f"target features {tuple(features.shape)}: this head reads "
                             f"{self.target_feature_width} a position (target layers {list(self.aux_layers)} "
                             f"and the final state)")
        if self.fuse is None:
            return features
        x = fused_input(features, self.config.hidden_size, self.config.rms_norm_eps)
        return self.fuse(x.to(self.fuse.weight.dtype))

    def _inputs(self, input_ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if features is None:
            raise ValueError("a feature-conditioned (EAGLE) draft needs the target's features as input")
        if features.shape[:-1] != input_ids.shape:
            raise ValueError(f"features {tuple(features.shape)} do not match input ids {tuple(input_ids.shape)}")
        return self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))


def fused_input(features: torch.Tensor, hidden_size: int, eps: float) -> torch.Tensor:
    """[..., (k + 1) H] target features → what a fused head's `fuse` reads, float32: each of the
    k layer outputs RMS-normalised (no weight), the final state as it is."""
    x = features.float()
    aux = x[..., :-hidden_size].unflatten(-1, (-1, hidden_size))
    aux = aux * torch.rsqrt(aux.pow(2).mean(-1, keepdim=True) + eps)
    return torch.cat([aux.flatten(-2), x[..., -hidden_size:]], dim=-1)


def is_eagle_checkpoint(hf_weights: dict) -> bool:
    return FC_WEIGHT in hf_weights


def eagle_aux_layers(hf_weights: dict) -> tuple[int, ...]:
    """The target layers a loaded checkpoint's head fuses (() for a plain EAGLE head)."""
    aux = hf_weights.get(AUX_LAYERS)
    return () if aux is None else tuple(int(i) for i in aux.reshape(-1).tolist())


def _tensor_file(path, name: str):
    """The safetensors file of a checkpoint directory that holds tensor `name`, or None."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    path = Path(path)
    if (path / "model.safetensors.index.json").is_file():
        weight_map = json.loads((path / "model.safetensors.index.json").read_text()).get("weight_map", {})
        return path / weight_map[name] if name in weight_map else None
    if not (path / "model.safetensors").is_file():
        return None
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return path / "model.safetensors" if name in f.keys() else None


def is_eagle_dir(path) -> bool:
    """Whether a checkpoint directory holds a feature-conditioned draft (reads tensor names only)."""
    return _tensor_file(path, FC_WEIGHT) is not None


def eagle_dir_aux_layers(path) -> tuple[int, ...]:
    """The target layers the head in a checkpoint directory fuses, without loading it: what the
    target's side (`TargetSide(feature_layers=...)`) must return beside its final state."""
    from safetensors import safe_open

    file = _tensor_file(path, AUX_LAYERS)
    if file is None:
        return ()
    with safe_open(str(file), framework="pt") as f:
        return eagle_aux_layers({AUX_LAYERS: f.get_tensor(AUX_LAYERS)})
