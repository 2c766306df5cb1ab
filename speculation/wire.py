"""Wire format between the drafter and verifier actors (DESIGN.md §3, §6).

Two kinds of message cross the actor boundary:

- **Token trees** (drafter -> verifier). A `TreeFrame` is a small msgpack
  *header* (version, stream id, epoch, prefix length, the tokens the drafter
  assumed beyond what it knows to be committed, node count, vocabulary size,
  and the outcome it assumes for this tree, so that both sides agree on when
  to bridge a rollback: drafter/streams.py) plus the tree's *tensors* as numpy
  arrays. The frame is stored with
  `ray.put`; Ray serialises numpy arrays as out-of-band pickle-5 buffers, so
  the tensors sit in the object store and the reader maps them without a copy
  (no pickled Python lists). Only the ObjectRef and a copy of the header go
  through the ring (verifier/ring.py).
- **Signals** (verifier -> drafter): the accept / rollback outcome of one
  verification step, plus the control messages that let sequences join and
  leave a drafter. Pure msgpack: they carry a handful of integers.

Every header has a version field `v`; `decode_*` rejects a frame of another
version, a frame of the wrong kind, and any frame whose header and tensors
disagree, with `WireError`. The actors log a rejected frame and keep running:
the verifier refuses the whole `exchange` call that carried it (before it
changes any state), the drafter drops its streams and asks to be resynced
(docs/internals.md, "Failure handling").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

WIRE_VERSION = 9                 # 2: "reset" (a restarted verifier); 3: a stream's proposer; 4: target features;
#                                  5: a request's grammar in `params` (models.grammar.GrammarSpec as a dict);
#                                  6: the verifier's word on lockstep in every signal; 7: the restart tree's depth;
#                                  8: an unseeded request's `params` keep seed None, the drafter's own in `draft_seed`;
#                                  9: q over a reduced head's columns (`q_columns`, `draft_columns`)
SIGNAL_KINDS = ("step", "join", "leave", "resync", "reset")


class WireError(ValueError):
    """A frame that is malformed or from another wire version."""


# ---------------------------------------------------------------- token trees
@dataclass
class TreeHeader:
    """What the verifier needs to file a tree in the ring without fetching its tensors."""

    stream: str             # sequence (request) id
    epoch: int              # drafter's epoch for the stream; bumped on every rollback
    tree_id: int            # per stream, increasing; the signal names the tree it answers
    prefix_len: int         # length of the prefix the tree was drafted after
    anchor_len: int         # prefix length the drafter knows to be committed
    assumed: list[int]      # prefix[anchor_len:prefix_len]: tokens assumed, not yet confirmed
    num_nodes: int          # T; 0 = plain decoding
    vocab_size: int         # V, the vocabulary draft_probs spans (0 when draft_probs is None)
    outcome: list[int] | None = None   # tokens the drafter assumes this tree commits; None = no guess
    q_columns: int = 0      # V' where draft_probs holds only those tokens' columns (draft_columns); 0: all V

    def __post_init__(self) -> None:
        if self.prefix_len - self.anchor_len != len(self.assumed):
            raise WireError(
                f"tree header: prefix_len {self.prefix_len} - anchor_len {self.anchor_len} "
                f"!= {len(self.assumed)} assumed tokens"
            )


@dataclass
class TreeFrame:
    header: TreeHeader
    token_ids: np.ndarray                   # [T] int64
    parent_ids: np.ndarray                  # [T] int64, -1 = child of the root
    depths: np.ndarray                      # [T] int64, 1 = child of the root
    draft_probs: np.ndarray | None = None   # [T+1, V] float32, row layout of rejection_sample;
    #                                         [T+1, V'] with draft_columns
    draft_columns: np.ndarray | None = None  # [V'] int64 ascending token ids < V (header.q_columns > 0)


_HEADER_FIELDS = ("stream", "epoch", "tree_id", "prefix_len", "anchor_len", "assumed",
                  "num_nodes", "vocab_size", "outcome", "q_columns")


def pack_header(h: TreeHeader) -> bytes:
    body = {name: getattr(h, name) for name in _HEADER_FIELDS}
    return msgpack.packb({"v": WIRE_VERSION, "kind": "tree", **body})


def unpack_header(data: bytes) -> TreeHeader:
    msg = _unpack(data, "tree")
    try:
        fields = {name: msg[name] for name in _HEADER_FIELDS}
    except KeyError as e:
        raise WireError(f"tree header lacks field {e.args[0]!r}") from None
    for name, value in fields.items():
        if name == "stream":
            ok = isinstance(value, str)
        elif name in ("assumed", "outcome"):
            ok = isinstance(value, list) and all(isinstance(t, int) for t in value) or (
                name == "outcome" and value is None)
        else:   # counters and lengths; the epoch may be any int
            ok = isinstance(value, int) and (value >= 0 or name == "epoch")
        if not ok:
            raise WireError(f"tree header field {name!r} has a bad value: {value!r}")
    return TreeHeader(**fields)


def encode_tree(header: TreeHeader, token_ids, parent_ids, depths, draft_probs=None, draft_columns=None) -> tuple:
    """The object to `ray.put`: `(header bytes, token_ids, parent_ids, depths, draft_probs,
    draft_columns)`.

    Accepts torch tensors or numpy arrays; tensors are viewed as numpy (CPU) so
    Ray stores their buffers out of band.
    """
    arrays = [_as_numpy(x, np.int64) for x in (token_ids, parent_ids, depths)]
    probs = None if draft_probs is None else _as_numpy(draft_probs, np.float32)
    columns = None if draft_columns is None else _as_numpy(draft_columns, np.int64)
    frame = TreeFrame(header, *arrays, probs, columns)
    _check_frame(frame)
    return (pack_header(header), *arrays, probs, columns)


def decode_tree(obj: Any) -> TreeFrame:
    """Inverse of `encode_tree` on the object `ray.get` returns; validates everything."""
    if not isinstance(obj, tuple) or len(obj) != 6:
        raise WireError(f"a tree frame is a 6-tuple, got {type(obj).__name__}")
    header = unpack_header(obj[0])
    frame = TreeFrame(header, *obj[1:])
    _check_frame(frame)
    return frame


def tree_to_bytes(frame: tuple) -> list:
    """An `encode_tree` frame as plain msgpack data, for a carrier without Ray's serialisation
    (cluster/exchange_socket.py): [header bytes, token_ids, parent_ids, depths, draft_probs,
    draft_columns], each array its raw bytes (None where absent); the header gives their shapes."""
    header, *arrays = frame
    return [header, *(None if a is None else a.tobytes() for a in arrays)]


def tree_from_bytes(obj: Any) -> tuple:
    """Inverse of `tree_to_bytes`: an `encode_tree` frame (its arrays read-only views of the
    bytes), for `decode_tree` to check; WireError where a size disagrees with the header."""
    if not (isinstance(obj, list) and len(obj) == 6 and all(isinstance(x, bytes) for x in obj[:4])
            and all(x is None or isinstance(x, bytes) for x in obj[4:])):
        raise WireError("a tree frame in bytes is [header, token_ids, parent_ids, depths, draft_probs or None, "
                        "draft_columns or None]")
    header = unpack_header(obj[0])
    t, v = header.num_nodes, header.q_columns or header.vocab_size
    for raw in obj[1:4]:
        if len(raw) != 8 * t:
            raise WireError(f"tree frame: an int64 array of {t} nodes is {8 * t} bytes, got {len(raw)}")
    arrays = [np.frombuffer(raw, dtype=np.int64) for raw in obj[1:4]]
    probs, columns = obj[4], obj[5]
    if probs is not None:
        if len(probs) != 4 * (t + 1) * v:
            raise WireError(f"tree frame: draft_probs [{t + 1}, {v}] float32 is {4 * (t + 1) * v} bytes, "
                            f"got {len(probs)}")
        probs = np.frombuffer(probs, dtype=np.float32).reshape(t + 1, v)
    if columns is not None:
        if len(columns) != 8 * header.q_columns:
            raise WireError(f"tree frame: draft_columns of {header.q_columns} int64 are {8 * header.q_columns} "
                            f"bytes, got {len(columns)}")
        columns = np.frombuffer(columns, dtype=np.int64)
    return (obj[0], *arrays, probs, columns)


def _check_frame(f: TreeFrame) -> None:
    t = f.header.num_nodes
    for name in ("token_ids", "parent_ids", "depths"):
        a = getattr(f, name)
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.shape != (t,):
            raise WireError(f"tree frame: {name} must be int64 of shape ({t},), got {_describe(a)}")
    if t and (f.parent_ids >= np.arange(t)).any():
        raise WireError("tree frame: nodes are not topologically ordered (a parent at or after its child)")
    if t and (f.parent_ids < -1).any():
        raise WireError("tree frame: parent id below -1")
    if t:
        parent_depth = np.where(f.parent_ids < 0, 0, f.depths[np.maximum(f.parent_ids, 0)])
        if (f.depths != parent_depth + 1).any():
            raise WireError("tree frame: depths disagree with parent ids")
    p, columns, reduced = f.draft_probs, f.draft_columns, f.header.q_columns
    if p is None:
        if f.header.vocab_size or reduced or columns is not None:
            raise WireError("tree frame: header names a vocabulary but draft_probs is missing")
        return
    shape = (t + 1, reduced or f.header.vocab_size)
    if not isinstance(p, np.ndarray) or p.dtype != np.float32 or p.shape != shape:
        raise WireError(f"tree frame: draft_probs must be float32 of shape {shape}, got {_describe(p)}")
    if (columns is not None) != bool(reduced):
        raise WireError("tree frame: draft_columns come with the header's q_columns, and only with it")
    if columns is not None:
        if not isinstance(columns, np.ndarray) or columns.dtype != np.int64 or columns.shape != (reduced,):
            raise WireError(f"tree frame: draft_columns must be int64 of shape ({reduced},), got {_describe(columns)}")
        if columns[0] < 0 or columns[-1] >= f.header.vocab_size or (np.diff(columns) <= 0).any():
            raise WireError(f"tree frame: draft_columns must ascend strictly within [0, {f.header.vocab_size})")


def _as_numpy(x, dtype) -> np.ndarray:
    if hasattr(x, "detach"):   # torch tensor: shares memory with the numpy view
        x = x.detach().cpu().contiguous().numpy()
    a = np.ascontiguousarray(x)
    if a.dtype != dtype:
        raise WireError(f"expected {np.dtype(dtype).name}, got {a.dtype.name}")
    return a


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype.name}{list(a.shape)}"
    return type(a).__name__


# ---------------------------------------------------------------- signals
@dataclass
class Signal:
    """Verifier -> drafter. `kind`:

    - "step": one verification step committed `token_ids` (accepted path +
      the corrected / bonus token) for `stream`; `tree_id` names the verified
      tree, or -1 when the verifier decoded alone (no valid tree in the ring).
    - "join": a new stream; `token_ids` is its prompt.
    - "resync": the drafter must (re)start the stream from `token_ids`, the
      whole committed prefix (after a drafter restart or re-assignment).
    - "leave": the stream finished or was aborted; free its draft KV. With prefix caching,
      `token_ids` is its whole committed sequence (else empty): the drafter completes and
      leaves cached the full blocks of it, as the target does, for the next turn.
    - "reset": the verifier does not know this drafter (incarnation): it was
      (re)started and holds none of the drafter's streams; drop them all.
      Sent first to every drafter incarnation that attaches (`stream` is "").

    `prefix_len` is the committed length after the message, `epoch` the
    verifier's view of the stream's epoch, `budget` the (spec_len, tree_width)
    the adaptive controller wants for the next tree ((0, 0) = no speculation).
    """

    kind: str
    stream: str
    epoch: int = 0
    tree_id: int = -1
    prefix_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    budget: tuple[int, int] = (0, 0)
    params: dict | None = None          # join / resync: the request's sampling parameters
    proposer: str | None = None         # join / resync: what drafts the stream ("model" | "ngram")
    # the target's hidden states of committed positions start, start+1, ... ([n, hidden] float32,
    # a torch tensor or numpy array), for a feature-conditioned draft (EAGLE); encoded as raw
    # float32 bytes with their shape, decoded as a numpy array
    features: tuple[int, Any] | None = None
    # step / join / resync: whether the drafter runs in lockstep with this stream as its only one,
    # by the verifier's choice (`verifier.regime`); None: each side's rule (`speculation.policy`)
    lockstep: bool | None = None
    # step: the depth of the restart tree the drafter drafts next after the committed prefix, this
    # step having contradicted its assumed outcome (`speculation.policy.restart_tree_depth`); 0 = the
    # verifier bridges instead (or nothing was contradicted)
    restart: int = 0


def encode_signals(signals: list[Signal]) -> bytes:
    body = [[s.kind, s.stream, s.epoch, s.tree_id, s.prefix_len, s.token_ids, list(s.budget),
             s.params, s.proposer, _pack_features(s.features), s.lockstep, s.restart] for s in signals]
    return msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": body})


def _pack_features(features) -> list | None:
    """(start, [n, hidden] float32) as [start, n, hidden, raw bytes]: a tensor, not a list of floats."""
    if features is None:
        return None
    start, rows = features
    a = _as_numpy(rows.float() if hasattr(rows, "float") else rows, np.float32)
    if a.ndim != 2:
        raise WireError(f"target features must be [n, hidden], got shape {list(a.shape)}")
    return [int(start), int(a.shape[0]), int(a.shape[1]), a.tobytes()]


def _unpack_features(item) -> tuple[int, np.ndarray] | None:
    if item is None:
        return None
    if not (isinstance(item, list) and len(item) == 4 and all(isinstance(v, int) and v >= 0 for v in item[:3])
            and isinstance(item[3], bytes) and len(item[3]) == 4 * item[1] * item[2]):
        raise WireError("malformed target features in a signal")
    start, n, hidden, raw = item
    return start, np.frombuffer(raw, dtype=np.float32).reshape(n, hidden).copy()


def decode_signals(data: bytes) -> list[Signal]:
    msg = _unpack(data, "signals")
    items = msg.get("items")
    if not isinstance(items, list):
        raise WireError("signal frame lacks its item list")
    out = []
    for item in items:
        if not isinstance(item, list) or len(item) != 12:
            raise WireError(f"signal item must have 12 fields, got {item!r}")
        kind, stream, epoch, tree_id, prefix_len, tokens, budget, params, proposer, features, lockstep, restart = item
        if kind not in SIGNAL_KINDS:
            raise WireError(f"unknown signal kind {kind!r}")
        ints = (epoch, tree_id, prefix_len, *budget) if isinstance(budget, list) else None
        if (not isinstance(stream, str) or ints is None or len(budget) != 2
                or not all(isinstance(v, int) for v in ints)
                or not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens)
                or not (params is None or isinstance(params, dict))
                or not (proposer is None or isinstance(proposer, str))
                or not (lockstep is None or isinstance(lockstep, bool))
                or not (isinstance(restart, int) and not isinstance(restart, bool) and restart >= 0)):
            raise WireError(f"malformed signal item {item!r}")
        out.append(Signal(kind, stream, epoch, tree_id, prefix_len, tokens, tuple(budget), params, proposer,
                          _unpack_features(features), lockstep, restart))
    return out


def _unpack(data: bytes, kind: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a {kind} frame must be bytes, got {type(data).__name__}")
    try:
        msg = msgpack.unpackb(data, strict_map_key=True)
    except Exception as e:   # msgpack raises several unrelated types
        raise WireError(f"undecodable {kind} frame: {e}") from None
    if not isinstance(msg, dict):
        raise WireError(f"a {kind} frame must be a map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != WIRE_VERSION:
        raise WireError(f"{kind} frame has wire version {version!r}; this build speaks {WIRE_VERSION}")
    if msg.get("kind") != kind:
        raise WireError(f"expected a {kind} frame, got kind {msg.get('kind')!r}")
    return msg
