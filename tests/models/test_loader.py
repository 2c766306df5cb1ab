"""Loader errors name the problem; the package names resolve to this repository."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from models import ModelLoadError, load_model, load_tokenizer
from models.loader import load_config

from .conftest import save_hf

REPO = Path(__file__).resolve().parents[2]


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "readme.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_directory_without_weights(tmp_path):
    _, path = save_hf(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has no weights"):
        load_model(path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'") as e:
        load_model(tmp_path)
    for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert name in str(e.value)
    assert isinstance(e.value, ValueError)


def test_config_fields_from_hf(tmp_path):
    _, path = save_hf(tmp_path, "mistral", sliding_window=4096, tie_word_embeddings=True, eos_token_id=[2, 5])
    cfg = load_config(path)
    assert (cfg.arch, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("mistral", 2, 4, 2, 16)
    assert cfg.sliding_window == 4096 and cfg.tie_word_embeddings and cfg.eos_token_ids == [2, 5]
    _, path = save_hf(tmp_path, "qwen2", seed=1)
    cfg = load_config(path)
    assert cfg.attention_bias and not cfg.attention_out_bias and cfg.sliding_window is None


def test_rope_scaling_from_old_and_new_config_layouts():
    from models import ModelConfig

    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64)
    old = ModelConfig.from_hf({**base, "rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}})
    assert old.rope_theta == new.rope_theta == 500.0
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    plain = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert plain.rope_scaling is None and plain.rope_theta == 7.0
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_package_names_resolve_to_this_repo():
    import kernels
    import models
    from transformers.utils.import_utils import is_kernels_available

    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert Path(models.__file__).resolve().parent == REPO / "models"
    assert is_kernels_available() is False, "transformers takes our `kernels` for its optional dependency"


def test_load_tokenizer_reads_the_saved_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded("hello world there")["input_ids"] == [3, 4, 0]
    assert loaded.eos_token_id == 2
