"""How many prompt tokens a step's prefill may feed: the token budget of chunked prefill (issue 25).

vLLM's chunked prefill gives each step a token budget: the running sequences' decode tokens
first, a prompt's chunk the rest. What the decoding streams wait for is a step's time, not
its tokens, so the budget here is in seconds: while streams decode, the prefill between two
of their steps may take at most `prefill_step_share` of their step (`EngineSettings`; a
step with a chunk then costs at most 1 + share times one without), and its tokens follow
from the prefill's measured seconds per token. Chunk sizes are multiples of `MIN_CHUNK` up
to `prefill_chunk`, and one chunk runs
per step: the oldest prompt under way first, a new prompt only with budget left. While no
stream decodes nobody waits: chunks of `prefill_chunk`.

A chunk runs in its own forward before the step (the ragged forward pads every sequence to
the longest, so a chunk inside the verification's forward would cost its rows for every
sequence): one more pass over the weights, which no chunk size avoids. Where a forward's
fixed cost exceeds the share of a step (the embedded pair on one CPU thread: ~50 ms of a
~80 ms step of 8 streams), the smallest chunk bounds the interference.

Seconds per token are an exponential average over chunks: a chunk of c tokens measures
f / c + b for a forward's fixed cost f and per-token cost b, so the size it leads to,
budget / (f / c + b), grows while a chunk costs less than the budget and shrinks while it
costs more (its fixed point is (budget - f) / b); the cost of attending to a growing prefix
is followed as it grows.
"""
from __future__ import annotations

MIN_CHUNK = 4            # the fewest tokens a chunk feeds while streams decode (progress)
DECAY = 0.7              # weight of the past in the seconds-per-token and step averages


class PrefillBudget:
    def __init__(self, chunk: int, share: float) -> None:
        """`chunk`: `prefill_chunk`, the most tokens a chunk feeds (0: whole prompts, no
        budget); `share`: `prefill_step_share` (0: always `chunk` tokens)."""
        self.chunk, self.share = chunk, share
        self.token_s: float | None = None     # prefill seconds per token, averaged
        self.step_s: float | None = None      # a step's seconds without a prefill, averaged
        self.last_tokens = 0                  # the budget of the latest step that had prefill work
        self.left: int | None = None          # this step's tokens still to give (None: no limit)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill forward that fed `tokens` (past the cached ones) in `seconds`."""
        if tokens > 0:
            per = seconds / tokens
            self.token_s = per if self.token_s is None else DECAY * self.token_s + (1 - DECAY) * per
            self.last_tokens = tokens

    def observe_step(self, seconds: float) -> None:
        """A verification step of the decoding streams (its time after the prefill)."""
        self.step_s = seconds if self.step_s is None else DECAY * self.step_s + (1 - DECAY) * seconds

    def tokens(self, decoding: bool) -> int | None:
        """The prompt tokens this step's prefill may feed: None = no limit (chunking off)."""
        if self.chunk <= 0:
            return None
        if not decoding or self.share <= 0:
            return self.chunk
        if self.step_s is None or self.token_s is None:
            return min(MIN_CHUNK, self.chunk)          # nothing measured yet: the cautious end
        fit = int(self.share * self.step_s / self.token_s) // MIN_CHUNK * MIN_CHUNK
        return max(min(MIN_CHUNK, self.chunk), min(fit, self.chunk))

    def start(self, decoding: bool) -> None:
        """A new step's budget: `tokens(decoding)`, given out by `grant`."""
        self.left = self.tokens(decoding)

    @property
    def spent(self) -> bool:
        return self.left is not None and self.left <= 0

    def grant(self, need: int) -> int | None:
        """Tokens a prefill that needs `need` more may feed this step (None: all of them)."""
        if self.left is None:
            return None
        given = min(need, self.left)
        self.left -= given
        return given

    def seconds(self, tokens: int) -> float:
        """What a chunk of `tokens` is expected to cost (0 before any was measured)."""
        return 0.0 if self.token_s is None else self.token_s * tokens

    def report(self) -> dict:
        return {"prefill_token_s": self.token_s, "prefill_chunk_tokens": self.last_tokens}
