"""The drafter-verifier exchange between Ray actors (`speculation.transport` over actor calls).

`RayLink` is a drafter's `VerifierLink` to a `VerifierActor`: one actor call per exchange,
each tree a `speculation.wire` tree frame (msgpack header + numpy tensors) inside the call's
arguments, the reply one msgpack frame of signals. Ray carries small arguments in the call
itself and moves large ones (a sampled tree's draft distributions) through the object store
on its own, so a tree costs neither a `ray.put` by the drafter nor a fetch by the verifier.
Ray's faults become the link's: a dead or restarting verifier is `VerifierUnavailable`, a
refused frame `FramesRefused`.

On the verifier's side, `unpack_puts` checks and decodes a call's puts before any state
changes (one bad header or frame refuses the whole call with `WireError`). A put may also
carry the ObjectRef of a frame in the object store (the form before frames travelled
inline; `fetch_tree` pulls it while the target runs).

Carriers tried for a cheaper exchange (`bench/cgraph_probe.py`, bench/README.md): a Ray
compiled graph (0.5 ms a round trip against 1.5 ms for an actor call here) wedges an actor
whose graph's compiling process died, and a drafter or verifier restart is routine for this
pipeline; Ray's channels without a graph (0.2 ms) left a channel unreadable after a read timed
out, and closing a live one to reconnect took the local raylet down. The default carrier is a
socket per drafter (`cluster.exchange_socket`), with `RayLink` the fallback.
"""
from __future__ import annotations

import logging
import warnings

import ray

from speculation.transport import Exchange, FramesRefused, TreePut, VerifierInfo, VerifierUnavailable
from speculation.wire import Signal, TreeHeader, WireError, decode_signals, decode_tree, encode_tree, \
    pack_header, unpack_header

log = logging.getLogger("specflash.cluster")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class RayLink:
    """A drafter's link to its verifier actor (a handle, or the (name, namespace) it was created
    under: Ray keeps a handle among a restartable actor's constructor arguments in the object
    store, where a restart may not find it, ray-project/ray#53727)."""

    def __init__(self, verifier) -> None:
        if isinstance(verifier, (tuple, list)):
            verifier = ray.get_actor(verifier[0], namespace=verifier[1])
        self.verifier = verifier

    def exchange(self, call: Exchange) -> list[Signal]:
        puts = [(pack_header(p.header), p.payload) for p in call.puts]
        try:
            reply = ray.get(self.verifier.exchange.remote(*exchange_args(call, puts)))
        except ray.exceptions.RayActorError as e:
            raise VerifierUnavailable(first_line(e)) from e
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, WireError):
                raise FramesRefused(str(cause)) from e
            raise
        return decode_signals(reply)        # WireError: the call went through, its signals are lost

    def close(self) -> None:
        """Nothing to release: each exchange is a call of its own."""

    def put_tree(self, header: TreeHeader, tree) -> TreePut:
        """The tree frame itself: it travels in the exchange's arguments."""
        return TreePut(header, encode_tree(header, tree.token_ids, tree.parent_ids, tree.depths, tree.draft_probs,
                                           tree.draft_columns))

    def verifier_info(self) -> VerifierInfo:
        """The verifier's node, CPUs and GPUs (from its health); empty where it does not answer."""
        try:
            h = ray.get(self.verifier.health.remote(), timeout=10)
        except Exception:
            h = {}
        return VerifierInfo(h.get("node_id") or "", float(h.get("cpus") or 0.0), h.get("gpus"))


def exchange_args(call: Exchange, puts: list) -> list:
    """`call`'s fields in order, as `VerifierActor.exchange` takes them (and an exchange socket's
    message carries them), its puts replaced by `puts`, their form for the carrier."""
    return [call.drafter, call.incarnation, puts, call.wait_s, call.draft_s, call.draft_levels, list(call.resync),
            call.node, call.cpus, call.gpus, call.idle]


def unpack_puts(puts, vocab_size: int) -> list[TreePut]:
    """A drafter's puts as the verifier receives them: (header bytes, tree frame) each, decoded
    and checked at once, the payload the tree itself; or (header bytes, [ObjectRef]) of a frame
    in the object store, fetched later (`fetch_tree`). A malformed one, or one whose q spans
    another vocabulary than the target's `vocab_size`, refuses the whole call (WireError)
    before anything is filed."""
    if not isinstance(puts, (list, tuple)):
        raise WireError(f"puts must be a list, got {type(puts).__name__}")
    out = []
    for put in puts:
        if not (isinstance(put, (list, tuple)) and len(put) == 2 and isinstance(put[1], (list, tuple))):
            raise WireError("a put is (header bytes, tree frame) or (header bytes, [ObjectRef])")
        header = unpack_header(put[0])
        if header.vocab_size not in (0, vocab_size):
            raise WireError(f"tree frame: q over a vocabulary of {header.vocab_size}, the target's is {vocab_size}")
        if len(put[1]) == 1 and isinstance(put[1][0], ray.ObjectRef):
            out.append(TreePut(header, put[1][0]))
            continue
        frame = decode_tree(tuple(put[1]))
        if frame.header != header:
            raise WireError("tree frame header differs from its put")
        out.append(TreePut(header, frame_tree(frame)))
    return out


def frame_tree(frame):
    """A decoded tree frame as a `models.tree.TokenTree` (sharing the frame's buffers)."""
    import torch

    from models.tree import TokenTree

    with warnings.catch_warnings():   # object-store buffers are read-only; nothing writes them
        warnings.simplefilter("ignore", UserWarning)
        probs, columns = (None if a is None else torch.from_numpy(a) for a in (frame.draft_probs, frame.draft_columns))
        return TokenTree(torch.from_numpy(frame.token_ids), torch.from_numpy(frame.parent_ids),
                         torch.from_numpy(frame.depths), probs, frame.header.prefix_len, frame.header.epoch, columns)


async def fetch_tree(entry) -> None:
    """Pull a ring entry's tree from the object store and decode it (or note why not)."""
    try:
        frame = decode_tree(await entry.payload)
        if frame.header != entry.header:
            raise WireError("tree frame header differs from its ring entry")
        entry.tree = frame_tree(frame)
    except WireError as e:
        entry.error = f"WireError: {e}"
    except Exception as e:          # owner died, object lost
        entry.error = f"{type(e).__name__}: {e}"
    entry.payload = None
