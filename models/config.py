"""Model shapes (`ModelConfig`) read from Hugging Face `config.json`, and RoPE frequencies.

One dataclass covers the three Llama-family layouts we serve: Llama, Qwen2
(bias on the q/k/v projections) and Mistral. Mistral, and Qwen2 with
`use_sliding_window`, may name a sliding window (Beltagy et al. 2020, Longformer;
Jiang et al. 2023, Mistral 7B): a query at position i sees keys at positions j with
i - j < sliding_window, on every layer (Mistral) or on the layers `layer_types` names
`sliding_attention` (Qwen2: those from `max_window_layers` on), exactly as transformers
masks it. The context is still capped by `max_position_embeddings`, as the model is.

RoPE (Su et al. 2021, "RoFormer") with the scalings those checkpoints use:
`default`, `linear` (position interpolation, Chen et al. 2023), `dynamic`
(NTK-aware base stretching, applied once a sequence outgrows the pretraining
context), `llama3` (per-band rescaling of Llama 3.1) and `yarn` (Peng et al.
2023: ramped interpolation plus an attention temperature).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# model_type -> the HF class name that checkpoints of it carry in `architectures`.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The config names an architecture, activation or RoPE variant this package cannot run."""


@dataclass
class ModelConfig:
    arch: str = "llama"                  # llama | qwen2 | mistral
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None   # {"rope_type": ..., factor, ...}; None = default
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # bias on q/k/v projections (Qwen2; Llama's attention_bias)
    attention_out_bias: bool = False     # bias on o_proj (Llama's attention_bias only)
    mlp_bias: bool = False               # bias on gate/up/down (Llama's mlp_bias)
    sliding_window: int | None = None    # keys a query sees: positions i - j < sliding_window
    window_layers: list[int] | None = None   # layers using the window; None = every layer
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(_unsupported_message(self.arch))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`; None = full (causal) attention."""
        if self.sliding_window is None or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        arch = _arch_of(hf)
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only SwiGLU (silu) is implemented")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_of(hf)
        sliding, window_layers = _sliding_window_of(arch, hf)
        bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bias,
            attention_out_bias=bias if arch == "llama" else False,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=sliding,
            window_layers=window_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _sliding_window_of(arch: str, hf: dict[str, Any]) -> tuple[int | None, list[int] | None]:
    """(window, the layers using it) as transformers applies them: `layer_types` when the config
    lists them; Qwen2: only with `use_sliding_window`, on layers >= `max_window_layers`; else all."""
    window = hf.get("sliding_window")
    if window is None or (arch == "qwen2" and not hf.get("use_sliding_window", False)):
        return None, None
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        layers = [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
    elif arch == "qwen2":
        layers = list(range(hf.get("max_window_layers", 28), n))
    else:
        return int(window), None
    return (int(window), layers) if layers else (None, None)


def _unsupported_message(name: str) -> str:
    names = ", ".join(f"{k} ({v})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return f"unsupported architecture {name!r}; supported: {names}"


def _arch_of(hf: dict[str, Any]) -> str:
    """The model_type we know, from `model_type` or else the first of `architectures`."""
    model_type = hf.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    by_class = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
    for name in hf.get("architectures") or []:
        if name in by_class:
            return by_class[name]
    named = model_type or ", ".join(hf.get("architectures") or []) or "<none given>"
    raise UnsupportedModelError(_unsupported_message(named))


def _rope_of(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from `rope_parameters` (5.x) or `rope_scaling` (4.x)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            hf.get("original_max_position_embeddings", hf.get("max_position_embeddings", 2048)),
        )
    return theta, params


def rope_inv_freq(config: ModelConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2] float32` and the cos/sin scale (YaRN's attention factor).

    `seq_len` (largest position + 1 in the batch) only matters for `dynamic`.
    """
    dim = config.head_dim
    base = config.rope_theta
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim   # [dim/2]
    if rope_type == "dynamic":
        base = _dynamic_base(config, base, dim, seq_len)
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config, base, exponents, scaling)
    return inv_freq, 1.0


def _dynamic_base(config: ModelConfig, base: float, dim: int, seq_len: int | None) -> float:
    """NTK-aware base: unchanged inside the trained context, stretched beyond it."""
    trained = config.max_position_embeddings
    seq_len = max(seq_len or trained, trained)
    factor = config.rope_scaling["factor"]
    return base * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Keep high frequencies, divide low ones by `factor`, blend linearly in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(
    config: ModelConfig, base: float, exponents: torch.Tensor, s: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the slow dimensions, extrapolate the fast ones, ramp in between."""
    dim = config.head_dim
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp                          # 1 = keep the original frequency
    pos_freqs = base ** exponents
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn_factor)
