"""The request/response types between the serving layer and the engines.

The Serve ingress only sees `Engine`; the Ray pipeline, the in-process sync
engine and test fakes all implement it (docs/internals.md, "cluster").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from models.sampling import SamplingParams

SPECULATION_MODES = ("off", "chain", "tree", "auto")
PROPOSERS = ("model", "ngram")


@dataclass
class SpeculationOptions:
    """Per-request speculation settings; None means the server default."""

    mode: str = "auto"
    spec_len: int | None = None
    tree_width: int | None = None
    proposer: str = "model"

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"speculation mode must be one of {SPECULATION_MODES}, got {self.mode!r}")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}")
        if self.spec_len is not None and not 1 <= self.spec_len <= 16:
            raise ValueError(f"spec_len must be in [1, 16], got {self.spec_len}")
        if self.tree_width is not None and not 1 <= self.tree_width <= 8:
            raise ValueError(f"tree_width must be in [1, 8], got {self.tree_width}")


@dataclass
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)


@dataclass
class GenerationChunk:
    """Tokens committed by one verification step of one request."""

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_drafted: int = 0              # cumulative for the request
    num_accepted: int = 0             # cumulative for the request
    error: str | None = None


class Engine(Protocol):
    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> dict: ...

    async def stats(self) -> dict: ...
