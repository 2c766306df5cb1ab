"""Shared fixtures: tiny random Llama checkpoints saved the way Hugging Face saves them.

- `tiny_target`: a 2-layer Llama with a byte-level tokenizer (260 tokens, chat template).
- `close_draft`: the target's weights, slightly perturbed (high acceptance).
- `far_draft`: other random weights, one layer (low acceptance).
- `small_vocab_pair`: a 16-token target and a far draft, for statistical sampling tests.
- `bench_script`: `bench_script("load")` is bench/load.py loaded as a module (bench/ stays
  off sys.path, where its kernels.py would shadow the package).

Each is a directory made with `save_pretrained`, loaded back through `models.load_model`
by the tests, so the loader is part of every path under test.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch

# Without CUDA the Triton kernels run under the interpreter; it must be chosen
# before anything imports triton, and conftest.py loads before the test modules.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

BENCH = Path(__file__).resolve().parents[1] / "bench"
BYTE_VOCAB = 256
BOS, EOS, PAD = 256, 257, 258
TINY_VOCAB = 260
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A byte-level BPE with no merges: one token per byte, plus <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({"<s>": BOS, "</s>": EOS, "<pad>": PAD})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llama_config(vocab_size: int = TINY_VOCAB, layers: int = 2, hidden: int = 64, **overrides):
    from transformers import LlamaConfig

    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, initializer_range=0.2,
                  bos_token_id=BOS if vocab_size > BOS else None,
                  eos_token_id=EOS if vocab_size > EOS else None)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_llama(path, config, seed: int, tokenizer=None, perturb_from=None, noise: float = 0.0):
    """Random weights (or `perturb_from`'s plus Gaussian noise) saved as an HF checkpoint."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    if perturb_from is not None:
        model.load_state_dict(perturb_from.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def save_eagle(path, target_dir, seed: int, tokenizer=None, fc_scale: float = 0.2, aux_layers: tuple = ()):
    """A random feature-conditioned (EAGLE) draft head for the target in `target_dir`: one
    decoder layer, the target's embeddings and LM head, and the `eagle.fc.*` tensors (with
    `aux_layers`, a fused head: `eagle.fuse.weight` over those target layers and the final state)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(seed)
    state = {k: v.clone().contiguous() for k, v in LlamaForCausalLM(config).state_dict().items()}
    target = load_file(str(Path(target_dir) / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in target:
            state[name] = target[name].clone()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    H = config.hidden_size
    state["eagle.fc.weight"] = fc_scale * torch.randn(H, 2 * H)
    state["eagle.fc.bias"] = torch.zeros(H)
    if aux_layers:
        state["eagle.fuse.weight"] = torch.randn(H, (len(aux_layers) + 1) * H) / (len(aux_layers) + 1) ** 0.5 / H ** 0.5
        state["eagle.aux_layers"] = torch.tensor(aux_layers, dtype=torch.int64)
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


@pytest.fixture(scope="session")
def bench_script():
    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"specflash_bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module          # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    save_llama(path, llama_config(), seed=0, tokenizer=byte_tokenizer())
    return path


@pytest.fixture(scope="session")
def copying_target(tmp_path_factory):
    """A target whose greedy output walks a cycle of bytes (a, b, ..., l, a, ...), mostly from
    each token's own embedding (the blocks' outputs scaled down, not removed): a prompt that
    walked the cycle is what its output repeats, so prompt-lookup chains get accepted."""
    from transformers import LlamaForCausalLM

    cycle = list(b"abcdefghijkl")
    path = tmp_path_factory.mktemp("copying_target")
    torch.manual_seed(5)
    model = LlamaForCausalLM(llama_config()).eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        succ = torch.arange(emb.shape[0])
        succ[cycle] = torch.tensor(cycle[1:] + cycle[:1])          # the token after each token
        model.lm_head.weight.zero_()
        model.lm_head.weight[succ] = 4.0 * emb / emb.norm(dim=1, keepdim=True)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path, safe_serialization=True)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_target(tiny_target):
    """The target through transformers itself: the reference every exactness test compares with."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_target).eval()


@pytest.fixture(scope="session")
def close_draft(tmp_path_factory, hf_target):
    path = tmp_path_factory.mktemp("close_draft")
    save_llama(path, llama_config(), seed=1, tokenizer=byte_tokenizer(), perturb_from=hf_target, noise=0.02)
    return path


@pytest.fixture(scope="session")
def far_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("far_draft")
    save_llama(path, llama_config(layers=1), seed=2, tokenizer=byte_tokenizer())
    return path


@pytest.fixture(scope="session")
def other_vocab_draft(tmp_path_factory):
    """A draft whose vocabulary (300 tokens) is not the target's."""
    path = tmp_path_factory.mktemp("other_vocab_draft")
    save_llama(path, llama_config(vocab_size=300, layers=1), seed=5)
    return path


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """(target_dir, draft_dir) over 16 tokens, no tokenizer, for distribution tests.

    The draft is the target with heavy noise: per-token acceptance around 0.4,
    so acceptance, rejection and the residual all happen often.
    """
    target = tmp_path_factory.mktemp("small_target")
    draft = tmp_path_factory.mktemp("small_draft")
    config = llama_config(vocab_size=16, hidden=32, initializer_range=0.3)
    model = save_llama(target, config, seed=3)
    save_llama(draft, config, seed=4, perturb_from=model, noise=0.3)
    return target, draft


@pytest.fixture(scope="session")
def eagle_draft(tmp_path_factory, tiny_target):
    """A random EAGLE draft head for the tiny target (acceptance low, every path exercised)."""
    path = tmp_path_factory.mktemp("eagle_draft")
    save_eagle(path, tiny_target, seed=6, tokenizer=byte_tokenizer())
    return path


@pytest.fixture(scope="session")
def fused_eagle_draft(tmp_path_factory, tiny_target):
    """A random fused EAGLE head (EAGLE-3's multi-layer features) reading both of the tiny
    target's layers beside its final state."""
    path = tmp_path_factory.mktemp("fused_eagle_draft")
    save_eagle(path, tiny_target, seed=8, tokenizer=byte_tokenizer(), aux_layers=(0, 1))
    return path


# -- Ray: one local two-node cluster per session (tests/ray_cluster.py) ----------------------
@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from tests.ray_cluster import start_cluster

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    cluster, drafter_node = start_cluster()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield SimpleNamespace(cluster=cluster, drafter_node=drafter_node.node_id,
                              verifier_node=cluster.head_node.node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def make_engine(ray_cluster):
    """Build PipelineEngines on the shared cluster; their actors are killed after the test."""
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import pipeline_args

    engines = []

    def make(target_dir, draft_dir, *, num_pipelines=1, drafters=1, strategy="NONE",
             speculation=None, **settings):
        settings.setdefault("num_blocks", 512)
        engine = build_pipeline_engine(pipeline_args(drafters, strategy, **(speculation or {})),
                                       target_dir=str(target_dir),
                                       draft_dir=None if draft_dir is None else str(draft_dir),
                                       num_pipelines=num_pipelines, **settings)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.kill_pipeline_actors()
