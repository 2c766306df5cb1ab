"""gRPC `Generate` / `GenerateStream` (serving/protos/specflash.proto) over `OpenAIServer`.

`GrpcService` turns a `GenerateRequest` into the same validated completion
request the HTTP API uses, so both fronts share admission, stop strings,
detokenization and aborts; errors become gRPC status codes. The Serve ingress
(`cluster.serve_app`) calls it from its `Generate` / `GenerateStream` methods,
which Ray Serve's gRPC proxy routes to; `SpecflashServicer` serves it on a plain
`grpc.aio` server (no Ray), as the tests do.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from google.protobuf.message import DecodeError
from pydantic import ValidationError

from serving.openai_api import OpenAIServer
from serving.openai_models import (APIError, CompletionRequest, EngineError, engine_api_error,
                                   validation_error)
from serving.protos import specflash_pb2 as pb
from serving.protos import specflash_pb2_grpc as pb_grpc
from serving.responses import usage

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}
# What Serve's gRPC proxy registers: the generated service, except that bytes that are not a
# GenerateRequest reach the method as `Malformed` and get INVALID_ARGUMENT, where the generated
# deserializer (GENERATED_SERVICER_FUNCTION, which configs may still name) fails them as INTERNAL.
SERVICER_FUNCTION = "serving.grpc_service.add_servicer_to_server"
GENERATED_SERVICER_FUNCTION = "serving.protos.specflash_pb2_grpc.add_SpecflashServicer_to_server"


@dataclass
class Malformed:
    """A request whose bytes did not parse as a GenerateRequest."""

    reason: str


def parse_request(data: bytes) -> pb.GenerateRequest | Malformed:
    try:
        return pb.GenerateRequest.FromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        return Malformed(str(e) or type(e).__name__)


def add_servicer_to_server(servicer, server) -> None:
    """`add_SpecflashServicer_to_server` with `parse_request` as the request deserializer."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=parse_request,
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=parse_request,
            response_serializer=pb.GenerateStreamResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specflash.Specflash",
                                                                          handlers),))


class GrpcService:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    def to_completion(self, req: pb.GenerateRequest) -> CompletionRequest:
        body: dict = {"prompt": list(req.prompt_token_ids) or req.prompt,
                      "max_tokens": req.max_tokens or None, "top_k": req.top_k,
                      "stop": list(req.stop), "ignore_eos": req.ignore_eos,
                      "stop_token_ids": list(req.stop_token_ids),
                      "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
                      "logit_bias": {str(k): v for k, v in req.logit_bias.items()},
                      "min_p": req.min_p, "min_tokens": req.min_tokens}
        for name in ("temperature", "top_p", "seed", "repetition_penalty", "logprobs"):
            if req.HasField(name):
                body[name] = getattr(req, name)
        if req.model:
            body["model"] = req.model
        if req.response_format_json:
            try:
                body["response_format"] = json.loads(req.response_format_json)
            except ValueError as e:
                raise APIError(400, f"response_format_json is not JSON: {e}", code="invalid_value",
                               param="response_format_json") from None
        if req.HasField("guided_regex"):
            body["guided_regex"] = req.guided_regex
        if req.guided_choice:
            body["guided_choice"] = list(req.guided_choice)
        if req.HasField("speculation"):
            s = req.speculation
            body["speculation"] = {"mode": s.mode or None, "proposer": s.proposer or None,
                                   "spec_len": s.spec_len or None, "tree_width": s.tree_width or None}
        try:
            parsed = CompletionRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        self.server._check_model(parsed)
        return parsed

    def _authorize(self, context) -> str:
        """The client (serving.access) named by the `authorization` metadata; 401 otherwise."""
        metadata = dict(context.invocation_metadata() or ()) if context is not None else {}
        return self.server.check_api_key(metadata.get("authorization"))

    def _prepare(self, req, context):
        client = self._authorize(context)
        if isinstance(req, Malformed):
            raise APIError(400, f"malformed GenerateRequest: {req.reason}", code="invalid_request")
        self.server.check_admitting()
        prep = self.server.prepare_completion(self.to_completion(req))
        prep.client = client
        return prep

    def _usage(self, prep, d) -> pb.Usage:
        """The HTTP API's `usage` (`serving.responses.usage`) of a request's one choice `d`, its last Delta."""
        u = usage(prep, [d])
        return pb.Usage(prompt_tokens=u["prompt_tokens"], completion_tokens=u["completion_tokens"],
                        drafted_tokens=u["drafted_tokens"], accepted_tokens=u["accepted_tokens"],
                        prompt_tokens_details=pb.PromptTokensDetails(**u["prompt_tokens_details"]))

    async def generate(self, req: pb.GenerateRequest, context=None) -> pb.GenerateResponse:
        t0, status = time.monotonic(), 200
        try:
            prep = self._prepare(req, context)
            (d,) = await self.server.collect(prep)
            return pb.GenerateResponse(text=d.text, token_ids=d.token_ids, logprobs=_logprobs(d),
                                       finish_reason=d.finish_reason or "",
                                       usage=self._usage(prep, d))
        except APIError as e:
            status = e.status
            _set_error(context, e)
        finally:
            self.server.stats.observe_request("grpc/Generate", status, time.monotonic() - t0)

    async def generate_stream(self, req: pb.GenerateRequest, context=None
                              ) -> AsyncIterator[pb.GenerateStreamResponse]:
        t0, status = time.monotonic(), 200
        try:
            prep = self._prepare(req, context)
            async for d in self.server.run(prep):
                msg = pb.GenerateStreamResponse(text=d.text, token_ids=d.token_ids, logprobs=_logprobs(d))
                if d.finish_reason:
                    msg.finish_reason = d.finish_reason
                    msg.usage.CopyFrom(self._usage(prep, d))
                yield msg
        except EngineError as e:
            err = engine_api_error(e, self.server.settings.retry_after_s)
            status = err.status
            _set_error(context, err)
        except APIError as e:
            status = e.status
            _set_error(context, e)
        finally:
            self.server.stats.observe_request("grpc/GenerateStream", status, time.monotonic() - t0)


def _logprobs(d) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]) for lp in d.logprobs]


def _set_error(context, e: APIError) -> None:
    """Put the status on the context, then raise: both grpc.aio and Serve's gRPC proxy
    answer with the context's code when the method raises after setting one."""
    if context is not None:
        context.set_code(STATUS.get(e.status, grpc.StatusCode.INTERNAL))
        context.set_details(e.message)
    raise e


class SpecflashServicer(pb_grpc.SpecflashServicer):
    """`GrpcService` on a plain `grpc.aio` server."""

    def __init__(self, service: GrpcService) -> None:
        self.service = service

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        return await self.service.generate(request, context)

    async def GenerateStream(self, request, context):  # noqa: N802
        async for msg in self.service.generate_stream(request, context):
            yield msg
