"""The knobs of speculation and their limits, each defined once.

`SpeculationSettings` is the `speculation:` block of the cluster config (cluster/config/
uses it as it is) and the server's defaults for requests that do not say; `EngineSettings`
adds what one engine (a scheduler and its drafters) runs with: memory, threads, device,
timeouts. The limits below bound the per-request options (`speculation.requests`), the
HTTP and gRPC request models, the planner and the CLI alike.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPEC_LEN = 16        # deepest tree (chain length K) any request or default may ask for
MAX_TREE_WIDTH = 8       # most children of one tree node
MAX_BRIDGE_DEPTH = 4     # longest bridge chain (`bridge_depth`)
MODES = ("off", "chain", "tree", "auto")
PROPOSERS = ("model", "ngram")

Mode = Literal["off", "chain", "tree", "auto"]
ProposerName = Literal["model", "ngram"]


class SpeculationSettings(BaseModel):
    """Server defaults of speculation; a request may override mode, depth, width and proposer."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    mode: Mode = Field("auto", description="Server default; a request may override it. auto = adaptive per sequence.")
    spec_len: int = Field(4, ge=1, le=MAX_SPEC_LEN, description="Chain length K / maximum tree depth.")
    tree_width: int = Field(1, ge=1, le=MAX_TREE_WIDTH, description="Children per tree node (1 = chain).")
    proposer: ProposerName = Field("model", description="Draft model or prompt-lookup n-grams.")
    ring_slots: int = Field(2, ge=1, le=64, description=(
        "Trees in flight per sequence (ring buffer depth). 1 = lockstep: the drafter drafts only "
        "from the committed prefix (nothing assumed, no rollbacks) and, on a CPU node it shares "
        "with the verifier, lends its cores to each verification; it pays where drafter and "
        "verifier split a few cores."))
    lockstep_alone: bool = Field(True, description=(
        "Run in lockstep (as ring_slots 1) while a CPU drafter on its verifier's node, with at "
        "least the verifier's CPUs, serves one sequence: a lone stream then gets every "
        "verification on both actors' cores and no bridges; with more streams the pipeline "
        "overlaps drafting and verification again."))
    lockstep_measured: bool = Field(True, description=(
        "Where the rules here would overlap a lone stream with its drafter (another node or "
        "device, or lockstep_alone off), run it both ways in windows of steps and keep the one "
        "that commits more tokens per second, told to the drafter with each signal; off: the "
        "rules alone. Each way keeps every output exact."))
    lockstep_shared_gpu: bool = Field(True, description=(
        "Run in lockstep (as ring_slots 1) while the drafter runs on the verifier's GPU: two "
        "processes' forwards on one GPU are time-sliced, so overlapping them gains nothing and "
        "slows each verification (3-7x on an H200, measured 2026-11-30: docs/bench-history.md)."))
    lockstep_in_verifier: bool = Field(True, description=(
        "A stream that would run in lockstep with a drafter on the verifier's own cores or GPU "
        "(lockstep_alone, lockstep_shared_gpu) is drafted inside the verifier's process instead, "
        "by its copy of the draft: the two sides take turns either way, and a call between "
        "processes then costs a round trip a step for nothing. Other streams keep the drafter."))
    max_batch_size: int = Field(32, ge=1, le=4096, description="Sequences per verifier forward.")
    bridge_depth: int = Field(0, ge=0, le=MAX_BRIDGE_DEPTH, description=(
        "After a tree whose outcome contradicts what the drafter assumed, the verifier's next "
        "step (the bridge) verifies the draft's own greedy chain of this many tokens, drafted by "
        "a copy of the draft the verifier holds, instead of decoding one token alone (greedy "
        "requests with a draft model; 0 = decode alone). Used where no restart tree follows "
        "(`restart_depth`)."))
    restart_depth: int = Field(-1, ge=-1, le=MAX_SPEC_LEN, description=(
        "After a tree whose outcome contradicts what the drafter assumed, the drafter drafts a "
        "restart tree this deep (within the sequence's budget) after the committed prefix and "
        "the verifier waits for it, instead of decoding one token alone (a bridge) while the "
        "drafter drafts a full tree after its guess of that token. 0 = bridge; -1 = a lone "
        "stream overlapped with its drafter restarts with a chain of up to 3 tokens, streams "
        "sharing a drafter bridge (`speculation.policy.restart_tree_depth`). The verifier decides and "
        "tells the drafter with the step's signal (`Signal.restart`)."))
    lookup: bool = Field(
        True, description="In auto mode, where the draft model does not pay, the verifier speculates "
                          "with prompt lookup (n-grams of the prompt and output) when that pays.")

    @model_validator(mode="after")
    def _consistent(self) -> SpeculationSettings:
        if self.mode == "chain" and self.tree_width != 1:
            raise ValueError(f"mode 'chain' means tree_width 1, got {self.tree_width}; use mode 'tree'")
        if self.bridge_depth > 0 and self.restart_depth > 0:
            raise ValueError(f"bridge_depth {self.bridge_depth} applies to bridges, which restart_depth "
                             f"{self.restart_depth} replaces; set one of them to 0")
        return self


class KVCacheSettings(BaseModel):
    """The engines' KV caches, target and draft model alike: the config's `kv_cache:` block."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    prefix_caching: bool = Field(False, description=(
        "Automatic prefix caching: a request starts on the cached KV blocks of the longest prefix "
        "of its prompt that an earlier request left (a multi-turn history, a shared system prompt), "
        "in the target's cache and the draft model's; a request may opt out (`prefix_cache: false`)."))
    prefill_chunk: int = Field(0, ge=0, description=(
        "Chunked prefill: a prompt longer than this many tokens is prefilled this many at a time, "
        "one chunk per step, inside the running streams' verification forward while they decode, "
        "so a long prompt does not stall them; 0 = whole prompts in one forward."))
    prefill_step_share: float = Field(0.5, ge=0, description=(
        "With chunked prefill, while streams decode, a chunk is sized (at most `prefill_chunk` "
        "tokens) so that it adds at most this share to their step's measured time: "
        "their inter-token latency grows by at most 1 + this (vLLM's per-step token budget, in "
        "seconds; verifier/chunking.py); 0 = always `prefill_chunk` tokens."))


class EngineSettings(SpeculationSettings, KVCacheSettings):
    """What one engine (a scheduler, its target and its drafters) runs with, beside the defaults.

    Built from the cluster config (`cluster.pipeline.settings_from_config`) and handed to every
    actor of a pipeline as `model_dump()`; the in-process engine builds one directly."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)
    num_blocks: int = Field(1024, ge=1, description="Target KV blocks (each drafter gets as many).")
    stream_interval: int = Field(1, ge=1, description=(
        "Tokens a streamed chunk of a request carries at least: its first chunk and its last go "
        "at once, the others wait until this many tokens are committed. 1 = every step's tokens "
        "as the step commits them. Fewer chunks cost the engine less (each chunk through a Ray "
        "stream cost ~1.2 ms of CPU on this project's machine, over the output socket ~0.1 ms: "
        "`output_socket`); vLLM's `--stream-interval`."))
    block_size: int = Field(16, ge=1, description="Tokens per KV block.")
    num_cpus: float = Field(1.0, ge=0, description="Torch threads of each actor (its reserved CPUs).")
    device: str = Field("cpu", description="Device of the models: cpu or cuda.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weight dtype.")
    drafter_timeout_s: float = Field(2.0, gt=0, description="A drafter silent this long is treated as dead.")
    max_tree_wait_s: float = Field(0.5, ge=0, description="Longest a sequence is held back for a late tree.")
    poll_s: float = Field(0.05, gt=0, description=(
        "Verifier idle poll; a drafter with nothing to draft long-polls max(this, drafter_timeout_s / 4)."))
    plain_threads: int = Field(-1, ge=-1, description=(
        "Torch threads of a CPU verifier's step while its drafters have nothing to draft: -1 = its "
        "own plus the CPUs of the live drafters on its node (theirs sit idle then); 0 = its own "
        "only; n > 0 = n (`speculation.policy.plain_step_threads`)."))
    exchange: Literal["socket", "actor"] = Field("socket", description=(
        "How a pipeline's drafters exchange with their verifier: over a socket each, answered on the "
        "verifier's engine loop (cluster/exchange_socket.py), or by an actor call each; membership, "
        "restarts and scaling use actor calls either way."))
    output_socket: bool = Field(True, description=(
        "A pipeline's requests and their chunks go between the process that asked and its "
        "verifier over a socket (Unix on one node, else TCP; ~0.1 ms of CPU a chunk), answered on "
        "the verifier's engine loop, instead of an actor call and a Ray stream (~1.2 ms a chunk on "
        "this project's CPU: bench/output_cost.py); a consumer that cannot connect keeps Ray's "
        "calls and streams (cluster/outputs.py)."))
    proposers: tuple[str, ...] = Field(PROPOSERS, description=(
        "The proposers this engine's drafters hold ('model' needs a draft model); a request "
        "naming another is refused."))


def check_speculation(spec_len: int, tree_width: int) -> None:
    """A depth and a width within the limits, as a CLI flag or a setting gives them."""
    if not isinstance(spec_len, int) or not 1 <= spec_len <= MAX_SPEC_LEN:
        raise ValueError(f"spec-len (K) must be an integer in [1, {MAX_SPEC_LEN}], got {spec_len!r}")
    if not isinstance(tree_width, int) or not 1 <= tree_width <= MAX_TREE_WIDTH:
        raise ValueError(f"tree-width must be an integer in [1, {MAX_TREE_WIDTH}], got {tree_width!r}")
