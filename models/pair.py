"""A target and its draft as checkpoint directories: what the engines check and read of them
before they load either (DESIGN.md §2: the draft must speak the target's vocabulary)."""
from __future__ import annotations

import json
from pathlib import Path

from models.loader import ModelLoadError, load_config, load_tokenizer

DRAFT_META = "specflash_draft.json"   # optional beside a draft: {"logit_rows": [...]} (a reduced LM head)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def eos_token_ids(target_dir: str | Path) -> list[int]:
    """EOS ids of the target: config.json's plus the tokenizer's, when it has one."""
    eos = set(load_config(target_dir).eos_token_ids)
    if has_tokenizer(target_dir):
        tok_eos = load_tokenizer(target_dir).eos_token_id
        if tok_eos is not None:
            eos.add(tok_eos)
    return sorted(eos)


def check_vocabularies(target_dir, target_config, tokenizer, draft_dir, draft_config) -> None:
    """The draft must speak the target's vocabulary: same size, same tokenizer if it has one."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ModelLoadError(f"draft and target vocabularies differ: the draft {draft_dir} has "
                             f"{draft_config.vocab_size} tokens, the target {target_dir} has "
                             f"{target_config.vocab_size}")
    if has_tokenizer(draft_dir) and load_tokenizer(draft_dir).get_vocab() != tokenizer.get_vocab():
        raise ModelLoadError(f"draft and target tokenizers differ ({draft_dir} vs {target_dir}): "
                             f"the same token id must mean the same text in both")


def read_logit_rows(draft_dir, vocab_size: int) -> list[int] | None:
    """The draft's reduced LM head rows from specflash_draft.json, if it has one."""
    meta = Path(draft_dir) / DRAFT_META
    if not meta.is_file():
        return None
    try:
        rows = json.loads(meta.read_text()).get("logit_rows")
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{meta} is not valid JSON ({e})") from e
    if rows is not None and (not rows or not all(isinstance(r, int) and 0 <= r < vocab_size for r in rows)):
        raise ModelLoadError(f"{meta}: logit_rows must be a non-empty list of token ids in [0, {vocab_size})")
    return rows
