"""The drafter-verifier exchange over Ray's shared-memory channels (`EngineSettings.exchange_channels`).

An actor call costs ~1.5 ms a round trip on this machine; a pair of Ray channels (one each
way, `ray.experimental.channel`) ~0.2 ms (`bench/cgraph_probe.py`). `ChannelLink` is the
drafter's side: on its first exchange it opens a request channel (drafter writes, verifier
reads) and asks the verifier, by one actor call (`VerifierActor.open_channel`), to serve it;
the verifier answers with a reply channel (verifier writes, drafter reads) and reads the
request channel on a thread of its own (`ChannelServer`), handing each message to its event
loop as the same `exchange` an actor call makes. Trees and signals keep their wire format:
a message is exactly the actor call's arguments, the reply its msgpack signal frame.

Faults, as Ray 2.60's channels behave here:
- a read that timed out leaves a channel unreadable, so the verifier's reader blocks without
  a timeout; a drafter that reconnects (a restart, or after a lost exchange) has the verifier
  close its old request channel, which ends that blocked read (RayChannelError);
- the drafter's reads do time out (a dead verifier writes nothing): after a timeout, or any
  channel error, the link drops both channels, reports the exchange lost (its signals may
  have been taken: `ExchangeLost`, the drafter resyncs its streams) and reconnects on the next
  exchange, where a dead verifier shows as `VerifierUnavailable`;
- a channel's buffer grows itself for a larger message (Ray resizes it on write); a read's
  numpy arrays live in the channel's buffer, which the next message overwrites, so the
  verifier copies a message's trees out before filing them.
Drafters joining, leaving and restarting, and scaling, still go through actor calls.

Known hazard, why this stays opt-in: closing a request channel whose writer is still alive (a
reconnect after a lost exchange, both sides up) took the local raylet down later in a test
session here (Ray 2.60: "owner's node has crashed" in the next test). Closing a dead
drafter's channel (its restart) did not.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

import numpy as np
import ray

from cluster.transport import RayLink, first_line
from speculation.transport import Exchange, ExchangeLost, FramesRefused, VerifierUnavailable
from speculation.wire import Signal, decode_signals, pack_header

log = logging.getLogger("specflash.cluster")

BUFFER_BYTES = 4 << 20      # a channel's first buffer: a sampled tree's draft distributions fit
REPLY_SLACK_S = 5.0         # a reply later than the call's long-poll by this much: the verifier is gone


def _channel(writer, reader, node: str):
    from ray.experimental.channel.shared_memory_channel import Channel

    return Channel(writer, [(reader, node)], BUFFER_BYTES)


def _read(channel, timeout: float | None):
    """A channel's next value; its error (a closed channel) raised, not returned."""
    value = channel.read(timeout=timeout)
    if isinstance(value, BaseException):
        raise value
    return value


class ChannelLink(RayLink):
    """A drafter's link to its verifier over a pair of channels (see the module docstring)."""

    def __init__(self, verifier) -> None:
        super().__init__(verifier)
        self._req = self._resp = None
        self.exchanges = 0          # exchanges that went through the channels
        self.lost = 0               # exchanges whose reply never came (a timeout, a closed channel)

    def exchange(self, call: Exchange) -> list[Signal]:
        if self._req is None:
            self._connect(call.drafter)
        msg = (call.drafter, call.incarnation, [(pack_header(p.header), p.payload) for p in call.puts],
               call.wait_s, call.draft_s, call.draft_levels, list(call.resync), call.node, call.cpus,
               call.gpus, call.idle)
        try:
            self._req.write(msg, timeout=REPLY_SLACK_S)
            kind, body = _read(self._resp, call.wait_s + REPLY_SLACK_S)
        except (ray.exceptions.RayChannelError, ray.exceptions.RayChannelTimeoutError,
                ray.exceptions.GetTimeoutError) as e:
            self.close()
            self.lost += 1
            raise ExchangeLost(first_line(e)) from e
        self.exchanges += 1
        if kind == "ok":
            return decode_signals(body)     # WireError: the call went through, its signals are lost
        if kind == "refused":
            raise FramesRefused(body)
        raise RuntimeError(f"verifier: {body}")     # transient, as a failed actor call: retried

    def _connect(self, drafter: int) -> None:
        ctx = ray.get_runtime_context()
        node = self.verifier_info().node
        if not node:
            raise VerifierUnavailable("the verifier does not answer its health check")
        try:
            req = _channel(ctx.current_actor, self.verifier, node)
            resp = ray.get(self.verifier.open_channel.remote(drafter, req, ctx.current_actor, ctx.get_node_id()),
                           timeout=30)
            req.ensure_registered_as_writer()
            resp.ensure_registered_as_reader()
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise VerifierUnavailable(first_line(e)) from e
        self._req, self._resp = req, resp

    def close(self) -> None:
        """Drop both channels without closing them: the verifier closes the request channel it
        reads when we reconnect (`ChannelServer.retire`), so closing here too adds nothing."""
        self._req = self._resp = None


def own_buffers(msg: tuple) -> tuple:
    """`msg` with every numpy array of its trees copied out of the channel's buffer."""
    drafter, incarnation, puts, *rest = msg
    owned = [(header, type(frame)(np.array(x) if isinstance(x, np.ndarray) else x for x in frame))
             for header, frame in puts]
    return (drafter, incarnation, owned, *rest)


class ChannelServer:
    """The verifier's side: a reader thread per drafter, each message answered by `serve`
    (a coroutine run on the actor's event loop)."""

    def __init__(self, serve: Callable[[tuple], Awaitable[tuple[str, object]]]) -> None:
        self.serve = serve
        self.open: dict[int, object] = {}        # drafter index -> its request channel (the one we read)
        self.served = 0                          # messages answered

    def connect(self, drafter: int, req, drafter_handle, node: str, loop: asyncio.AbstractEventLoop):
        """Serve `req` from `drafter` (closing its previous channel); returns the reply channel."""
        self.retire(drafter)
        resp = _channel(ray.get_runtime_context().current_actor, drafter_handle, node)
        req.ensure_registered_as_reader()
        resp.ensure_registered_as_writer()
        self.open[drafter] = req
        threading.Thread(target=self._read_loop, args=(drafter, req, resp, loop), daemon=True,
                         name=f"channel-{drafter}").start()
        return resp

    def retire(self, drafter: int) -> None:
        old = self.open.pop(drafter, None)
        if old is not None:
            try:
                old.close()             # ends the reader thread's blocked read
            except Exception:
                pass

    def _read_loop(self, drafter: int, req, resp, loop) -> None:
        while True:
            try:
                msg = own_buffers(_read(req, None))   # no view of the buffer left: the writer may go on
            except Exception as e:      # closed (a reconnect), or the writer's end is gone
                log.info("verifier: channel of drafter %d closed (%s)", drafter, first_line(e))
                return
            reply = asyncio.run_coroutine_threadsafe(self.serve(msg), loop).result()
            try:
                resp.write(reply, timeout=REPLY_SLACK_S)
            except Exception as e:      # the drafter gave up on this pair: it reconnects
                log.info("verifier: reply to drafter %d not taken (%s)", drafter, first_line(e))
                return
            self.served += 1
