"""gRPC Generate / GenerateStream over a plain grpc.aio server with a FakeEngine (no Ray),
and the committed generated modules being current."""
from __future__ import annotations

import ast
import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from serving.protos import specflash_pb2 as pb
from serving.protos import specflash_pb2_grpc as pb_grpc
from serving.testing import SAMPLE_TEXT, FakeEngine, tiny_byte_tokenizer

from . import serving_helpers

ROOT = Path(__file__).resolve().parents[2]
TOK = tiny_byte_tokenizer()
OUT = TOK.encode(SAMPLE_TEXT * 4)


def decode(ids):
    return TOK.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


async def with_server(fn, engine=None, **settings):
    """The generated servicer function, as configs that predate the lenient one name it."""
    return await serving_helpers.with_grpc(
        lambda channel, stub, engine, server: fn(stub, engine, server),
        engine or FakeEngine(script=lambda r: OUT), TOK,
        add_to_server=pb_grpc.add_SpecflashServicer_to_server, **settings)


def test_generate_and_stream_agree():
    async def go(stub, engine, server):
        req = pb.GenerateRequest(prompt="hi", max_tokens=25, temperature=0.0, seed=3,
                                 speculation=pb.Speculation(mode="chain", spec_len=3))
        whole = await stub.Generate(req)
        pieces = [m async for m in stub.GenerateStream(req)]
        return whole, pieces, engine.requests

    whole, pieces, requests = asyncio.run(with_server(go))
    assert whole.text == decode(OUT[:25]) and list(whole.token_ids) == OUT[:25]
    assert whole.finish_reason == "length"
    assert whole.usage.completion_tokens == 25 and whole.usage.prompt_tokens == len(TOK.encode("hi"))
    assert whole.usage.drafted_tokens > 0
    assert "".join(p.text for p in pieces) == whole.text
    assert [t for p in pieces for t in p.token_ids] == OUT[:25]
    assert [p.finish_reason for p in pieces][-1] == "length"
    assert all(not p.finish_reason and not p.HasField("usage") for p in pieces[:-1])
    assert pieces[-1].usage == whole.usage
    r = requests[0]
    assert r.sampling.temperature == 0.0 and r.sampling.seed == 3
    assert (r.speculation.mode, r.speculation.spec_len, r.speculation.tree_width) == ("chain", 3, None)


def test_sampling_transforms_travel_over_grpc():
    """The fields the HTTP API takes reach the engine the same way; bad values are INVALID_ARGUMENT."""
    async def go(stub, engine, server):
        req = pb.GenerateRequest(prompt="hi", max_tokens=4, presence_penalty=0.5, frequency_penalty=-1.0,
                                 repetition_penalty=1.3, logit_bias={7: -100.0, 3: 2.5}, min_p=0.05,
                                 min_tokens=2, stop_token_ids=[9])
        await stub.Generate(req)
        lp_req = pb.GenerateRequest(prompt="hi", max_tokens=5, logprobs=2)
        whole = await stub.Generate(lp_req)
        pieces = [m async for m in stub.GenerateStream(lp_req)]
        codes = []
        for bad in (pb.GenerateRequest(prompt="hi", presence_penalty=3.0),
                    pb.GenerateRequest(prompt="hi", logprobs=21),
                    pb.GenerateRequest(prompt="hi", logit_bias={10**6: 1.0}),
                    pb.GenerateRequest(prompt="hi", stop_token_ids=[10**6])):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(bad)
            codes.append(e.value.code())
        return engine.requests, codes, whole, pieces

    requests, codes, whole, pieces = asyncio.run(with_server(go))
    from serving.testing import fake_logprob
    assert [(x.token_id, x.logprob, [(t.token_id, t.logprob) for t in x.top]) for x in whole.logprobs] == \
        [(t, fake_logprob(t, 2).logprob, fake_logprob(t, 2).top) for t in OUT[:5]]
    assert [x for p in pieces for x in p.logprobs] == list(whole.logprobs)
    r = requests[0]
    assert requests[1].sampling.logprobs == 2 and requests[0].sampling.logprobs is None
    sp = r.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.3)
    assert sp.logit_bias == [(3, 2.5), (7, -100.0)] and (sp.min_p, sp.min_tokens) == (0.05, 2)
    assert sp.stop_token_ids == [9] and codes == [grpc.StatusCode.INVALID_ARGUMENT] * 4


@pytest.mark.parametrize("req,code", [
    (pb.GenerateRequest(prompt="hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="x " * 300), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", speculation=pb.Speculation(mode="sideways")),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(prompt="hi", model="gpt-4"), grpc.StatusCode.NOT_FOUND),
])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_errors_are_status_codes(req, code, method):
    async def go(stub, engine, server):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            if method == "Generate":
                await stub.Generate(req)
            else:
                [m async for m in stub.GenerateStream(req)]
        return info.value, engine.requests

    err, requests = asyncio.run(with_server(go))
    assert err.code() == code and err.details()
    assert requests == []


def test_queue_full_is_resource_exhausted():
    async def go(stub, engine, server):
        long = stub.GenerateStream(pb.GenerateRequest(prompt="a", max_tokens=200))
        await long.read()          # the first piece: the request is admitted and running
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(pb.GenerateRequest(prompt="b", max_tokens=2))
        long.cancel()
        await asyncio.sleep(0.3)
        return info.value, engine.aborted, server.outstanding

    err, aborted, outstanding = asyncio.run(
        with_server(go, FakeEngine(script=lambda r: OUT, delay_s=0.02), max_queue=1))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(aborted) == 1 and outstanding == 0   # the cancelled stream was aborted


def _descriptor_bytes(source: str) -> bytes:
    """The serialized FileDescriptorProto a generated _pb2 module registers."""
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", source, re.S)
    assert m, "not a protoc-generated _pb2 module"
    return ast.literal_eval(m.group(1))


def _rpcs(source: str) -> list[tuple[str, str]]:
    """(kind, method path) of every RPC a generated _pb2_grpc stub declares."""
    return re.findall(r"channel\.(unary_unary|unary_stream|stream_unary|stream_stream)\(\s*'([^']+)'",
                      source)


def test_generated_modules_are_current(tmp_path):
    """Regenerate from the .proto and compare what the modules define (the descriptor and the
    RPCs), not their text, which varies with the grpcio-tools version."""
    proto = "serving/protos/specflash.proto"
    (tmp_path / "serving" / "protos").mkdir(parents=True)
    (tmp_path / proto).write_bytes((ROOT / proto).read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--grpc_python_out=.", proto], cwd=tmp_path, check=True)
    fresh = {n: (tmp_path / "serving" / "protos" / n).read_text()
             for n in ("specflash_pb2.py", "specflash_pb2_grpc.py")}
    committed = {n: (ROOT / "serving" / "protos" / n).read_text() for n in fresh}
    stale = "serving/protos/{} is stale: regenerate it (the command is in specflash.proto)"
    assert _descriptor_bytes(fresh["specflash_pb2.py"]) == \
        _descriptor_bytes(committed["specflash_pb2.py"]), stale.format("specflash_pb2.py")
    rpcs = _rpcs(fresh["specflash_pb2_grpc.py"])
    assert rpcs == [("unary_unary", "/specflash.Specflash/Generate"),
                    ("unary_stream", "/specflash.Specflash/GenerateStream")]
    assert _rpcs(committed["specflash_pb2_grpc.py"]) == rpcs, stale.format("specflash_pb2_grpc.py")



def test_api_key_is_checked_on_grpc_metadata():
    async def go(stub, engine, server):
        req = pb.GenerateRequest(prompt="hi", max_tokens=2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Generate(req)
        ok = await stub.Generate(req, metadata=(("authorization", "Bearer k"),))
        return info.value.code(), ok

    code, ok = asyncio.run(with_server(go, api_key="k"))
    assert code == grpc.StatusCode.UNAUTHENTICATED and ok.usage.completion_tokens == 2


def test_structured_output_travels_over_grpc():
    """response_format (as JSON text), guided_regex and guided_choice become the engine's grammar;
    a bad one is INVALID_ARGUMENT."""
    async def go(stub, engine, server):
        fmt = json.dumps({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}})
        for req in (pb.GenerateRequest(prompt="hi", max_tokens=3, response_format_json=fmt),
                    pb.GenerateRequest(prompt="hi", max_tokens=3, guided_regex="[a-z]+"),
                    pb.GenerateRequest(prompt="hi", max_tokens=3, guided_choice=["yes", "no"])):
            await stub.Generate(req)
        codes = []
        for bad in (pb.GenerateRequest(prompt="hi", guided_regex="([a-"),
                    pb.GenerateRequest(prompt="hi", response_format_json="{nope"),
                    pb.GenerateRequest(prompt="hi", response_format_json='{"type": "xml"}')):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(bad)
            codes.append(e.value.code())
        return engine.requests, codes

    requests, codes = asyncio.run(with_server(go))
    assert [r.sampling.grammar.kind for r in requests] == ["json_schema", "regex", "choice"]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 3
