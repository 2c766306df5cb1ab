"""How many prompt tokens a step's prefill may feed: the token budget of chunked prefill (issue 25).

vLLM's chunked prefill gives each step a token budget: the running sequences' decode tokens
first, a prompt's chunk the rest. What the decoding streams wait for is a step's time, not
its tokens, so the budget here is in seconds: while streams decode, the chunk a step feeds
may take at most `prefill_step_share` of their step (`EngineSettings`; a step with a chunk
then costs at most 1 + share times one without), and its tokens follow from what a chunk's
token has been measured to add to a step. Chunk sizes are multiples of `MIN_CHUNK` up to
`prefill_chunk`, and one chunk runs per step: the oldest prompt under way first, a new
prompt only with budget left. While no stream decodes nobody waits: chunks of
`prefill_chunk`, in forwards of their own.

While streams decode, the chunk rides inside their verification forward
(`verifier.verifier.Verifier.verify`, `models.tree.ragged_tree_forward`'s packed groups):
it adds its rows to the token-wise work and its own attention, not a pass over the weights
of its own, so its cost is the step's time less the time of a step without a chunk. Both
are exponential averages: `step_s` over steps without a chunk, `token_s` over chunks (the
difference per token, which follows a dearer chunk fast and a cheaper one slowly: step
times are noisy, and an overshoot is what the decoding streams feel). The size they lead to,
share x step_s / token_s, at most twice the latest chunk, follows the cost of attending to a
growing prefix as it grows. Before any step without a chunk was measured, a chunk step is
split by rows.
"""
from __future__ import annotations

MIN_CHUNK = 4            # the fewest tokens a chunk feeds while streams decode (progress)
DECAY = 0.7              # weight of the past in the seconds-per-token and step averages
DECAY_UP = 0.5           # and in seconds-per-token when a chunk came out dearer
MIN_TOKEN_SHARE = 0.25   # a chunk's token costs at least this share of a row of its step (noise floor)


class PrefillBudget:
    def __init__(self, chunk: int, share: float) -> None:
        """`chunk`: `prefill_chunk`, the most tokens a chunk feeds (0: whole prompts, no
        budget); `share`: `prefill_step_share` (0: always `chunk` tokens)."""
        self.chunk, self.share = chunk, share
        self.token_s: float | None = None     # seconds a chunk's token adds to a step, averaged
        self.step_s: float | None = None      # a step's seconds without a chunk, averaged
        self.last_tokens = 0                  # the tokens of the latest chunk fed beside a step
        self.left: int | None = None          # this step's tokens still to give (None: no limit)

    def observe_step(self, seconds: float, rows: int = 1, chunk_tokens: int = 0) -> None:
        """A verification step of the decoding streams (its time after admission), of `rows`
        tree rows; `chunk_tokens`: the prompt tokens its forward also fed."""
        if chunk_tokens <= 0:
            self.step_s = seconds if self.step_s is None else DECAY * self.step_s + (1 - DECAY) * seconds
            return
        self.last_tokens = chunk_tokens
        if self.step_s is None:          # no step without a chunk yet: split this one by rows
            self.step_s = seconds * rows / (rows + chunk_tokens)
        per = max((seconds - self.step_s) / chunk_tokens, MIN_TOKEN_SHARE * seconds / (rows + chunk_tokens))
        # dearer fast, cheaper slowly: one costly chunk shrinks the next, noise grows it little
        decay = DECAY_UP if self.token_s is not None and per > self.token_s else DECAY
        self.token_s = per if self.token_s is None else decay * self.token_s + (1 - decay) * per

    def tokens(self, decoding: bool) -> int | None:
        """The prompt tokens this step's prefill may feed: None = no limit (chunking off)."""
        if self.chunk <= 0:
            return None
        if not decoding or self.share <= 0:
            return self.chunk
        if self.step_s is None or self.token_s is None:
            return min(MIN_CHUNK, self.chunk)          # nothing measured yet: the cautious end
        fit = int(self.share * self.step_s / self.token_s) // MIN_CHUNK * MIN_CHUNK
        if self.last_tokens:             # at most twice the latest chunk: it grows as it is measured
            fit = min(fit, max(2 * self.last_tokens // MIN_CHUNK * MIN_CHUNK, MIN_CHUNK))
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
