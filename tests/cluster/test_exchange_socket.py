"""The exchange over a socket (cluster/exchange_socket.py) without Ray: a verifier's
`ExchangeServer` on an event loop of its own, a drafter's `SocketLink` that finds it by
`address()` and asks `verifier_alive()` instead of by actor call. Round trips over Unix and
TCP, refused frames, a verifier error, a late reply from a verifier that is alive (waited for)
and from one that is not (lost, then the link reconnects with both processes up), a verifier
gone, a stranger's connection, and the fallback to actor calls."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import torch

import cluster.exchange_socket as xs
from cluster.outputs import frame
from cluster.transport import RayLink
from speculation.transport import Exchange, ExchangeLost, FramesRefused, TreePut, VerifierUnavailable
from speculation.wire import Signal, TreeHeader, WireError, decode_tree, encode_signals, encode_tree, pack_header

NODE = "node-a"


class Verifier:
    """An ExchangeServer on a loop in a thread; `serve` records each call and answers from
    `self.answer` (after `self.delay` seconds)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.calls: list[tuple] = []
        self.delay = 0.0
        self.fail: Exception | None = None
        self.answer = [Signal("step", "s", 0, 3, 9, [5, 6])]
        self.server = xs.ExchangeServer("inc-1", NODE, "127.0.0.1", self.serve)
        self.address = self.run(self.server.start())

    async def serve(self, *args) -> bytes:
        self.calls.append(args)
        answer = self.answer                  # as it was when the call came
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return encode_signals(answer)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        time.sleep(0.1)

    def stop(self) -> None:
        self.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Link(xs.SocketLink):
    """A SocketLink that finds its verifier without Ray."""

    def __init__(self, verifier: Verifier, node: str = NODE) -> None:
        super().__init__(None, node)
        self.verifier_side = verifier
        self.gone = False
        self.alive = False              # what `verifier_alive` answers (by actor call in the real link)
        self.asked = 0

    def verifier_alive(self) -> bool:
        self.asked += 1
        return self.alive

    def address(self):
        if self.gone:
            raise VerifierUnavailable("gone")
        return self.verifier_side.address


@pytest.fixture
def verifier():
    v = Verifier()
    yield v
    v.stop()


def _tree_put(num_nodes: int = 3, vocab: int = 5) -> TreePut:
    header = TreeHeader("s", 0, 3, 7, 6, [11], num_nodes, vocab, [1, 2])
    probs = torch.rand(num_nodes + 1, vocab)
    frame_ = encode_tree(header, torch.arange(num_nodes), torch.arange(num_nodes) - 1,
                         torch.arange(1, num_nodes + 1), probs)
    return TreePut(header, frame_)


def _call(*puts: TreePut, wait_s: float = 0.0) -> Exchange:
    return Exchange(0, "drafter-inc", list(puts), wait_s, 0.01, 2, ["r"], NODE, 1.0, None, False)


@pytest.mark.parametrize("node", [NODE, "node-b"], ids=["unix", "tcp"])
def test_a_round_trip_carries_trees_and_signals(verifier, node):
    link = Link(verifier, node)
    put = _tree_put()
    signals = link.exchange(_call(put))
    assert signals == verifier.answer
    (args,) = verifier.calls
    drafter, incarnation, puts, *rest = args
    assert (drafter, incarnation, rest) == (0, "drafter-inc", [0.0, 0.01, 2, ["r"], NODE, 1.0, None, False])
    (header, tree), = puts
    got, sent = decode_tree(tree), decode_tree(put.payload)
    assert got.header == sent.header == put.header
    for name in ("token_ids", "parent_ids", "depths", "draft_probs"):
        assert np.array_equal(getattr(got, name), getattr(sent, name)), name
    assert link.exchange(_call()) == verifier.answer        # the same connection, a second time
    assert (link.exchanges, link.lost, verifier.server.served, verifier.server.connections) == (2, 0, 2, 1)
    link.close()


def test_a_malformed_tree_is_refused_and_the_connection_goes_on(verifier):
    link = Link(verifier)
    put = _tree_put()
    short = (put.payload[0], put.payload[1][:2], *put.payload[2:])     # 2 token ids for 3 nodes
    with pytest.raises(FramesRefused, match="int64"):
        link.exchange(_call(TreePut(put.header, short)))
    assert verifier.calls == []                          # refused before the verifier saw anything
    assert link.exchange(_call(put)) == verifier.answer
    assert link.lost == 0 and verifier.server.connections == 1


def test_the_verifier_refuses_a_q_over_another_vocabulary_than_its_targets():
    from cluster.transport import unpack_puts

    put = _tree_put(vocab=5)
    wire = [[pack_header(put.header), list(put.payload)]]
    (got,) = unpack_puts(wire, vocab_size=5)
    assert got.header == put.header and got.payload.draft_probs.shape == (4, 5)
    with pytest.raises(WireError, match="vocabulary of 5, the target's is 7"):
        unpack_puts(wire, vocab_size=7)


def test_a_verifier_error_is_transient(verifier):
    link = Link(verifier)
    verifier.fail = KeyError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        link.exchange(_call())
    verifier.fail = None
    assert link.exchange(_call()) == verifier.answer and link.lost == 0


def test_a_late_reply_from_a_live_verifier_is_waited_for(verifier, monkeypatch):
    monkeypatch.setattr(xs, "REPLY_SLACK_S", 0.2)
    link = Link(verifier)
    link.alive = True                                    # a long forward: it answers its health
    verifier.delay = 0.9
    assert link.exchange(_call(wait_s=0.1)) == verifier.answer
    assert link.asked >= 2 and link.lost == 0 and link.exchanges == 1


def test_a_late_reply_is_lost_and_the_link_reconnects_with_both_alive(verifier, monkeypatch):
    monkeypatch.setattr(xs, "REPLY_SLACK_S", 0.2)
    link = Link(verifier)
    assert link.exchange(_call()) == verifier.answer
    verifier.delay = 0.6
    start = time.monotonic()
    with pytest.raises(ExchangeLost):                    # the verifier says it is not the one we reached
        link.exchange(_call(wait_s=0.1))
    assert time.monotonic() - start < 0.55 and link.lost == 1 and link.asked == 1
    verifier.delay, verifier.answer = 0.0, [Signal("leave", "s", 0, 0, 0, [])]
    assert link.exchange(_call()) == verifier.answer     # a new connection, not the late reply of the old
    time.sleep(0.7)
    assert verifier.server.connections == 1 and link.exchanges == 2


def test_a_verifier_gone_is_a_lost_exchange_then_unavailable(verifier):
    link = Link(verifier)
    assert link.exchange(_call()) == verifier.answer
    verifier.close()                                     # its connections close as its process would
    link.gone = True
    with pytest.raises(ExchangeLost):
        link.exchange(_call())
    with pytest.raises(VerifierUnavailable):
        link.exchange(_call())


def test_a_connection_without_the_secret_is_closed(verifier):
    with socket.create_connection(("127.0.0.1", verifier.address.port), timeout=5) as s:
        s.sendall(frame(["not the secret"]))
        assert s.recv(16) == b""                         # closed, nothing answered
    link = Link(verifier, "node-b")
    assert link.exchange(_call()) == verifier.answer


def test_a_socket_that_will_not_connect_falls_back_to_actor_calls(verifier, monkeypatch):
    calls = []

    def by_call(self, call):
        calls.append(call)
        if len(calls) == 2:
            raise VerifierUnavailable("restarting")
        return []

    monkeypatch.setattr(RayLink, "exchange", by_call)
    link = Link(verifier, "node-b")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                         # nothing listens there now
    verifier.address = xs.ExchangeAddress("inc-1", NODE, "", "127.0.0.1", port, "x")
    assert link.exchange(_call()) == [] and link.by_call and len(calls) == 1
    with pytest.raises(VerifierUnavailable):             # gone: its next incarnation's socket is tried
        link.exchange(_call())
    assert not link.by_call


def test_tree_bytes_refuse_sizes_that_disagree_with_the_header():
    from speculation.wire import tree_from_bytes, tree_to_bytes

    put = _tree_put(num_nodes=2, vocab=4)
    wire = tree_to_bytes(put.payload)
    assert decode_tree(tree_from_bytes(msgpack.unpackb(msgpack.packb(wire)))).header == put.header
    with pytest.raises(WireError, match="draft_probs"):
        tree_from_bytes([*wire[:4], wire[4][:-4], wire[5]])
    with pytest.raises(WireError, match="bytes"):
        tree_from_bytes(wire[:4])


def test_a_verifier_without_an_address_is_reached_by_actor_call(verifier, monkeypatch):
    monkeypatch.setattr(RayLink, "exchange", lambda self, call: [])

    class NoAddress(Link):
        def address(self):
            raise AttributeError("'Proxy' object has no attribute 'exchange_address'")

    link = NoAddress(verifier)
    assert link.exchange(_call()) == [] and link.by_call and verifier.calls == []


def test_drafters_asking_at_once_share_one_listener(verifier):
    server = xs.ExchangeServer("inc-2", NODE, "127.0.0.1", verifier.serve)      # not listening yet

    async def three():
        return await asyncio.gather(server.start(), server.start(), server.start())

    addresses = verifier.run(three())
    try:
        assert addresses[0] == addresses[1] == addresses[2] and len(server._servers) == 2   # one Unix, one TCP
        link = Link(verifier, "node-b")
        verifier.address = addresses[0]
        assert link.exchange(_call()) == verifier.answer
    finally:
        verifier.loop.call_soon_threadsafe(server.close)
