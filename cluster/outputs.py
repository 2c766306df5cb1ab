"""A request's way between the process that asked for it and its verifier, over a socket
(`EngineSettings.output_socket`): the request in, its chunks out.

Ray streams an actor generator's items one object each: on this project's 2-core CPU each
item cost 0.7-0.8 ms of the consumer's CPU and 0.4-0.5 ms of the actor's beyond an idle pace (a
Ray round trip and the owner's bookkeeping), taken from the cores the models run on; a frame
over a Unix socket ~0.1 ms both sides together (`bench/output_cost.py`, bench/README.md). With
the micro pair that was most of the pipeline's overhead over sync. vLLM's engine core sends its
outputs over ZeroMQ sockets for the same reason.

- The verifier (`OutputServer`, on its engine's own loop: no other thread of its process wakes
  for a request or a chunk) listens on a Unix socket (a consumer on its node) and on TCP (one
  elsewhere). A consumer (`OutputClient`) asks the verifier where by actor call
  (`VerifierActor.output_address`, which Ray authenticates), connects and sends
  [its random token, the address's secret]; a connection that does not is closed.
- A frame is a 4-byte little-endian length and msgpack (`frame`). The consumer sends
  `["submit", request id, prompt, sampling, speculation, prefix_cache]` (a
  `GenerationRequest`'s fields in order, its options as dicts) and `["abort", request id]`;
  on one connection an abort cannot overtake its request. The verifier sends each request's
  chunks (`encode_chunk`), its refusal or failure as an error chunk.
- Faults: a verifier that dies closes its sockets with its process: every request on that
  connection ends at once with the retryable error a dead verifier's Ray stream gives
  (`LOST`); a consumer that goes away closes its connection and the verifier aborts its
  requests; a message the verifier cannot read closes that connection alone. A consumer that
  cannot connect (a network between nodes that refuses the port) keeps Ray's streams.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgpack

from models.sampling import TokenLogprob
from speculation.requests import GenerationChunk, GenerationRequest

log = logging.getLogger("specflash.cluster")

FRAME = struct.Struct("<I")
MAX_FRAME = 256 << 20        # a chunk with prompt log-probabilities of a long prompt fits
HELLO_LIMIT = 1024           # a consumer's first frame: its token
CONNECT_TIMEOUT_S = 5.0
LOST = object()              # a request's queue item: its connection to the verifier closed


@dataclass
class OutputAddress:
    """Where a verifier serves chunks (`VerifierActor.output_address`)."""

    incarnation: str          # the verifier's; a restarted verifier serves at a new address
    node: str                 # its Ray node id: a consumer there uses `path`
    path: str                 # its Unix socket
    host: str                 # its node's IP and TCP port, for consumers on other nodes
    port: int
    secret: str               # a connection's first frame carries it after the consumer's token


def _logprob(lp: TokenLogprob | None):
    return None if lp is None else [lp.token_id, lp.logprob, [list(t) for t in lp.top]]


def _unlogprob(x) -> TokenLogprob | None:
    return None if x is None else TokenLogprob(x[0], x[1], [tuple(t) for t in x[2]])


def frame(obj) -> bytes:
    """`obj` in msgpack, after its length."""
    body = msgpack.packb(obj)
    return FRAME.pack(len(body)) + body


def encode_chunk(c: GenerationChunk) -> bytes:
    """A frame of the chunk's fields in order (log-probabilities as lists)."""
    return frame([c.request_id, c.token_ids, c.finished, c.finish_reason, c.num_drafted, c.num_accepted,
                  c.error, c.cached_tokens, None if c.logprobs is None else [_logprob(x) for x in c.logprobs],
                  None if c.prompt_logprobs is None else [_logprob(x) for x in c.prompt_logprobs]])


def decode_chunk(body: bytes) -> GenerationChunk:
    f = msgpack.unpackb(body)
    return GenerationChunk(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7],
                           None if f[8] is None else [_unlogprob(x) for x in f[8]],
                           None if f[9] is None else [_unlogprob(x) for x in f[9]])


def socket_path(name: str) -> str:
    """Where a server named `name` listens on its node: on Linux an abstract socket, gone with
    its process (Ray ends an actor with SIGKILL, which would leave a file behind); elsewhere a
    file in the temp directory."""
    return "\0" + name if sys.platform == "linux" else os.path.join(tempfile.gettempdir(), name + ".sock")


async def listen(serve, path: str, host: str) -> tuple[list[asyncio.AbstractServer], int]:
    """`serve` (an asyncio connection handler) on the Unix socket `path` and on TCP at `host`,
    a free port; returns the servers and that port. They run on the calling loop."""
    if not path.startswith("\0") and os.path.exists(path):
        os.unlink(path)
    unix = await asyncio.start_unix_server(serve, path=path)
    tcp = await asyncio.start_server(serve, host=host, port=0)
    return [unix, tcp], tcp.sockets[0].getsockname()[1]


def stop_listening(servers: list[asyncio.AbstractServer], path: str) -> None:
    for s in servers:
        s.close()
    if not path.startswith("\0") and os.path.exists(path):
        os.unlink(path)


def open_socket(node: str, server_node: str, path: str, host: str, port: int):
    """A new socket to a server (`listen`) and its address: its Unix socket from a process on
    its node, TCP (no Nagle delay) from elsewhere."""
    if node == server_node:
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), path
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, (host, port)


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    if size > limit:
        raise ValueError(f"a frame of {size} bytes is over the limit ({limit})")
    return await reader.readexactly(size)


class Listener:
    """A verifier's server, on the loop that starts it: a Unix socket (`path`, named for
    `prefix` and the incarnation) and TCP on `host`, and the secret every connection's first
    frame carries (`hello`). `OutputServer` and the exchange's server are this."""

    def __init__(self, prefix: str, incarnation: str, node: str, host: str) -> None:
        self.incarnation, self.node, self.host = incarnation, node, host
        self.path = socket_path(f"{prefix}-{incarnation[:16]}")
        self.secret = secrets.token_hex(16)
        self.port = 0
        self._servers: list[asyncio.AbstractServer] = []
        self._starting = asyncio.Lock()

    async def start_listening(self, serve) -> None:
        """`serve` each connection, listening from the first call on."""
        async with self._starting:            # callers asking at once: one of them starts listening
            if not self._servers:
                self._servers, self.port = await listen(serve, self.path, self.host)

    async def hello(self, reader: asyncio.StreamReader, fields: int) -> list[str]:
        """A connection's first frame: `fields` strings, the last our secret; ValueError (or a
        timeout) otherwise."""
        hello = msgpack.unpackb(await asyncio.wait_for(read_frame(reader, HELLO_LIMIT), CONNECT_TIMEOUT_S))
        if not (isinstance(hello, list) and len(hello) == fields and all(isinstance(x, str) for x in hello)
                and secrets.compare_digest(hello[-1], self.secret)):
            raise ValueError(f"a first frame is {fields} strings, the last the address's secret")
        return hello

    def stop_listening(self) -> None:
        stop_listening(self._servers, self.path)


class OutputServer(Listener):
    """The verifier's side, on the loop that starts it (the engine's). `on_message(token, msg)`:
    a consumer's message (a list, its kind first), handled on that loop; it raises ValueError
    for one it cannot take, which closes that connection. `on_gone(token)`: a consumer's
    connection closed (abort its requests)."""

    def __init__(self, incarnation: str, node: str, host: str, on_message: Callable[[str, list], None],
                 on_gone: Callable[[str], None]) -> None:
        super().__init__("specflash-out", incarnation, node, host)
        self.on_message, self.on_gone = on_message, on_gone
        self.consumers: dict[str, asyncio.StreamWriter] = {}
        self.sent = 0                       # chunks written

    async def start(self) -> OutputAddress:
        await self.start_listening(self._serve)
        return OutputAddress(self.incarnation, self.node, self.path, self.host, self.port, self.secret)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        token = None
        try:
            token = (await self.hello(reader, 2))[0]          # [the consumer's token, the secret]
            self.consumers[token] = writer
            writer.write(frame([token]))             # registered: its requests may follow
            while True:
                try:
                    body = await read_frame(reader)
                except asyncio.IncompleteReadError as e:
                    if e.partial:
                        raise
                    break                          # the consumer closed its end between messages
                message = msgpack.unpackb(body)
                if not (isinstance(message, list) and message and isinstance(message[0], str)):
                    raise ValueError("a consumer's message is a list, its kind first")
                self.on_message(token, message)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                msgpack.UnpackException) as e:
            log.warning("verifier: an output connection ended (%s: %s)", type(e).__name__, e)
        finally:
            if token is not None and self.consumers.get(token) is writer:
                del self.consumers[token]
                self.on_gone(token)
            writer.close()

    async def send(self, token: str, chunk: GenerationChunk) -> bool:
        """Write `chunk` to `token`'s connection; False when it has gone."""
        writer = self.consumers.get(token)
        if writer is None or writer.is_closing():
            return False
        writer.write(encode_chunk(chunk))
        self.sent += 1
        try:
            await writer.drain()            # a consumer that stopped reading holds its requests only
        except (ConnectionError, OSError):
            return False
        return True

    def close(self) -> None:
        self.stop_listening()
        for w in list(self.consumers.values()):
            w.close()


class OutputClient:
    """A consumer's connection to one verifier incarnation, on the event loop that made it:
    chunks go to each request's queue; `LOST` to every open one when the connection closes."""

    def __init__(self, address: OutputAddress) -> None:
        self.address = address
        self.token = secrets.token_hex(16)
        self.queues: dict[str, asyncio.Queue] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.broken = False
        self._sock: socket.socket | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None

    async def connect(self, node: str) -> None:
        """Over the Unix socket when on the verifier's node, else TCP; raises OSError or
        asyncio.TimeoutError when it cannot."""
        a = self.address
        self.loop = asyncio.get_running_loop()
        sock, target = open_socket(node, a.node, a.path, a.host, a.port)
        sock.setblocking(False)
        self._sock = sock
        await asyncio.wait_for(self.loop.sock_connect(sock, target), CONNECT_TIMEOUT_S)
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 20)
        writer.write(frame([self.token, a.secret]))
        await writer.drain()
        self._writer = writer
        ack = msgpack.unpackb(await asyncio.wait_for(read_frame(reader), CONNECT_TIMEOUT_S))
        if ack != [self.token]:
            raise OSError("the verifier did not acknowledge our output connection")
        self._task = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                chunk = decode_chunk(await read_frame(reader))
                q = self.queues.get(chunk.request_id)
                if q is not None:
                    q.put_nowait(chunk)
        except (OSError, ValueError, asyncio.IncompleteReadError, msgpack.UnpackException) as e:
            log.warning("the output connection to verifier %s ended (%s)", self.address.incarnation[:8],
                        type(e).__name__)
        finally:
            self.broken = True
            for q in self.queues.values():
                q.put_nowait(LOST)

    def usable(self) -> bool:
        """Connected, not broken, and on the running loop."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return False
        return not self.broken and self.loop is running and self._task is not None

    def open(self, rid: str) -> asyncio.Queue:
        q = self.queues[rid] = asyncio.Queue()
        if self.broken:
            q.put_nowait(LOST)
        return q

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def submit(self, request: GenerationRequest) -> SocketChunks:
        """Send `request` to the verifier; its chunks, as they come (a connection that breaks
        ends them with `OutputLost`)."""
        rid = request.request_id
        chunks = SocketChunks(self, rid, self.open(rid))
        await self._send(["submit", rid, list(request.prompt_token_ids), asdict(request.sampling),
                          asdict(request.speculation), request.prefix_cache])
        return chunks

    async def abort(self, rid: str) -> None:
        """Abort `rid` (sent after its request on the one connection: it cannot overtake it)."""
        await self._send(["abort", rid])

    async def _send(self, message: list) -> None:
        if self.broken:                       # the requests' queues have their LOST already
            return
        self._writer.write(frame(message))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError):    # the reading task sees the close and says LOST
            pass

    def abandon(self) -> None:
        """Drop the connection (its loop may be closed already: the socket is closed directly)."""
        self.broken = True
        if self._task is not None and self.loop is not None and not self.loop.is_closed():
            self._task.cancel()
            self._writer.close()
        elif self._sock is not None:
            self._sock.close()


class OutputLost(Exception):
    """The output connection closed: the verifier died or restarted, or the connection was
    dropped."""


class SocketChunks:
    """One request's chunks over its consumer's connection, as `cluster.pipeline` reads a Ray
    stream: `next()` gives each chunk, None after the last; raises OutputLost or
    asyncio.TimeoutError."""

    def __init__(self, client: OutputClient, rid: str, queue: asyncio.Queue) -> None:
        self.client, self.rid, self.queue = client, rid, queue
        self.done = False

    async def next(self, timeout: float) -> GenerationChunk | None:
        if self.done:
            return None
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if item is LOST:
            raise OutputLost("the output connection closed")
        self.done = item.finished
        return item

    def close(self) -> None:
        self.client.close(self.rid)
