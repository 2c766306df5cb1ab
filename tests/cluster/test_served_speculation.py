"""What a served request gets when it does not say, and what it gets when it names a proposer
(issue 22, "Fix on the way"): the config's `speculation` mode, depth and width apply to a
request without `speculation`, over HTTP and gRPC, in process and through the Ray pipeline; a
request's `speculation.proposer` is honoured by the pipeline as by the in-process engine, and
one the deployment lacks is refused with a 400 that names what it has."""
from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from cluster.config import AppArgs, ModelPairConfig
from cluster.serve_app import make_engine
from models.sampling import SamplingParams
from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.protos import specflash_pb2 as pb
from speculation.requests import GenerationRequest, InvalidRequest, SpeculationOptions
from speculation.settings import SpeculationSettings

from tests.serving import serving_helpers
from .pipeline_helpers import collect, hf_greedy, run

CYCLE = list(b"abcdefghijkl")            # the copying target walks this cycle (tests/conftest.py)


def _local(target, draft, **speculation):
    args = AppArgs(engine="local", models=ModelPairConfig(target=str(target), draft=None if draft is None else str(draft)),
                   speculation=SpeculationSettings(**speculation))
    engine, tokenizer, max_context = make_engine("local", args)
    return engine, tokenizer, OpenAIServer(engine, tokenizer, ServerSettings(max_context=max_context))


def _complete(server, **body):
    r = TestClient(build_fastapi_app(server)).post("/v1/completions", json={
        "prompt": "def f(x):", "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body})
    return r.status_code, r.json()


@pytest.mark.parametrize("mode", ["off", "chain"])
def test_a_request_without_speculation_gets_the_configs_over_http_and_grpc(tiny_target, close_draft, mode):
    engine, tok, server = _local(tiny_target, close_draft, mode=mode, spec_len=2)
    try:
        status, body = _complete(server)
        assert status == 200, body
        assert (body["usage"]["drafted_tokens"] > 0) == (mode == "chain")
        status, forced = _complete(server, speculation={"mode": "chain", "spec_len": 3})
        assert status == 200 and forced["usage"]["drafted_tokens"] > 0     # a request may override it
        assert forced["choices"][0]["text"] == body["choices"][0]["text"]

        async def grpc_call(channel, stub, engine, server):
            return await stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_tokens=12, temperature=0.0,
                                                          ignore_eos=True))
        reply = asyncio.run(serving_helpers.with_grpc(grpc_call, engine, tok))
        assert reply.text == body["choices"][0]["text"]
        assert (reply.usage.drafted_tokens > 0) == (mode == "chain")
        if mode == "chain":    # no tree deeper than the config's spec_len 2 was drafted
            depths = asyncio.run(engine.stats())["acceptance_per_depth"]
            assert 1 <= len(depths) <= 3       # the forced request's chains reach depth 3
    finally:
        engine.shutdown()


def test_a_proposer_the_deployment_lacks_is_a_400_naming_what_it_has(tiny_target):
    engine, _, server = _local(tiny_target, None, proposer="ngram")
    try:
        status, body = _complete(server, speculation={"mode": "chain", "proposer": "model"})
        assert status == 400, body
        assert "'model' is not available" in body["error"]["message"] and "'ngram'" in body["error"]["message"]
        assert body["error"]["param"] == "speculation.proposer"
        status, body = _complete(server, speculation={"mode": "chain", "proposer": "ngram"})
        assert status == 200, body
    finally:
        engine.shutdown()


def test_the_pipeline_applies_the_configs_speculation_to_requests_that_do_not_say(make_engine, tiny_target,
                                                                                 close_draft, hf_target):
    prompt = list(b"def f(x):")
    off = make_engine(tiny_target, close_draft, speculation={"mode": "off"})
    tokens, last = run(collect(off, GenerationRequest("d0", prompt, SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))))
    assert tokens == hf_greedy(hf_target, prompt, 16) and last.num_drafted == 0
    chain = make_engine(tiny_target, close_draft, speculation={"mode": "chain", "spec_len": 2})
    tokens, last = run(collect(chain, GenerationRequest("d1", prompt, SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))))
    assert tokens == hf_greedy(hf_target, prompt, 16) and last.num_drafted > 0
    assert len(run(chain.stats())["acceptance_per_depth"]) <= 2


def test_the_pipeline_honours_a_requests_proposer(make_engine, copying_target, far_draft):
    """A far draft rarely lands a token on the copying target; prompt lookup on a prompt that
    walked the cycle nearly always does: the pipeline drafted with what each request named."""
    from transformers import LlamaForCausalLM

    prompt = CYCLE * 2 + CYCLE[:5]
    expected = hf_greedy(LlamaForCausalLM.from_pretrained(copying_target).eval(), prompt, 24)
    engine = make_engine(copying_target, far_draft, speculation={"lookup": False})
    got = {}
    for proposer in ("model", "ngram"):
        spec = SpeculationOptions(mode="chain", spec_len=4, proposer=proposer)
        tokens, last = run(collect(engine, GenerationRequest(proposer, prompt, SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True), spec)))
        assert tokens == expected, proposer
        got[proposer] = last.num_accepted / max(1, last.num_drafted)
    assert got["ngram"] > 0.8 and got["model"] < 0.5, got


def test_a_pipeline_without_a_draft_refuses_the_model_proposer(make_engine, copying_target):
    engine = make_engine(copying_target, None, speculation={"proposer": "ngram"})
    request = GenerationRequest("m", list(b"abc"), SamplingParams(temperature=0.0, max_tokens=4),
                                SpeculationOptions(mode="chain", proposer="model"))
    with pytest.raises(InvalidRequest, match="'model' is not available.*'ngram'"):
        run(collect(engine, request))
    tokens, last = run(collect(engine, GenerationRequest("n", CYCLE * 2, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True), SpeculationOptions(mode="chain", proposer="ngram"))))
    assert len(tokens) == 8 and last.num_drafted > 0
