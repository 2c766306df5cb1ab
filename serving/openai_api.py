"""The OpenAI-compatible HTTP API over any `Engine` (docs/internals.md, "cluster").

`OpenAIServer` is a plain class (no Ray): it validates requests, tokenizes,
admits them against a bounded queue, runs each choice through the engine with an
incremental detokenizer and stop strings, and shapes OpenAI responses, whole or
as server-sent events ending in `data: [DONE]`. The route table over it is
`serving.openai_routes.build_fastapi_app(server)`. The Ray Serve ingress (`cluster.serve_app`) and the gRPC
service (`serving.grpc_service`) both drive the same `OpenAIServer`, and the
tests drive it in-process with FastAPI's TestClient and a fake engine.

Every generation that ends before the engine finishes it (stop string, client
gone, timeout, error) is aborted in the engine, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Sequence

from serving.access import ANONYMOUS, ApiKeys, KeyLimiter, load_api_keys
from serving.choice_streams import DisconnectWatch, Disconnected, merge
from serving.detokenizer import IncrementalDetokenizer, StopStrings
from serving.openai_models import (APIError, ChatCompletionRequest, CompletionRequest, Delta, EngineError,
                                   Prepared, SamplingFields, engine_api_error, parse_body)
from serving.prom import PrometheusExporter, ServingStats
from serving.responses import Echo, Logprobs, TokenIds, best_of, sse, usage
from serving.structured import forced_tool, grammar_of, preload_server_vocabulary, tool_call_message
from speculation.requests import Engine, GenerationRequest, InvalidRequest, SpeculationOptions
from models.grammar import GrammarError
from models.sampling import SamplingParams

# Used when the tokenizer has no chat template of its own (ChatML, as documented
# in docs/serving.md); its end-of-turn marker is then also a stop string.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_TEMPLATE_STOP = "<|im_end|>"
@dataclass
class ServerSettings:
    model_name: str = "specflash"
    max_context: int = 2048            # prompt + completion tokens
    max_queue: int = 64                # generations admitted at once (running + waiting)
    request_timeout_s: float = 600.0
    retry_after_s: int = 1
    default_max_tokens: int = 16       # /v1/completions without max_tokens (OpenAI's default)
    disconnect_poll_s: float = 1.0     # non-streamed requests: how often to check the client
    # When set (one key or several), /v1/* and gRPC need `Authorization: Bearer <key>`; never in repr.
    api_key: str | Sequence[str] | None = field(default=None, repr=False)
    auth_health: bool = False          # /health needs the key too
    auth_metrics: bool = False         # /metrics needs the key too
    max_concurrent_per_key: int | None = None   # generations one key may have admitted at once
    max_request_bytes: int = 4 << 20   # larger bodies get 413
    drain_timeout_s: float = 30.0      # on shutdown, how long in-flight requests may still run

    @classmethod
    def from_config(cls, serving, model_name: str, max_context: int) -> ServerSettings:
        """From a `cluster.config.ServingConfig`; reads the API key(s) from their env var or file."""
        return cls(model_name=model_name, max_context=max_context, max_queue=serving.max_queue,
                   request_timeout_s=serving.request_timeout_s,
                   api_key=load_api_keys(serving.api_key_env, serving.api_key_file) or None,
                   auth_health=serving.auth_health, auth_metrics=serving.auth_metrics,
                   max_concurrent_per_key=serving.max_concurrent_per_key,
                   max_request_bytes=serving.max_request_bytes,
                   drain_timeout_s=serving.drain_timeout_s)


class OpenAIServer:
    """Request handling for /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

    def __init__(self, engine: Engine, tokenizer, settings: ServerSettings | None = None,
                 stats: ServingStats | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or ServerSettings()
        self.stats = stats or ServingStats()
        self.exporter = PrometheusExporter(self.stats)
        self.chat_template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        self.outstanding = 0           # admitted generations not yet finished
        self.keys = ApiKeys.of(self.settings.api_key)
        self.limiter = KeyLimiter(self.settings.max_concurrent_per_key, self.settings.retry_after_s)
        self.draining = False          # set by begin_shutdown: nothing new is admitted
        self._cuts: set[asyncio.Future] = set()  # one per running choice; done = fail it now
        self.vocab_size = len(tokenizer)
        self.created = int(time.time())
        preload_server_vocabulary(tokenizer)     # grammars' vocabulary: not the first structured request's wait

    def check_api_key(self, authorization: str | None) -> str:
        """The client (`key-<i>`, or "anonymous" when no key is configured); 401 for a bad key."""
        return self.keys.identify(authorization)

    # -- request preparation -----------------------------------------------------------
    def _check_model(self, req: SamplingFields) -> None:
        if req.model is not None and req.model != self.settings.model_name:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}", code="model_not_found", param="model")

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}",
                           code="invalid_value", param="prompt")
        return list(prompt)

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)
        except Exception as e:  # a template that rejects the conversation (roles, order)
            raise APIError(400, f"chat template: {e}", code="invalid_value", param="messages") from e
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prepare(self, req: SamplingFields, prompts: list[list[int]], default_max: int | None,
                max_tokens: int | None) -> Prepared:
        ctx = self.settings.max_context
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt is empty", code="invalid_value", param="prompt")
            if len(ids) >= ctx:
                raise APIError(400, f"This model's maximum context length is {ctx} tokens; the "
                               f"prompt has {len(ids)}", code="context_length_exceeded",
                               param="prompt")
        n = req.choices_per_prompt
        if len(prompts) * n > self.settings.max_queue:
            raise APIError(400, f"The request asks for {len(prompts) * n} generations (prompts "
                           f"x n); this server admits at most {self.settings.max_queue} at once",
                           code="invalid_value", param="n")
        bias = req.token_fields(self.vocab_size)
        try:
            grammar = grammar_of(req, self.tokenizer)
        except GrammarError as e:
            raise APIError(400, str(e), code="invalid_value", param=e.field) from None
        sampling, prompt_of = [], []
        for p, ids in enumerate(prompts):
            room = ctx - len(ids)
            budget = max_tokens if max_tokens is not None else (default_max or room)
            if max_tokens is None:
                budget = min(budget, room)
            if budget > room:
                raise APIError(400, f"This model's maximum context length is {ctx} tokens; the "
                               f"prompt ({len(ids)}) plus max_tokens ({budget}) exceeds it",
                               code="context_length_exceeded", param="max_tokens")
            if req.min_tokens > budget:
                raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({budget})",
                               code="invalid_value", param="min_tokens")
            for _ in range(n):  # choice i gets seed + i: every choice its own stream
                seed = None if req.seed is None else req.seed + len(sampling)
                try:
                    sampling.append(SamplingParams(
                        temperature=req.temperature, top_k=max(req.top_k, 0), top_p=req.top_p,
                        seed=seed, max_tokens=budget, ignore_eos=req.ignore_eos,
                        stop_token_ids=list(req.stop_token_ids or []),
                        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty, logit_bias=bias, min_p=req.min_p,
                        min_tokens=req.min_tokens, logprobs=req.sampled_logprobs,
                        prompt_logprobs=req.num_logprobs if getattr(req, "echo", False) else None,
                        grammar=replace(grammar) if grammar else None))   # a cursor per choice
                except ValueError as e:
                    raise APIError(400, str(e), code="invalid_value") from e
                prompt_of.append(p)
        spec = req.speculation.to_options() if req.speculation else SpeculationOptions()
        return Prepared(prompts, sampling, prompt_of, spec, list(req.stop or []), prefix_cache=req.prefix_cache)

    # -- admission and generation --------------------------------------------------------
    def check_admitting(self) -> None:
        """503 with Retry-After once shutdown began: another replica (or the restarted
        server) takes the retry."""
        if self.draining:
            self.stats.observe_rejected("shutting_down")
            raise APIError(503, "The server is shutting down and admits no new requests; retry",
                           type="server_error", code="server_shutting_down",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def admit(self, n: int, client: str = ANONYMOUS) -> None:
        self.check_admitting()
        if self.outstanding + n > self.settings.max_queue:
            self.stats.observe_rejected("queue_full")
            raise APIError(429, f"The server is busy ({self.outstanding} generations queued, the "
                           f"limit is {self.settings.max_queue}); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        try:
            self.limiter.acquire(client, n)
        except APIError:
            self.stats.observe_rejected("key_concurrency_limit")
            raise
        self.outstanding += n

    def release(self, n: int, client: str = ANONYMOUS) -> None:
        self.outstanding -= n
        self.limiter.release(client, n)

    # -- shutdown ------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Stop admitting: new requests get 503, /health says "draining"."""
        self.draining = True

    async def drain(self, timeout_s: float | None = None, poll_s: float = 0.05) -> dict:
        """Stop admitting, give in-flight requests `timeout_s` (default `drain_timeout_s`) to
        finish, then fail the rest with a clear error (a stream gets an error event, then
        [DONE]) and wait for those errors to be sent. Returns what happened, for the log."""
        self.begin_shutdown()
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        running = self.outstanding
        deadline = time.monotonic() + timeout_s
        while self.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        cut = list(self._cuts)
        for fut in cut:  # each belongs to the event loop its request runs on
            fut.get_loop().call_soon_threadsafe(_finish, fut)
        grace = time.monotonic() + max(5.0, 10 * poll_s)
        while self.outstanding > 0 and time.monotonic() < grace:
            await asyncio.sleep(poll_s)
        return {"in_flight": running, "failed": len(cut), "left": self.outstanding}

    async def generate_choice(self, index: int, request_id: str, prompt_ids: list[int],
                              sampling: SamplingParams, spec: SpeculationOptions,
                              stops: list[str], deadline: float, prefix_cache: bool = True) -> AsyncIterator[Delta]:
        """Runs one choice; aborts it in the engine unless the engine finished it."""
        detok, stopper, run = IncrementalDetokenizer(self.tokenizer), StopStrings(stops), _ChoiceRun()
        start = last = time.monotonic()
        cut = asyncio.get_running_loop().create_future()
        self._cuts.add(cut)
        self.stats.observe_queued(+1)
        try:
            try:
                stream = self.engine.generate(GenerationRequest(request_id, prompt_ids, sampling, spec, prefix_cache))
                if inspect.isawaitable(stream):
                    stream = await stream
                iterator = stream.__aiter__()
            except InvalidRequest as e:     # what this engine cannot serve, refused before it starts
                run.finished = True
                raise APIError(400, str(e), code="invalid_value", param=e.param) from None
            while True:
                chunk = await next_chunk(iterator, deadline, cut, run, self.settings)
                now = time.monotonic()
                if chunk.token_ids:
                    if run.queued:
                        run.queued = False
                        self.stats.observe_queued(-1)
                        self.stats.observe_running(+1)
                        self.stats.observe_first_token(now - start)
                    else:
                        self.stats.observe_tokens(len(chunk.token_ids), now - last)
                    last = now
                text = run.observe(chunk, stopper.feed(detok.add(chunk.token_ids)))
                if stopper.stopped:  # a stop string: cut there, the engine need not go on
                    run.abort_reason = "stop_string"
                    yield run.delta(index, text, "stop", chunk)
                    return
                if chunk.finished:
                    run.finished = True
                    text += stopper.feed(detok.flush()) + stopper.flush()
                    yield run.delta(index, text, "stop" if stopper.stopped else chunk.finish_reason, chunk)
                    return
                if text or chunk.token_ids:
                    yield run.delta(index, text, None, chunk)
        finally:
            self._cuts.discard(cut)
            if run.queued:
                self.stats.observe_queued(-1)
            else:
                self.stats.observe_running(-1)
            self.stats.observe_finished(run.n_tokens, run.drafted, run.accepted)
            if not run.finished:
                self.stats.observe_aborted(run.abort_reason)
                await asyncio.shield(self._abort(request_id))

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # the request may already be gone; nothing else to free
            pass

    async def run(self, prep: Prepared, is_disconnected: Disconnected | None = None
                  ) -> AsyncIterator[Delta]:
        """All choices of a request, interleaved; admission held for the whole request."""
        n = len(prep.sampling)
        self.admit(n, prep.client)
        deadline = time.monotonic() + self.settings.request_timeout_s
        base = uuid.uuid4().hex
        gens = [self.generate_choice(i, f"{base}-{i}", prep.prompts[prep.prompt_of[i]],
                                     prep.sampling[i], prep.speculation, prep.stops, deadline, prep.prefix_cache)
                for i in range(n)]
        try:
            self.stats.observe_prompt(sum(len(p) for p in prep.prompts))
            merged = gens[0] if n == 1 else merge(gens)
            watch = DisconnectWatch(is_disconnected, self.settings.disconnect_poll_s)
            try:
                async for delta in merged:
                    if await watch.gone():
                        return
                    yield delta
            finally:
                await merged.aclose()
        finally:
            self.release(n, prep.client)

    async def collect(self, prep: Prepared, is_disconnected: Disconnected | None = None
                      ) -> list[Delta]:
        """The whole answer: one Delta per choice with its full text."""
        out = [Delta(i, "") for i in range(len(prep.sampling))]
        try:
            async for d in self.run(prep, is_disconnected):
                o = out[d.index]
                o.text += d.text
                o.token_ids += d.token_ids
                o.logprobs += d.logprobs
                o.prompt_logprobs = o.prompt_logprobs or d.prompt_logprobs
                o.finish_reason = d.finish_reason or o.finish_reason
                o.completion_tokens, o.drafted, o.accepted = d.completion_tokens, d.drafted, d.accepted
                o.cached_tokens = d.cached_tokens
        except EngineError as e:
            raise engine_api_error(e, self.settings.retry_after_s) from e
        return out

    # -- endpoints ---------------------------------------------------------------------
    def parse(self, raw: bytes, model: type[SamplingFields]) -> SamplingFields:
        req = parse_body(raw, model)
        self._check_model(req)
        return req

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        prompts = [self._tokenize(p) for p in req.prompts()]
        return self.prepare(req, prompts, self.settings.default_max_tokens, req.max_tokens)

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        prep = self.prepare(req, [self._chat_prompt(req)], None, req.token_budget)
        if self.chat_template is DEFAULT_CHAT_TEMPLATE:
            prep.stops.append(DEFAULT_TEMPLATE_STOP)
        return prep

    async def completions(self, req: CompletionRequest, is_disconnected: Disconnected | None = None,
                          client: str = ANONYMOUS):
        prep = self.prepare_completion(req)
        prep.client = client
        rid, model = f"cmpl-{uuid.uuid4().hex}", self.settings.model_name
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}

        ids, lps = TokenIds(prep, req.return_token_ids), Logprobs(self.tokenizer)
        echo = Echo(prep, req.prompts(), self.tokenizer) if req.echo else None

        def choice(d: Delta) -> dict:
            prefix, prompt = echo.first(d) if echo else ("", None)
            return ids.choice({"index": d.index, "text": prefix + d.text,
                               "logprobs": lps.completion(d, req.logprobs, prompt),
                               "finish_reason": d.finish_reason}, d)
        if req.stream:
            return await sse(self, prep, head, choice, req, None)
        deltas = await self.collect(prep, is_disconnected)
        choices = [{**choice(d), "index": i} for i, d in enumerate(best_of(deltas, prep, req.n))]
        return {**head, "choices": choices, "usage": usage(prep, deltas)}

    async def chat(self, req: ChatCompletionRequest, is_disconnected: Disconnected | None = None,
                   client: str = ANONYMOUS):
        prep = self.prepare_chat(req)
        prep.client = client
        rid, model = f"chatcmpl-{uuid.uuid4().hex}", self.settings.model_name
        head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model}
        ids, lps = TokenIds(prep, req.return_token_ids), Logprobs(self.tokenizer)
        k = req.num_logprobs
        if req.stream:
            def choice(d: Delta) -> dict:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                return ids.choice({"index": d.index, "delta": delta, "logprobs": lps.chat(d, k),
                                   "finish_reason": d.finish_reason}, d, with_prompt=False)
            first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(len(prep.sampling))]
            head = {**head, "object": "chat.completion.chunk"}
            return await sse(self, prep, head, choice, req, {"choices": first, **ids.top()})
        deltas = await self.collect(prep, is_disconnected)
        shaped = [tool_call_message(req, d.text, d.finish_reason) if forced_tool(req) else
                  ({"role": "assistant", "content": d.text}, d.finish_reason) for d in deltas]
        choices = [ids.choice({"index": d.index, "message": message, "logprobs": lps.chat(d, k),
                               "finish_reason": finish}, d, with_prompt=False)
                   for d, (message, finish) in zip(deltas, shaped)]
        return {**head, "choices": choices, **ids.top(), "usage": usage(prep, deltas)}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model(self.settings.model_name)]}

    def model(self, model_id: str) -> dict:
        """`GET /v1/models/{id}`: the served model, else 404."""
        if model_id != self.settings.model_name:
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}", code="model_not_found", param="model")
        return {"id": model_id, "object": "model", "created": self.created,
                "owned_by": "specflash", "max_model_len": self.settings.max_context}

    async def health(self) -> tuple[int, dict]:
        if self.draining:
            return 503, {"status": "draining", "model": self.settings.model_name,
                         "outstanding": self.outstanding}
        try:
            h = dict(await self.engine.health())
        except Exception as e:
            h = {"ok": False, "error": repr(e)}
        ok = bool(h.get("ok"))
        body = {"status": "ok" if ok else "unavailable", "model": self.settings.model_name,
                "speculation": bool(h.get("speculation")), "outstanding": self.outstanding,
                "engine": h}
        return (200 if ok else 503), body

    async def metrics(self) -> bytes:
        try:
            engine_stats = await self.engine.stats()
        except Exception:
            engine_stats = {}
        return self.exporter.render(engine_stats)


class _Cut(Exception):
    """A choice failed by `drain` at its deadline."""


def _finish(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass
class _ChoiceRun:
    """What one choice has seen so far (`OpenAIServer.generate_choice`)."""

    n_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    cached: int = 0
    finished: bool = False             # the engine finished it (or refused it): nothing to abort
    queued: bool = True                # no token yet
    abort_reason: str = "client"
    prompt_lps: list | None = None     # an echo's prompt log-probabilities, sent with the next delta

    def observe(self, chunk, text: str) -> str:
        self.n_tokens += len(chunk.token_ids)
        self.drafted, self.accepted, self.cached = chunk.num_drafted, chunk.num_accepted, chunk.cached_tokens
        if chunk.prompt_logprobs is not None:
            self.prompt_lps = chunk.prompt_logprobs
        return text

    def delta(self, index: int, text: str, finish: str | None, chunk) -> Delta:
        prompt_lps, self.prompt_lps = self.prompt_lps, None
        return Delta(index, text, finish, self.n_tokens, self.drafted, self.accepted, list(chunk.token_ids),
                     logprobs=list(chunk.logprobs or []), prompt_logprobs=prompt_lps, cached_tokens=self.cached)


async def next_chunk(iterator, deadline: float, cut: asyncio.Future, run: _ChoiceRun,
                     settings: ServerSettings):
    """The engine's next chunk, its failures and the clock's as the client's errors (APIError,
    EngineError), with `run.finished` / `run.abort_reason` set for the abort that follows."""
    try:
        chunk = await _wait_chunk(iterator, deadline, cut)
    except InvalidRequest as e:
        run.finished = True
        raise APIError(400, str(e), code="invalid_value", param=e.param) from None
    except StopAsyncIteration:
        raise EngineError("the engine ended the request without finishing it", False)
    except asyncio.TimeoutError:
        run.abort_reason = "timeout"
        raise APIError(408, f"request timed out after {settings.request_timeout_s} s", type="timeout_error",
                       code="request_timeout") from None
    except _Cut:
        run.abort_reason = "shutdown"
        raise APIError(503, "The server shut down before this request finished "
                       f"(drain deadline {settings.drain_timeout_s:g} s); retry it", type="server_error",
                       code="server_shutting_down", headers={"Retry-After": str(settings.retry_after_s)}) from None
    if chunk.finish_reason == "error":
        run.finished = True
        msg = chunk.error or "engine error"
        raise EngineError(msg, retryable="retryable" in msg.lower())
    return chunk


async def _wait_chunk(iterator, deadline: float, cut: asyncio.Future):
    """The engine's next chunk; TimeoutError past `deadline`, _Cut once `cut` is done."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise asyncio.TimeoutError
    nxt = asyncio.ensure_future(iterator.__anext__())
    try:
        done, _ = await asyncio.wait((nxt, cut), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not nxt.done():
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
    if nxt in done:
        return nxt.result()
    raise _Cut if cut.done() else asyncio.TimeoutError
