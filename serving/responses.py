"""Shaping OpenAI responses over `OpenAIServer` (serving/openai_api.py): server-sent events and the
token-id fields of vLLM's `return_token_ids` extension."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, AsyncIterator

from serving.openai_models import APIError, Delta, EngineError, Prepared, SamplingFields, engine_api_error

if TYPE_CHECKING:
    from serving.openai_api import OpenAIServer


async def sse(server: OpenAIServer, prep: Prepared, head: dict, choice, req: SamplingFields,
              first: dict | None) -> AsyncIterator[str]:
    """Server-sent events: `first` (the opening event's fields beside `head`), one event per
    delta, then usage if asked, then [DONE].

    Admission happens before the first byte, so a full queue is still a 429."""
    gen = server.run(prep)  # a dropped stream cancels the response task: no polling needed
    finals: dict[int, Delta] = {}
    try:
        first_delta = await gen.__anext__()
    except StopAsyncIteration:
        first_delta = None
    except EngineError as e:
        raise engine_api_error(e, server.settings.retry_after_s) from e

    async def events() -> AsyncIterator[str]:
        try:
            if first:
                yield _event({**head, **first})
            delta = first_delta
            while delta is not None:
                if delta.text or delta.finish_reason or delta.logprobs or \
                        (req.return_token_ids and delta.token_ids):
                    yield _event({**head, "choices": [choice(delta)]})
                if delta.finish_reason:
                    finals[delta.index] = delta
                delta = await gen.__anext__()
        except StopAsyncIteration:
            pass
        except (APIError, EngineError) as e:
            err = e if isinstance(e, APIError) else engine_api_error(
                e, server.settings.retry_after_s)
            yield _event(err.body())
        finally:
            await gen.aclose()
        if req.include_usage:
            yield _event({**head, "choices": [], "usage": usage(prep, list(finals.values()))})
        yield "data: [DONE]\n\n"
    return events()


class Logprobs:
    """Each choice's log-probabilities (models.sampling.TokenLogprob) in OpenAI's two shapes. A
    token's text is its own decoding (a piece of a multi-byte character decodes to U+FFFD, as in
    vLLM); completions' `text_offset` counts those texts' characters per choice, across chunks."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.offset = tokenizer, {}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, d: Delta, k: int | None, prompt: tuple[list[int], list] | None = None) -> dict | None:
        """`prompt`: an echo's (prompt ids, their logprobs: None first), put before the output's."""
        if k is None:
            return None
        ids, lps = [lp.token_id for lp in d.logprobs], list(d.logprobs)
        if prompt is not None:
            ids, lps = list(prompt[0]) + ids, list(prompt[1]) + lps
        tokens = [self._text(t) for t in ids]
        offsets, at = [], self.offset.get(d.index, 0)
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self.offset[d.index] = at
        tops = [None if lp is None else {**{self._text(t): v for t, v in lp.top}, tok: lp.logprob}
                for tok, lp in zip(tokens, lps)]
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}

    def chat(self, d: Delta, k: int | None) -> dict | None:
        if k is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            text = self._text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in d.logprobs], "refusal": None}


def best_of(deltas: list[Delta], prep: Prepared, n: int) -> list[Delta]:
    """`best_of`: of each prompt's choices, the n with the highest cumulative log-probability
    (ties: the earlier), prompt by prompt; all of them when there are only n. The caller
    renumbers the choices it makes of them."""
    by_prompt: dict[int, list[Delta]] = {}
    for d in deltas:
        by_prompt.setdefault(prep.prompt_of[d.index], []).append(d)
    out = []
    for p in sorted(by_prompt):
        mine = by_prompt[p]
        if len(mine) > n:
            mine = sorted(mine, key=lambda d: -sum(lp.logprob for lp in d.logprobs))[:n]
        out += sorted(mine, key=lambda d: d.index)
    return out


class Echo:
    """`echo`: each completion choice's first chunk (its whole text, unstreamed) starts with its
    prompt, as sent (token-id prompts decoded), and its logprobs with the prompt's."""

    def __init__(self, prep: Prepared, prompts: list, tokenizer) -> None:
        self.prep, self.prompts, self.tokenizer, self.sent = prep, prompts, tokenizer, set()

    def first(self, d: Delta) -> tuple[str, tuple[list[int], list] | None]:
        """(text to put before the choice's, (prompt ids, their logprobs) or None)."""
        if d.index in self.sent:
            return "", None
        self.sent.add(d.index)
        p = self.prep.prompt_of[d.index]
        given = self.prompts[p]
        text = given if isinstance(given, str) else self.tokenizer.decode(given)
        ids = self.prep.prompts[p]
        return text, None if d.prompt_logprobs is None else (ids, d.prompt_logprobs)


class TokenIds:
    """`return_token_ids`: each choice (or chunk) gets the `token_ids` behind its text, and a
    completion choice its prompt's `prompt_token_ids` once (its first chunk when streamed);
    chat puts the one prompt's ids beside `choices` (`top`), as vLLM does."""

    def __init__(self, prep: Prepared, on: bool) -> None:
        self.prep, self.on, self.sent = prep, on, set()

    def choice(self, choice: dict, d: Delta, with_prompt: bool = True) -> dict:
        if self.on:
            choice["token_ids"] = d.token_ids
            if with_prompt and d.index not in self.sent:
                self.sent.add(d.index)
                choice["prompt_token_ids"] = self.prep.prompts[self.prep.prompt_of[d.index]]
        return choice

    def top(self) -> dict:
        return {"prompt_token_ids": self.prep.prompts[0]} if self.on else {}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def usage(prep: Prepared, deltas: list[Delta]) -> dict:
    """The `usage` object of a request's answer."""
    prompt = sum(len(p) for p in prep.prompts)
    completion = sum(d.completion_tokens for d in deltas)
    cached: dict[int, int] = {}          # per prompt: its choices share it, counted once
    for d in deltas:
        p = prep.prompt_of[d.index]
        cached[p] = max(cached.get(p, 0), d.cached_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
            "drafted_tokens": sum(d.drafted for d in deltas),
            "accepted_tokens": sum(d.accepted for d in deltas)}
