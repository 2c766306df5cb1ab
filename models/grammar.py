"""Structured output: a request's grammar, compiled once, and its token masks along a tree.

The grammar engine is xgrammar (Dong et al. 2024), chosen over llguidance by the mask's cost
per token on the embedded tokenizer (SmolLM2, 49152 tokens, a nested JSON schema, 47 tokens:
median 2.0-2.7 us for xgrammar against 8.6-10.7 us for llguidance, on this CPU); both are
CPU-capable and maintained, and xgrammar's matcher forks and rolls back, which a tree needs.
Only this module imports it (lazily: its import takes seconds).

The contract is `GrammarSpec` (a frozen dataclass: it rides in `SamplingParams.grammar`, on
the wire as a dict). Each side compiles it against its own copy of the vocabulary
(`register_vocabulary`, or a tokenizer directory named by `GrammarSpec.vocabulary`) and keeps
one `GrammarCursor` per spec object: the matcher after the output committed so far. A row's
allowed tokens (`grammar_mask`) are the cursor synced to the row's committed output (rolled
back to the longest common prefix with what it had consumed, then advanced: a rejection, or
the drafter's contradicted assumption, is a rollback), then forked along the row's tree path,
so siblings with different grammar states each get their own. A row whose path holds a token
the grammar refuses is unreachable (that token has probability 0 at its parent under p):
everything is allowed there. Once the grammar has accepted its end (a stop token), only stop
tokens are allowed: the choice ends with finish_reason "stop".
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger("specflash.models")
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice")
_lock = threading.Lock()
_vocabularies: dict[str, object] = {}      # key -> xgrammar.TokenizerInfo
_compilers: dict[str, object] = {}         # key -> xgrammar.GrammarCompiler
_compiled: dict[tuple, object] = {}        # (key, kind, source, strict) -> xgrammar.CompiledGrammar
_loading: dict[str, threading.Lock] = {}   # key -> held while its tokenizer directory is loaded
MAX_COMPILED = 256                         # compiled grammars kept (oldest dropped first)


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `field` names the request field at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class GrammarSpec:
    kind: str                  # one of GRAMMAR_KINDS
    source: str = ""           # json_schema: the schema as JSON text; regex: the pattern;
    #                            choice: a JSON list of the allowed strings; json_object: ""
    vocabulary: str = ""       # key of the vocabulary compiled against (`register_vocabulary`), or
    #                            a tokenizer directory every side can read
    strict: bool = True        # json_schema: no properties beyond the schema's (OpenAI's strict)
    draft: bool = True         # False: the draft proposes freely and only the target is masked
    #                            (exact too, a benchmark's control: it costs acceptance)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}", "grammar")

    def cursor(self, stop_ids: Sequence[int]) -> GrammarCursor:
        """This spec object's cursor (made on first use, with these stop tokens)."""
        cur = self.__dict__.get("_cursor")
        if cur is None:
            cur = GrammarCursor(compile_grammar(self), stop_ids)
            object.__setattr__(self, "_cursor", cur)     # a cache, not a field: never on the wire
        return cur


def register_vocabulary(key: str, tokenizer=None, tokens: Sequence[str] | None = None,
                        vocab_size: int | None = None, stop_ids: Sequence[int] = ()) -> str:
    """Make `key` name a vocabulary: a Hugging Face tokenizer's, or `tokens` (the string of each
    id, for tiny test vocabularies). `vocab_size`: the model's logits width (>= the tokenizer's)."""
    import xgrammar as xgr

    if tokenizer is not None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_ids) or None)
    else:
        info = xgr.TokenizerInfo(list(tokens), vocab_size=vocab_size or len(tokens),
                                 stop_token_ids=list(stop_ids) or None)
    with _lock:
        _vocabularies[key] = info
        _compilers[key] = xgr.GrammarCompiler(info, max_threads=1)
    return key


def _compiler(key: str):
    with _lock:
        if key in _compilers:
            return _compilers[key]
    if key and os.path.isdir(key):          # another process of the pipeline: load it there, once
        with _lock:
            loading = _loading.setdefault(key, threading.Lock())
        with loading:
            if key not in _compilers:
                from transformers import AutoTokenizer

                register_vocabulary(key, AutoTokenizer.from_pretrained(key))
        return _compilers[key]
    raise GrammarError(f"no vocabulary {key!r} to compile a grammar against", "grammar")


def preload_vocabulary(model_dir: str) -> str | None:
    """Load the vocabulary of `model_dir`'s tokenizer for grammars now, under the key the server
    names it by (its absolute path: serving/structured.py); the key, or None where the directory
    holds no tokenizer or it cannot be loaded (a request asking for it meets the error itself).
    A pipeline actor calls this while it is built: loaded on a structured request's first mask
    instead, it imports transformers and the tokenizer (~1.8 s for the embedded target's on this
    project's CPU, tens of seconds on a loaded host) while every stream of that actor waits."""
    from models.pair import has_tokenizer

    key = os.path.abspath(model_dir)
    if not has_tokenizer(key):
        return None
    try:
        _compiler(key)
    except Exception as e:
        log.warning("grammar vocabulary of %s not preloaded: %s: %s", key, type(e).__name__, e)
        return None
    return key


def compile_grammar(spec: GrammarSpec):
    """The spec compiled (cached); `GrammarError` naming the field for a bad schema / regex / choice."""
    cache_key = (spec.vocabulary, spec.kind, spec.source, spec.strict)
    with _lock:
        hit = _compiled.get(cache_key)
    if hit is not None:
        return hit
    compiler = _compiler(spec.vocabulary)
    if spec.kind == "json_object":
        compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    elif spec.kind == "json_schema":
        try:
            json.loads(spec.source)
            compiled = compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=spec.strict)
        except Exception as e:          # xgrammar's RuntimeError, json's ValueError, or a bad type
            raise GrammarError(f"invalid JSON schema: {_short(e)}", "response_format.json_schema.schema") from None
    elif spec.kind == "regex":
        try:
            compiled = compiler.compile_regex(spec.source)
        except Exception as e:
            raise GrammarError(f"invalid regex: {_short(e)}", "guided_regex") from None
    else:
        choices = json.loads(spec.source) if spec.source else []
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
        compiled = compiler.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
    with _lock:
        if len(_compiled) >= MAX_COMPILED:
            _compiled.pop(next(iter(_compiled)))
        _compiled[cache_key] = compiled
    return compiled


def _short(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def _ebnf_literal(text: str) -> str:
    """An EBNF string literal matching `text` exactly (each character escaped as \\uXXXX or \\U)."""
    return '"' + "".join(c if c.isalnum() or c in " _-.,:;!?" else
                         (f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}") for c in text) + '"'


class GrammarCursor:
    """An xgrammar matcher after the tokens it consumed (the request's output so far)."""

    def __init__(self, compiled, stop_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stops = [int(t) for t in stop_ids] or None
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self.stop_ids = list(self.matcher.stop_token_ids)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.lock = threading.Lock()   # one side's threads may share a request's cursor
        self.consumed: list[int] = []
        self.accepted = 0          # how many of `consumed` the matcher took (the rest: refused)

    def sync(self, output: Sequence[int]) -> None:
        """Move to the state after `output`: roll back to the common prefix, then advance."""
        common = 0
        for a, b in zip(self.consumed, output):
            if a != b:
                break
            common += 1
        if common < self.accepted:
            self.matcher.rollback(self.accepted - common)
            self.accepted = common
        del self.consumed[common:]
        for t in output[common:]:
            if self.accepted == len(self.consumed) and self.matcher.accept_token(int(t)):
                self.accepted += 1
            self.consumed.append(int(t))

    def masks(self, output: Sequence[int], paths: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
        """Allowed tokens [N, vocab] bool after `output` + each path (module doc)."""
        self.sync(output)
        root = self.matcher if self.accepted == len(self.consumed) else None
        states: dict[tuple, object] = {(): root}

        def state(path: tuple):
            if path not in states:
                parent = state(path[:-1])
                child = None
                if parent is not None and not parent.is_terminated():
                    child = parent.fork()
                    if not child.accept_token(int(path[-1])):
                        child = None
                states[path] = child
            return states[path]

        bitmask = self._xgr.allocate_token_bitmask(len(paths), self.vocab_size)    # [N, ceil(V/32)] int32
        allowed = torch.ones(len(paths), vocab, dtype=torch.bool)
        for row, path in enumerate(paths):
            m = state(tuple(int(t) for t in path))
            if m is None:
                continue                                  # unreachable row: all allowed
            if m.is_terminated():
                allowed[row] = False
                allowed[row, [t for t in self.stop_ids if t < vocab]] = True
                continue
            m.fill_next_token_bitmask(bitmask, row)
            bits = (bitmask[row, :, None] >> torch.arange(32, dtype=torch.int32)) & 1   # [W, 32]
            row_mask = bits.reshape(-1)[:self.vocab_size].bool()
            allowed[row] = False
            allowed[row, :min(vocab, self.vocab_size)] = row_mask[:vocab]
        return allowed


def grammar_mask(spec: GrammarSpec, stop_ids: Sequence[int], output: Sequence[int],
                 paths: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[N, vocab] bool: the tokens the grammar allows after `output` + each of `paths`."""
    cursor = spec.cursor(stop_ids)
    with cursor.lock:
        return cursor.masks(output, paths, vocab)
