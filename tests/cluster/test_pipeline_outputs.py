"""A pipeline's requests and chunks over its consumer's socket to the verifier
(cluster/outputs.py): exact output, the socket really carries them, Ray streams where it is
off, and its faults: a consumer that goes away aborts its requests, an abort right behind its
request finds it, a bad hello or a connection without the secret harms no one, a message the
verifier cannot read closes that connection alone, a refused request is an error chunk, a new
event loop connects again."""
from __future__ import annotations

import asyncio
import struct
import time
import ray

from cluster.outputs import FRAME, OutputClient, decode_chunk, encode_chunk, frame
from models.sampling import TokenLogprob
from speculation.requests import GenerationChunk

from .pipeline_helpers import collect, hf_greedy, prompts, request, run


def _health(engine) -> dict:
    return ray.get(engine.pipelines[0].verifier.health.remote(), timeout=10)


def _idle(engine, timeout: float = 10.0) -> dict:
    """The verifier's KV usage once every block is free again (or the last one seen)."""
    deadline, usage = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        usage = ray.get(engine.pipelines[0].verifier.kv_usage.remote())
        if usage["free"] == usage["total"] and usage["streams"] == 0:
            break
        time.sleep(0.05)
    return usage


def test_a_chunk_survives_its_frame_with_log_probabilities():
    c = GenerationChunk("r", [5, 6], True, "length", 7, 3, None, 2,
                        [TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)]), TokenLogprob(6, -0.5, [])],
                        [None, TokenLogprob(1, -2.0, [(1, -2.0)])])
    frame = encode_chunk(c)
    (size,) = FRAME.unpack(frame[:FRAME.size])
    assert size == len(frame) - FRAME.size and decode_chunk(frame[FRAME.size:]) == c
    plain = GenerationChunk("q", [1], error="boom", finish_reason="error", finished=True)
    assert decode_chunk(encode_chunk(plain)[FRAME.size:]) == plain


def test_the_socket_carries_the_chunks_and_output_is_exact(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft)
    ps = prompts(3, seed=41)
    sent = _health(engine)["output_chunks"]

    async def all_of():
        return await asyncio.gather(*(collect(engine, request(f"o{i}", p, 30, "chain", 4)) for i, p in enumerate(ps)))

    outs = run(all_of(), 180)
    chunks = 0
    for (tokens, last), p in zip(outs, ps):
        assert tokens == hf_greedy(hf_target, p, 30) and last.finish_reason == "length" and last.num_drafted > 0
    h = _health(engine)
    # every chunk of the three requests went through the socket (the three ends at least)
    chunks = h["output_chunks"] - sent
    assert chunks >= 3 and h["output_connections"] >= 1, h
    # a second event loop (asyncio.run again) connects again and is served
    tokens, last = run(collect(engine, request("again", ps[0], 12, "chain", 4)))
    assert tokens == hf_greedy(hf_target, ps[0], 12) and _health(engine)["output_chunks"] > h["output_chunks"]


def test_ray_streams_when_the_socket_is_off(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft, output_socket=False)
    p = prompts(1, seed=42)[0]
    tokens, last = run(collect(engine, request("ray", p, 20, "chain", 4)))
    assert tokens == hf_greedy(hf_target, p, 20) and last.finish_reason == "length"
    h = _health(engine)
    assert h["output_chunks"] == 0 and h["output_connections"] == 0, h


def test_a_refused_request_is_an_error_chunk_and_the_connection_serves_on(make_engine, tiny_target, close_draft,
                                                                           hf_target):
    engine = make_engine(tiny_target, close_draft)
    p = prompts(1, seed=43)[0]

    async def both():
        bad = await collect(engine, request("bad", [1, 10 ** 6], 8, "chain", 4))
        good = await collect(engine, request("good", p, 16, "chain", 4))
        return bad, good

    (_, bad), (tokens, _) = run(both())
    assert bad.finish_reason == "error" and "outside the vocabulary" in bad.error, bad
    assert not bad.error.startswith("retryable")
    assert tokens == hf_greedy(hf_target, p, 16)


def test_a_consumer_gone_aborts_its_requests(make_engine, tiny_target, close_draft):
    engine = make_engine(tiny_target, close_draft)
    verifier = engine.pipelines[0].verifier
    address = ray.get(verifier.output_address.remote())
    req = request("left", [1, 2, 3], 240, "chain", 3)
    before = ray.get(verifier.get_stats.remote())["num_steps"]

    async def leave_midway():
        # the connection drops under a running request (its consumer's process going away): no
        # abort call is made, the verifier must notice by itself
        client = OutputClient(address)
        await client.connect(address.node)
        chunks = await client.submit(req)
        seen = []
        while len(seen) < 5:
            seen += (await chunks.next(30)).token_ids
        client.abandon()
        return seen

    assert len(run(leave_midway())) >= 5
    usage = _idle(engine)
    assert usage["free"] == usage["total"] and usage["streams"] == 0 and usage["ring"] == 0, usage
    # it was aborted, not run to its end (240 tokens take 60 steps or more: 4 tokens a step at most)
    assert ray.get(verifier.get_stats.remote())["num_steps"] - before < 30


def test_a_bad_hello_harms_no_one(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft)
    address = ray.get(engine.pipelines[0].verifier.output_address.remote())

    async def garbage_then_request():
        r, w = await asyncio.open_unix_connection(address.path)
        w.write(struct.pack("<I", 3) + b"\xc1\xc1\xc1")      # not msgpack
        await w.drain()
        closed = await asyncio.wait_for(r.read(), 10)            # the verifier hangs up
        w.close()
        r, w = await asyncio.open_unix_connection(address.path)
        w.write(struct.pack("<I", 1 << 30))                      # a "token" of a gigabyte
        await w.drain()
        closed += await asyncio.wait_for(r.read(), 10)           # refused before it is read
        w.close()
        client = OutputClient(address)
        await client.connect(address.node)                       # a proper consumer is still served
        return closed, client.usable()

    closed, usable = run(garbage_then_request())
    assert closed == b"" and usable
    p = prompts(1, seed=44)[0]
    tokens, _ = run(collect(engine, request("after-garbage", p, 10, "chain", 4)))
    assert tokens == hf_greedy(hf_target, p, 10)


def test_a_consumer_that_cannot_connect_streams_through_ray(make_engine, tiny_target, close_draft, hf_target,
                                                            monkeypatch):
    import cluster.outputs

    engine = make_engine(tiny_target, close_draft)

    async def refused(self, node):
        raise ConnectionRefusedError("the network refuses the port")

    monkeypatch.setattr(cluster.outputs.OutputClient, "connect", refused)
    p = prompts(1, seed=45)[0]
    tokens, last = run(collect(engine, request("refused", p, 16, "chain", 4)))
    assert tokens == hf_greedy(hf_target, p, 16) and last.finish_reason == "length"
    assert _health(engine)["output_chunks"] == 0
    assert engine.pipelines[0].output is None and engine.pipelines[0].output_retry_at > time.monotonic()


def test_an_abort_right_behind_its_request_aborts_it(make_engine, tiny_target, close_draft):
    engine = make_engine(tiny_target, close_draft)
    verifier = engine.pipelines[0].verifier
    address = ray.get(verifier.output_address.remote())
    before = ray.get(verifier.get_stats.remote())["num_steps"]

    async def submit_and_abort():
        client = OutputClient(address)
        await client.connect(address.node)
        chunks = await client.submit(request("gone", [1, 2, 3], 240, "chain", 3))
        await client.abort("gone")            # no wait between them: the frames arrive together
        seen = []
        while (c := await chunks.next(30)) is not None:
            seen.append(c)
        client.abandon()
        return seen

    seen = run(submit_and_abort())
    assert seen[-1].finished and seen[-1].finish_reason == "abort", seen[-1]
    assert sum(len(c.token_ids) for c in seen) < 240
    usage = _idle(engine)
    assert usage["free"] == usage["total"] and usage["streams"] == 0, usage
    assert ray.get(verifier.get_stats.remote())["num_steps"] - before < 30


def test_a_connection_without_the_secret_is_closed(make_engine, tiny_target, close_draft):
    engine = make_engine(tiny_target, close_draft)
    address = ray.get(engine.pipelines[0].verifier.output_address.remote())

    async def wrong_secret():
        r, w = await asyncio.open_unix_connection(address.path)
        w.write(frame(["a-token", "not-the-secret"]))
        await w.drain()
        closed = await asyncio.wait_for(r.read(), 10)       # no acknowledgement: the verifier hangs up
        w.close()
        return closed

    assert run(wrong_secret()) == b""
    assert _health(engine)["output_connections"] == 0


def test_a_message_it_cannot_read_closes_that_connection_alone(make_engine, tiny_target, close_draft, hf_target):
    engine = make_engine(tiny_target, close_draft)
    address = ray.get(engine.pipelines[0].verifier.output_address.remote())
    p = prompts(1, seed=46)[0]

    async def one_bad_one_good():
        good, bad = OutputClient(address), OutputClient(address)
        await good.connect(address.node)
        await bad.connect(address.node)
        chunks = await good.submit(request("beside", p, 24, "chain", 4))
        await bad._send(["launch", 1, 2])                 # no such message
        await asyncio.wait_for(bad._task, 10)             # the verifier closed the bad connection
        tokens = []
        while (c := await chunks.next(30)) is not None:
            tokens += c.token_ids
        good.abandon()
        return bad.broken, tokens

    broken, tokens = run(one_bad_one_good())
    assert broken and tokens == hf_greedy(hf_target, p, 24)
