"""Token ids → text, incrementally, and stop strings over the streamed text.

`IncrementalDetokenizer` turns the tokens a request commits, chunk by chunk,
into text deltas whose concatenation is exactly
`tokenizer.decode(all_ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)` — the text the non-streamed answer holds.
It decodes a sliding window (the "prefix offset / read offset" scheme of Hugging
Face text-generation-inference and vLLM): the tokens since the last emitted
boundary are decoded together with a few tokens before it, and only the text
beyond the earlier decode is new. A byte-level BPE token may carry half of a
multi-byte UTF-8 character; the decode then ends in U+FFFD, and that text is
held back until the character is complete (or the request ends: `flush`).

`StopStrings` holds back the longest tail of the text that could still grow into
a stop string, so a stop string is never streamed in part; on a match the text is
cut before the stop string (OpenAI semantics: the stop string is not returned).
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids (the request's output only)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0   # window start: tokens before it are fully emitted
        self.read_offset = 0     # tokens before it are emitted; [prefix, read) is context
        self.text = ""           # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Append newly committed tokens; return the text they complete (may be "")."""
        self.token_ids.extend(token_ids)
        if len(self.token_ids) == self.read_offset:
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete UTF-8 character at the end: wait
        if not new_text.startswith(prefix_text):
            # The window's context decoded differently once extended (a tokenizer whose
            # decode is not prefix-stable); fall back to a full decode of the output.
            full = self._decode(self.token_ids)
            delta = full[len(self.text):] if full.startswith(self.text) else ""
        else:
            delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: whatever is still held back (an incomplete char)."""
        if self.read_offset == len(self.token_ids):
            return ""
        full = self._decode(self.token_ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class StopStrings:
    """Finds the first stop string in streamed text; holds back a possible partial match."""

    def __init__(self, stops: list[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""        # text received but not yet released
        self.stopped = False

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> str:
        """Add text; return what can be released now. After a match, `stopped` is True."""
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        self.pending += delta
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        hold = self._held_tail(self.pending)
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        """At the end of the request without a match: release the held-back tail."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
