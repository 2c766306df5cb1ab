"""What an engine serves: requests, the chunks it streams back, and the Engine protocol.

The serving layer (serving/) only sees `Engine`; the Ray pipeline, the in-process engine
and test fakes all implement it (docs/internals.md, "speculation"). Per-request speculation
options left as None take the server's defaults (`speculation.settings.SpeculationSettings`),
resolved once, by `resolve_speculation`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Protocol

from models.sampling import SamplingParams
from speculation.settings import MAX_SPEC_LEN, MAX_TREE_WIDTH, MODES, PROPOSERS

if TYPE_CHECKING:
    from speculation.settings import SpeculationSettings
    from speculation.stats import SpecStats


class InvalidRequest(ValueError):
    """A request this engine cannot serve as asked (the serving layer answers 400); `param`
    names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):   # picklable: Ray carries it from an actor to the caller
        return (InvalidRequest, (str(self), self.param))


@dataclass
class SpeculationOptions:
    """Per-request speculation settings; None means the server default."""

    mode: str | None = None          # "off" | "chain" | "tree" | "auto" (adaptive)
    spec_len: int | None = None      # chain length K / tree depth
    tree_width: int | None = None    # children per tree node
    proposer: str | None = None      # "model" | "ngram"

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, got {self.mode!r}")
        if self.proposer is not None and self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.spec_len is not None and not 1 <= self.spec_len <= MAX_SPEC_LEN:
            raise ValueError(f"spec_len must be in [1, {MAX_SPEC_LEN}], got {self.spec_len}")
        if self.tree_width is not None and not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be in [1, {MAX_TREE_WIDTH}], got {self.tree_width}")


@dataclass(frozen=True)
class ResolvedSpeculation:
    """A request's speculation with every default filled in."""

    mode: str                        # "off" | "chain" | "tree" | "auto"
    spec_len: int                    # K: the depth ceiling
    tree_width: int                  # 1 for "chain"
    proposer: str                    # "model" | "ngram"


def resolve_speculation(options: SpeculationOptions | None, defaults: SpeculationSettings,
                        proposers: tuple[str, ...] = PROPOSERS) -> ResolvedSpeculation:
    """The request's options over the server's defaults. `proposers`: what the engine holds;
    a request (or default) naming another, with speculation on, is an `InvalidRequest`."""
    options = options or SpeculationOptions()
    mode = options.mode or defaults.mode
    proposer = options.proposer or defaults.proposer
    width = 1 if mode == "chain" else (options.tree_width or defaults.tree_width)
    if mode != "off" and proposer not in proposers:
        held = " and ".join(repr(p) for p in proposers) or "none"
        raise InvalidRequest(f"speculation proposer {proposer!r} is not available here: this deployment "
                             f"drafts with {held} (or set speculation mode 'off')", "speculation.proposer")
    return ResolvedSpeculation(mode, options.spec_len or defaults.spec_len, width, proposer)


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    prefix_cache: bool = True        # False: neither start on cached KV blocks nor leave its own cached


@dataclass
class GenerationChunk:
    """Tokens committed by one verification step of one request."""

    request_id: str
    token_ids: list[int]             # newly committed tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_drafted: int = 0              # cumulative for the request
    num_accepted: int = 0             # cumulative for the request
    error: str | None = None          # set with finish_reason "error"; retryable errors say so
    cached_tokens: int = 0            # prompt tokens found in the target's prefix cache
    logprobs: list | None = None      # with sampling.logprobs: a models.sampling.TokenLogprob per token
    prompt_logprobs: list | None = None   # first chunk, with sampling.prompt_logprobs: None, then one per prompt token


def error_chunk(request_id: str, message: str) -> GenerationChunk:
    """A request's last chunk when it failed or was refused: no tokens, `message` its error."""
    return GenerationChunk(request_id, [], True, "error", error=message)


def merge_chunks(first: GenerationChunk, then: GenerationChunk) -> GenerationChunk:
    """One chunk carrying what `first` and `then` (of the same request, in that order) carry:
    their tokens and log-probabilities in order, `first`'s prompt log-probabilities, `then`'s
    counts (cumulative) and ending."""
    logprobs = None if first.logprobs is None and then.logprobs is None else \
        (first.logprobs or []) + (then.logprobs or [])
    return GenerationChunk(then.request_id, first.token_ids + then.token_ids, then.finished, then.finish_reason,
                           then.num_drafted, then.num_accepted, then.error, then.cached_tokens, logprobs,
                           first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs)


@dataclass
class GenerationOutput:
    """A whole request, as the in-process engine's blocking `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]              # generated tokens only
    finish_reason: str                # "stop" | "length" | "abort" | "error"
    stats: SpecStats                  # this request's speculation and timings
    error: str | None = None
    logprobs: list | None = None      # with sampling.logprobs: a models.sampling.TokenLogprob per token
    prompt_logprobs: list | None = None   # with sampling.prompt_logprobs: None, then one per prompt token


class Engine(Protocol):
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_id: str) -> None: ...       # frees its KV blocks and ring slots

    async def health(self) -> dict: ...                        # {"ok": bool, "speculation": bool, ...}

    async def stats(self) -> dict: ...                         # speculative metrics for /metrics
