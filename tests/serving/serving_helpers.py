"""Shared by the serving-front tests: `OpenAIServer` behind a plain grpc.aio server (no Ray)."""
from __future__ import annotations

import grpc

from serving.grpc_service import GrpcService, SpecflashServicer, add_servicer_to_server
from serving.openai_api import OpenAIServer, ServerSettings
from serving.protos import specflash_pb2_grpc as pb_grpc


async def with_grpc(fn, engine, tokenizer, add_to_server=add_servicer_to_server, **settings):
    """`await fn(channel, stub, engine, server)` against a fresh server on a free local port."""
    server = OpenAIServer(engine, tokenizer, ServerSettings(**{"max_context": 256, **settings}))
    grpc_server = grpc.aio.server()
    add_to_server(SpecflashServicer(GrpcService(server)), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await fn(channel, pb_grpc.SpecflashStub(channel), engine, server)
    finally:
        await grpc_server.stop(None)
