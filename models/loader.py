"""Load a Hugging Face checkpoint directory into a `Transformer`, and its tokenizer.

Reads `config.json` and the weights from `model.safetensors` or the shards named
by `model.safetensors.index.json`, maps the HF parameter names onto ours and
fuses q/k/v and gate/up into one matrix each, once, at load time.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from models.config import ModelConfig, UnsupportedModelError, rope_inv_freq
from models.eagle import AUX_LAYERS, FC_BIAS, FC_WEIGHT, FUSE_WEIGHT, EagleDraft, eagle_aux_layers, is_eagle_checkpoint
from models.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class ModelLoadError(ValueError):
    """The directory is missing, is not an HF checkpoint, or holds a model we cannot run."""


def load_config(path: str | Path) -> ModelConfig:
    path = _checked_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory: it has no config.json")
    try:
        hf = json.loads(config_file.read_text())
        return ModelConfig.from_hf(hf)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"cannot load {path}: {e}") from e
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load {path}: config.json is malformed ({e!r})") from e


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A ready `Transformer` (eval mode, no grads) from an HF checkpoint directory."""
    config = load_config(path)
    hf_weights = _read_safetensors(Path(path), device)
    state = hf_to_state_dict(hf_weights, config)
    model_class = Transformer
    extra = {}
    if is_eagle_checkpoint(hf_weights):
        model_class, extra = EagleDraft, {"aux_layers": eagle_aux_layers(hf_weights)}
        state |= {"fc.weight": hf_weights[FC_WEIGHT], "fc.bias": hf_weights[FC_BIAS]}
        if (FUSE_WEIGHT in hf_weights) != bool(extra["aux_layers"]):
            raise ModelLoadError(f"cannot load {path}: {FUSE_WEIGHT} and {AUX_LAYERS} come together")
        if FUSE_WEIGHT in hf_weights:
            state["fuse.weight"] = hf_weights[FUSE_WEIGHT]
    with torch.device("meta"):
        model = model_class(config, **extra)
    state = {k: v.to(dtype=dtype) for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelLoadError(f"cannot load {path}: weights do not match config.json ({e})") from e
    model.inv_freq = rope_inv_freq(config)[0].to(device)   # buffers built on meta hold no data
    return model.requires_grad_(False).eval()


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer (transformers `AutoTokenizer`, chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_checked_dir(path)))


def _checked_dir(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; expected a Hugging Face model directory")
    return path


def _read_safetensors(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    """All tensors of the single-file or sharded checkpoint, by HF name."""
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())
        files = sorted(set(index["weight_map"].values()))
    elif (path / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise ModelLoadError(
            f"{path} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} (safetensors only)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (path / name).is_file():
            raise ModelLoadError(f"{path}: shard {name} named in {INDEX_FILE} is missing")
        with safe_open(str(path / name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def hf_to_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF Llama/Qwen2/Mistral weight names to `Transformer.state_dict()` names, fusing
    q/k/v → `qkv_proj` and gate/up → `gate_up_proj`."""
    def take(name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("model.")):
            if key in hf:
                return hf[key]
        raise ModelLoadError(f"checkpoint is missing weight {name!r}")

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = src + "self_attn.", src + "mlp."
        out[dst + "attn_norm"] = take(src + "input_layernorm.weight")
        out[dst + "mlp_norm"] = take(src + "post_attention_layernorm.weight")
        kinds = ["weight"] + (["bias"] if config.attention_bias else [])
        for kind in kinds:
            out[dst + f"qkv_proj.{kind}"] = torch.cat([take(attn + f"{p}_proj.{kind}") for p in "qkv"])
        for kind in ["weight"] + (["bias"] if config.attention_out_bias else []):
            out[dst + f"o_proj.{kind}"] = take(attn + f"o_proj.{kind}")
        for kind in ["weight"] + (["bias"] if config.mlp_bias else []):
            out[dst + f"gate_up_proj.{kind}"] = torch.cat(
                [take(mlp + f"gate_proj.{kind}"), take(mlp + f"up_proj.{kind}")]
            )
            out[dst + f"down_proj.{kind}"] = take(mlp + f"down_proj.{kind}")
    return out
