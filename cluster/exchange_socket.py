"""The drafter-verifier exchange over a socket (`EngineSettings.exchange` "socket", the default).

An exchange by actor call cost ~4 ms of a lockstep step on this project's 2-core CPU (the step
log, bench/README.md): the call's way into the verifier's Ray loop, the hop to the engine's
loop and back, the reply through Ray. Here a drafter holds one connection to its verifier (a
Unix socket on its node, TCP from elsewhere, as the chunks of cluster/outputs.py travel), and
the verifier answers it on its engine's own loop, where `VerifierActor._exchange` runs anyway:
Ray is not on the exchange's path at all.

- Connecting: the drafter asks the verifier where it listens (`VerifierActor.exchange_address`,
  an actor call, which Ray authenticates) and sends the address's secret as its first frame;
  a connection that does not is closed.
- A frame is a 4-byte length and msgpack (`cluster.outputs.frame`). A message is exactly the
  actor call's arguments (`speculation.transport.Exchange`, positionally), each tree as
  `speculation.wire.tree_to_bytes`; the reply is ["ok", the signals' frame], ["refused", why]
  (a malformed tree: the whole exchange refused before anything is filed) or ["error", why].
- Faults: a verifier that dies closes its sockets with its process. A reply later than the
  exchange's long-poll by `REPLY_SLACK_S` makes the drafter ask, by actor call, whether the
  verifier still lives as the incarnation it connected to (a long forward holds the engine's
  loop, not Ray's): it then waits on; a verifier gone (a node lost without closing its
  connections) or restarted loses the exchange. A lost exchange drops the connection
  (`ExchangeLost`: its trees may have been filed and its signals taken, so the drafter resyncs
  its streams); the next exchange reconnects through the actor call, where a dead verifier shows
  as `VerifierUnavailable`. A drafter that dies closes its end; the verifier's handler ends with
  it. Nothing is shared between connections, so closing one never touches another (the hazard
  that kept Ray's channels opt-in, docs/bench-history.md).
- A drafter that cannot connect (a network that refuses the port between nodes, a verifier
  that gives no address) makes its exchanges by actor call until the verifier is next
  unreachable, then tries again.
Drafters joining, leaving and restarting, and scaling, go through actor calls as before.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import select
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack
import ray

from cluster.outputs import CONNECT_TIMEOUT_S, FRAME, MAX_FRAME, Listener, frame, open_socket, read_frame
from cluster.transport import RayLink, exchange_args, first_line
from speculation.transport import Exchange, ExchangeLost, FramesRefused, VerifierUnavailable
from speculation.wire import Signal, WireError, decode_signals, pack_header, tree_from_bytes, tree_to_bytes

log = logging.getLogger("specflash.cluster")

REPLY_SLACK_S = 5.0         # a reply later than the exchange's long-poll by this much: the verifier is gone
FIELDS = len(dataclasses.fields(Exchange))    # an exchange message: `Exchange`'s fields, in order


@dataclass
class ExchangeAddress:
    """Where a verifier takes its drafters' exchanges (`VerifierActor.exchange_address`)."""

    incarnation: str          # the verifier's; a restarted verifier listens at a new address
    node: str                 # its Ray node id: a drafter there connects to `path`
    path: str                 # its Unix socket
    host: str                 # its node's IP and TCP port, for drafters on other nodes
    port: int
    secret: str               # a connection's first frame


class ExchangeServer(Listener):
    """The verifier's side, on the engine's loop: each connection one drafter's exchanges, in
    order, each answered by `serve` (`VerifierActor._exchange`)."""

    def __init__(self, incarnation: str, node: str, host: str, serve: Callable[..., Awaitable[bytes]]) -> None:
        super().__init__("specflash-ex", incarnation, node, host)
        self.serve = serve
        self.served = 0                       # exchanges answered
        self._writers: set[asyncio.StreamWriter] = set()     # one per open connection

    async def start(self) -> ExchangeAddress:
        """Listen (from the first call on; on the loop running it)."""
        await self.start_listening(self._connection)
        return ExchangeAddress(self.incarnation, self.node, self.path, self.host, self.port, self.secret)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            await self.hello(reader, 1)                   # [the secret]
            writer.write(frame(["ok"]))
            while True:
                reply = await self.answer(msgpack.unpackb(await read_frame(reader)))
                self.served += 1                   # counted before the drafter can have the reply
                writer.write(frame(reply))
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass                                   # the drafter closed its end (a reconnect, its death)
        except (OSError, ValueError, asyncio.TimeoutError, msgpack.UnpackException) as e:
            log.warning("verifier: a drafter's exchange connection ended (%s: %s)", type(e).__name__,
                        first_line(e))
        finally:
            self._writers.discard(writer)
            writer.close()

    async def answer(self, msg) -> list:
        """One message as the `exchange` call it stands for: ["ok", signals], ["refused", why] for a
        malformed tree, ["error", why] otherwise."""
        try:
            if not (isinstance(msg, list) and len(msg) == FIELDS and isinstance(msg[2], list)
                    and all(isinstance(p, list) and len(p) == 2 for p in msg[2])):
                raise WireError(f"an exchange message is a list of {FIELDS} fields, its puts [header, tree] pairs")
            puts = [(header, tree_from_bytes(tree)) for header, tree in msg[2]]
            return ["ok", await self.serve(msg[0], msg[1], puts, *msg[3:])]
        except WireError as e:
            return ["refused", str(e)]
        except Exception as e:
            log.exception("verifier: an exchange of drafter %s failed", msg[0] if isinstance(msg, list) and msg else "?")
            return ["error", f"{type(e).__name__}: {e}"]

    @property
    def connections(self) -> int:
        return len(self._writers)

    def close(self) -> None:
        """Stop listening and close every connection (its drafter's next read ends)."""
        self.stop_listening()
        for w in list(self._writers):
            w.close()


class SocketLink(RayLink):
    """A drafter's link to its verifier over one connection (module docstring); `node`: the
    drafter's Ray node id (a Unix socket to a verifier on it)."""

    def __init__(self, verifier, node: str = "") -> None:
        super().__init__(verifier)
        self.node = node
        self._sock = None
        self._incarnation: str | None = None     # the verifier's, once connected
        self.by_call = False        # the socket could not connect: actor calls until the verifier is next gone
        self.exchanges = 0          # exchanges that went through the socket
        self.lost = 0               # exchanges whose reply never came (a timeout, a closed connection)

    def exchange(self, call: Exchange) -> list[Signal]:
        if self._sock is None and not self.by_call:
            self._connect()
        if self.by_call:
            try:
                return super().exchange(call)
            except VerifierUnavailable:
                self.by_call = False            # a restarted verifier listens anew: try its socket
                raise
        msg = frame(exchange_args(call, [[pack_header(p.header), tree_to_bytes(p.payload)] for p in call.puts]))
        try:
            self._send(msg)
            kind, body = msgpack.unpackb(self._read_frame(call.wait_s + REPLY_SLACK_S))
        except (OSError, ValueError, msgpack.UnpackException) as e:     # a timeout is an OSError
            self.close()
            self.lost += 1
            raise ExchangeLost(first_line(e) or type(e).__name__) from e
        self.exchanges += 1
        if kind == "ok":
            return decode_signals(body)     # WireError: the call went through, its signals are lost
        if kind == "refused":
            raise FramesRefused(body)
        raise RuntimeError(f"verifier: {body}")     # transient, as a failed actor call: retried

    def verifier_alive(self) -> bool:
        """Whether the verifier we connected to still answers (by actor call: its health, from
        Ray's loop, so a long forward does not hold it up) as the same incarnation."""
        try:
            health = ray.get(self.verifier.health.remote(), timeout=2 * REPLY_SLACK_S)
        except Exception:
            return False
        return health.get("incarnation") == self._incarnation

    def address(self) -> ExchangeAddress:
        """Where the verifier listens, by actor call; `VerifierUnavailable` where it is gone."""
        try:
            return ray.get(self.verifier.exchange_address.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise VerifierUnavailable(first_line(e)) from e

    def _connect(self) -> None:
        try:
            a = self.address()
        except VerifierUnavailable:
            raise
        except Exception as e:          # it answers, but not with an address (an older verifier, a proxy)
            self._by_call(first_line(e))
            return
        sock, target = open_socket(self.node, a.node, a.path, a.host, a.port)
        try:
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect(target)
            sock.settimeout(None)              # blocking; `_wait` bounds every wait
            self._sock, self._incarnation = sock, None
            self._send(frame([a.secret]))
            if msgpack.unpackb(self._read_frame(CONNECT_TIMEOUT_S)) != ["ok"]:
                raise ValueError("the verifier did not acknowledge the connection")
            self._incarnation = a.incarnation
        except (OSError, ValueError, msgpack.UnpackException) as e:
            self.close()
            self._by_call(f"verifier {a.incarnation[:8]}: {first_line(e) or type(e).__name__}")

    def _by_call(self, why: str) -> None:
        self.by_call = True
        log.warning("drafter: no exchange socket (%s); exchanging by actor call", why)

    def _wait(self, write: bool, patience: float) -> None:
        """Until the socket can be read (written). Past `patience`, and every `REPLY_SLACK_S` after,
        a connected link asks whether its verifier lives: a busy one (a long forward, a long
        prefill) is waited for, a gone or restarted one is a TimeoutError (the exchange lost)."""
        while True:
            r, w, _ = select.select([] if write else [self._sock], [self._sock] if write else [], [], patience)
            if r or w:
                return
            if self._incarnation is None or not self.verifier_alive():
                raise TimeoutError(f"no {'room' if write else 'reply'} from the verifier in {patience:.1f} s")
            patience = REPLY_SLACK_S

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self._wait(True, REPLY_SLACK_S)
            view = view[self._sock.send(view):]

    def _read_frame(self, patience: float) -> bytes:
        """The next frame; its first byte within `patience` (as `_wait` extends it), the rest as it comes."""
        (size,) = FRAME.unpack(self._recv(FRAME.size, patience))
        if size > MAX_FRAME:
            raise ValueError(f"a frame of {size} bytes is over the limit ({MAX_FRAME})")
        return self._recv(size, REPLY_SLACK_S)

    def _recv(self, n: int, patience: float) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self._wait(False, patience if got == 0 else REPLY_SLACK_S)
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the verifier closed the exchange connection")
            got += k
        return bytes(buf)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
