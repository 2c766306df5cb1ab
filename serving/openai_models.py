"""Pydantic models of the OpenAI-compatible request bodies, and the API layer's data types.

Requests are validated in strict mode (`"max_tokens": "5"` is a type error, as in
OpenAI's API). Nothing a client sends is dropped: a field is implemented exactly, or
passes as a documented no-op (`NO_OP_FIELDS`: it changes nothing a server could do),
or is refused with a 400 naming it — an OpenAI field this server does not implement
(`REFUSED`, unless it carries its "off" value) as `unsupported_parameter`, any other
field as `unknown_parameter` (the field table is in docs/serving.md). Range checks that
depend on the model (context length, vocabulary) happen in `serving.openai_api`, which
knows the model.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serving.structured import ResponseFormat, Tool, ToolChoice
from speculation.requests import SpeculationOptions
from speculation.settings import MAX_SPEC_LEN, MAX_TREE_WIDTH
from models.sampling import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error answered with an OpenAI-style body `{"error": {message, type, code, param}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code,
                          "param": self.param}}

    def __reduce__(self):  # picklable: Ray carries it between processes (gRPC errors)
        return (APIError, (self.status, self.message, self.type, self.code, self.param,
                           self.headers))


# Parts of a pydantic error location that name a union member or validator, not a field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|function-.*|constrained-\w+|.*\[.*\]|[A-Z]\w*)$")


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400, naming the offending field. Of a union's members'
    errors, one that is not a type mismatch says best what is wrong (a list of 17 stop
    strings is too long, not "not a string")."""
    errors = exc.errors()
    err = next((e for e in errors if not e.get("type", "").endswith(("_type", "_parsing"))),
               errors[0])
    loc = ".".join(str(p) for p in err.get("loc", ()) if not _TYPE_TAG.match(str(p)))
    kind = err.get("type", "")
    code = "invalid_type" if ("type" in kind or kind.endswith("_parsing")) else "invalid_value"
    if kind == "missing":
        code = "missing_required_parameter"
    if kind == "extra_forbidden":
        return APIError(400, f"{loc}: unknown field; this server does not implement it, and refuses "
                        "it rather than ignore it (docs/serving.md lists the fields)",
                        code="unknown_parameter", param=loc or None)
    return APIError(400, f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")),
                    code=code, param=loc or None)


class SpeculationModel(BaseModel):
    """Per-request speculation: the `speculation` extension field (docs/serving.md)."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["off", "chain", "tree", "auto"] | None = Field(
        None, description="off: plain decoding; chain / tree: speculate that shape; auto: adaptive; "
                          "unset: the server's default (`speculation.mode` of its config)")
    spec_len: int | None = Field(None, ge=1, le=MAX_SPEC_LEN, description="chain length K / tree depth")
    tree_width: int | None = Field(None, ge=1, le=MAX_TREE_WIDTH, description="children per tree node")
    proposer: Literal["model", "ngram"] | None = Field(
        None, description="draft model or prompt lookup; unset: the server's default")

    def to_options(self) -> SpeculationOptions:
        return SpeculationOptions(mode=self.mode, spec_len=self.spec_len,
                                  tree_width=self.tree_width, proposer=self.proposer)


MAX_STOPS = 16
MAX_STOP_CHARS = 1024   # a stop string longer than this is refused (a hostile 1 MB one too)
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1,
                                   description="default: 16 (completions), rest of context (chat)")
    temperature: float = Field(1.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 = off")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer")
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOPS)], None] = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once from each token "
                                    "already in the output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted per occurrence in the output")
    repetition_penalty: float = Field(1.0, gt=0.0, description="vLLM's: > 1 discourages tokens of prompt "
                                      "and output; 1 = off")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="token id (a string, as OpenAI's API takes it) -> bias added to its logit")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's: drop tokens below min_p x the top "
                                                          "token's probability; 0 = off")
    min_tokens: int = Field(0, ge=0, description="vLLM's: EOS and stop_token_ids are masked until this "
                                                 "many tokens are generated")
    n: int = Field(1, ge=1, le=16)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: SpeculationModel | None = None
    return_token_ids: bool = Field(False, description="add each choice's token ids and its prompt's "
                                                      "`prompt_token_ids` (vLLM's extension)")
    prefix_cache: bool = Field(True, description="false: neither start on the server's cached KV blocks "
                               "nor leave this request's own cached (where the server caches prefixes)")
    # Structured output (serving.structured; completions take response_format as an extension)
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(None, max_length=4096, description="vLLM's: the output matches this regex")
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=256)] | None = \
        Field(None, description="vLLM's: the output is one of these strings")
    # No-ops (NO_OP_FIELDS): accepted, type-checked, and change nothing this server could do.
    user: str | None = Field(None, description="the end user's id; not used")
    metadata: dict[str, str] | None = Field(None, description="the client's tags; not stored")
    safety_identifier: str | None = Field(None, description="the end user's id; not used")
    prompt_cache_key: str | None = Field(None, description="a caching hint; not used")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return [s for s in stops if s]

    def token_fields(self, vocab_size: int) -> list[tuple[int, float]]:
        """Check the fields that name token ids against the vocabulary; `logit_bias` as (token
        id, bias) pairs. 400 for an id outside it, or a `logit_bias` key that is not an id."""
        bad = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"stop_token_ids out of range [0, {vocab_size}): {bad[:5]}",
                           code="invalid_value", param="stop_token_ids")
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
                raise APIError(400, f"logit_bias: {key[:20]!r} is not a token id in [0, {vocab_size})",
                               code="invalid_value", param="logit_bias")
            pairs.append((int(key), value))
        return pairs

    @property
    def choices_per_prompt(self) -> int:
        """Generations run per prompt: `n`, or `best_of` of which the n best are returned."""
        return getattr(self, "best_of", None) or self.n

    @property
    def sampled_logprobs(self) -> int | None:
        """What the engine is asked for: the client's logprobs, or 0 to rank best_of's choices."""
        if self.num_logprobs is None and self.choices_per_prompt > self.n:
            return 0
        return self.num_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = Annotated[list[int], Field(min_length=1)]
PromptType = Union[str, Annotated[list[str], Field(min_length=1)], TokenIds,
                   Annotated[list[TokenIds], Field(min_length=1)]]


class CompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, Refused]]    # REFUSED_COMPLETION (set below it)
    prompt: PromptType
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each token's log-probability "
                                 "and the top `logprobs` alternatives at its position")

    echo: bool = Field(False, description="return the prompt before the completion (with `logprobs`, "
                                          "its tokens' log-probabilities too)")
    best_of: int | None = Field(None, ge=1, le=16, description="generate this many per prompt, return the n "
                                "with the highest cumulative log-probability; not with stream")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: PromptType) -> PromptType:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: text or token ids, one entry per prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = Field(None, description="the participant's name, handed to the chat template")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, Refused]]    # REFUSED_CHAT (set below it)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens")
    add_generation_prompt: bool = True
    logprobs: bool = Field(False, description="each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="alternatives per token; "
                                     "needs logprobs")
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = Field(None, description='"required" or a named function: one call, its '
                                           'arguments constrained to the parameters schema; "none": text')
    parallel_tool_calls: bool | None = Field(None, description="a forced call is one call per choice")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


NO_OP_FIELDS = ("user", "metadata", "safety_identifier", "prompt_cache_key")


@dataclass(frozen=True)
class Refused:
    """An OpenAI field this server does not implement: a 400 naming it, unless it carries one
    of its "off" values (then it asks for nothing, and is dropped before validation)."""

    off: tuple          # values that ask for nothing; compared by type and value (0 is not False)
    why: str            # said in the 400


REFUSED_COMMON = {
    "store": Refused((None, False), "this server stores nothing"),
    "service_tier": Refused((None, "auto", "default"), "this server has one service tier"),
}
REFUSED_COMPLETION = {
    **REFUSED_COMMON,
    "suffix": Refused((None, ""), "insertion (a suffix) is not supported"),
}
REFUSED_CHAT = {
    **REFUSED_COMMON,
    "functions": Refused((None, []), "function calling is not implemented"),
    "function_call": Refused((None, "none"), "function calling is not implemented"),
    "modalities": Refused((None, ["text"]), "this server answers text only"),
    "audio": Refused((None,), "this server answers text only"),
    "prediction": Refused((None,), "predicted outputs are not supported"),
    "reasoning_effort": Refused((None,), "the model has no reasoning setting"),
    "verbosity": Refused((None,), "the model has no verbosity setting"),
    "web_search_options": Refused((None,), "this server has no web search"),
}


CompletionRequest.refused, ChatCompletionRequest.refused = REFUSED_COMPLETION, REFUSED_CHAT


def is_off(value, offs: tuple) -> bool:
    """Whether `value` is one of `offs`, by type and value: `0` is not `False`, `1.0` is `1`."""
    def same(a, b) -> bool:
        if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
            return a is b
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return a == b
        return type(a) is type(b) and a == b
    return any(same(value, o) for o in offs)


def parse_body(raw: bytes, model: type[SamplingFields]) -> SamplingFields:
    """A request body as `model`, validated strictly; 400 for malformed JSON, unpaired UTF-16
    surrogates, refused or unknown fields, and whatever the model refuses."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from e
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    if _has_lone_surrogate(body):  # "\ud800" escapes: not text any tokenizer can take
        raise APIError(400, "malformed JSON body: a string holds an unpaired UTF-16 surrogate",
                       code="invalid_json")
    for name, refused in model.refused.items():
        if name not in body:
            continue
        if not is_off(body[name], refused.off):
            raise APIError(400, f"{name}={_short(body[name])} is not supported by this server: "
                           f"{refused.why}", code="unsupported_parameter", param=name)
        del body[name]
    try:
        req = model.model_validate(body, strict=True)
    except ValidationError as e:
        raise validation_error(e) from e
    if getattr(req, "top_logprobs", None) is not None and not getattr(req, "logprobs", False):
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    best = getattr(req, "best_of", None)
    if best is not None and best < req.n:
        raise APIError(400, f"best_of ({best}) must be at least n ({req.n})", code="invalid_value", param="best_of")
    if best is not None and best > req.n and req.stream:
        raise APIError(400, "best_of cannot be streamed", code="invalid_value", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       code="invalid_value", param="stream_options")
    return req


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(body) -> bool:
    """Whether any string (key or value) in parsed JSON holds a surrogate code point; json.loads
    joins escaped pairs, so any left is unpaired."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# -- between request handling and response shaping ------------------------------------
@dataclass
class Delta:
    """New text of one choice; the last one of a choice carries `finish_reason`."""

    index: int
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    token_ids: list[int] = field(default_factory=list)   # the tokens behind `text`
    cached_tokens: int = 0             # prompt tokens the engine found in its prefix cache
    logprobs: list = field(default_factory=list)         # a models.sampling.TokenLogprob per token
    prompt_logprobs: list | None = None                  # an echo's: None, then one per prompt token


@dataclass
class Prepared:
    """A validated request, ready for the engine: one entry per choice."""

    prompts: list[list[int]]           # token ids per prompt
    sampling: list[SamplingParams]     # per choice (prompt-major, n per prompt)
    prompt_of: list[int]               # choice index -> prompt index
    speculation: SpeculationOptions
    stops: list[str]
    client: str = "anonymous"          # who asked: `key-<i>` or anonymous (serving.access)
    prefix_cache: bool = True          # may use the engine's prefix cache (the `prefix_cache` field)


class EngineError(Exception):
    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def engine_api_error(e: EngineError, retry_after_s: int) -> APIError:
    if e.retryable:
        return APIError(503, str(e), type="server_error", code="engine_overloaded",
                        headers={"Retry-After": str(retry_after_s)})
    return APIError(500, str(e), type="server_error", code="engine_error")
