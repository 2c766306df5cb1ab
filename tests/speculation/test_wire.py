"""Wire format of trees and signals (speculation/wire.py): round trips and rejected frames."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from speculation.wire import (WIRE_VERSION, Signal, TreeHeader, WireError, decode_signals, decode_tree,
                          encode_signals, encode_tree, pack_header, unpack_header)


def header(**kw) -> TreeHeader:
    base = dict(stream="r1", epoch=3, tree_id=7, prefix_len=12, anchor_len=10, assumed=[5, 9],
                num_nodes=3, vocab_size=0)
    base.update(kw)
    return TreeHeader(**base)


def tree_arrays():
    # root -> 0 -> 1, root -> 2
    return torch.tensor([4, 8, 15]), torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 1])


def test_tree_round_trip_keeps_tensors_as_arrays():
    probs = torch.rand(4, 6)
    frame = encode_tree(header(vocab_size=6), *tree_arrays(), probs)
    assert isinstance(frame[0], bytes)
    assert all(isinstance(a, np.ndarray) for a in frame[1:5]), "tensors travel as buffers, not lists"
    assert frame[5] is None, "no columns: q spans the vocabulary"
    out = decode_tree(frame)
    assert out.header == header(vocab_size=6)
    assert out.token_ids.tolist() == [4, 8, 15] and out.parent_ids.tolist() == [-1, 0, -1]
    np.testing.assert_array_equal(out.draft_probs, probs.numpy())


def test_tree_round_trip_through_ray_object_store(ray_cluster):
    import ray

    frame = encode_tree(header(vocab_size=6), *tree_arrays(), torch.rand(4, 6))
    out = decode_tree(ray.get(ray.put(frame)))
    assert out.depths.tolist() == [1, 2, 1]
    assert not out.draft_probs.flags.writeable, "read back zero-copy from the object store"


def test_empty_tree_is_plain_decoding():
    none = torch.zeros(0, dtype=torch.long)
    out = decode_tree(encode_tree(header(num_nodes=0), none, none, none))
    assert out.header.num_nodes == 0 and out.token_ids.shape == (0,)


def test_version_mismatch_is_rejected_with_a_clear_message():
    frame = list(encode_tree(header(), *tree_arrays()))
    body = msgpack.unpackb(frame[0])
    body["v"] = WIRE_VERSION + 1
    frame[0] = msgpack.packb(body)
    with pytest.raises(WireError, match="wire version"):
        decode_tree(tuple(frame))


@pytest.mark.parametrize("mutate,message", [
    (lambda f: (b"\xc1garbage",) + f[1:], "undecodable"),
    (lambda f: (msgpack.packb([1, 2]),) + f[1:], "must be a map"),
    (lambda f: (f[0], f[1][:2], f[2], f[3], f[4], f[5]), "token_ids"),
    (lambda f: (f[0], f[1].astype(np.int32), f[2], f[3], f[4], f[5]), "int64"),
    (lambda f: (f[0], f[1], np.array([-1, 1, -1]), f[3], f[4], f[5]), "topologically"),
    (lambda f: (f[0], f[1], f[2], np.array([1, 1, 1]), f[4], f[5]), "depths"),
    (lambda f: (f[0], f[1], f[2], f[3], np.zeros((4, 5), np.float32), f[5]), "draft_probs"),
    (lambda f: (f[0], f[1], f[2], f[3], f[4], np.arange(3)), "draft_probs is missing"),
    (lambda f: f[:5], "6-tuple"),
])
def test_malformed_tree_frames_are_rejected(mutate, message):
    frame = encode_tree(header(), *tree_arrays())
    with pytest.raises(WireError, match=message):
        decode_tree(mutate(frame))


def test_q_over_a_reduced_heads_columns_round_trips_through_bytes_and_the_object_store(ray_cluster):
    import ray

    from speculation.wire import tree_from_bytes, tree_to_bytes

    probs, columns = torch.rand(4, 3), torch.tensor([1, 4, 5])
    h = header(vocab_size=6, q_columns=3)
    frame = encode_tree(h, *tree_arrays(), probs, columns)
    for out in (decode_tree(frame), decode_tree(ray.get(ray.put(frame))),
                decode_tree(tree_from_bytes(msgpack.unpackb(msgpack.packb(tree_to_bytes(frame)))))):
        assert out.header == h
        np.testing.assert_array_equal(out.draft_probs, probs.numpy())
        assert out.draft_columns.tolist() == [1, 4, 5]
    with pytest.raises(WireError, match="draft_columns of 3 int64"):
        tree_from_bytes([*tree_to_bytes(frame)[:5], b"\0" * 16])


@pytest.mark.parametrize("columns,message", [
    ([1, 5, 4], "ascend strictly"),
    ([1, 4, 4], "ascend strictly"),
    ([1, 4, 6], "within \\[0, 6\\)"),
    ([-1, 4, 5], "within"),
    ([1, 4], "int64 of shape \\(3,\\)"),
    (None, "only with it"),
])
def test_reduced_columns_that_do_not_name_q_s_columns_are_refused(columns, message):
    h = header(vocab_size=6, q_columns=3)
    cols = None if columns is None else np.array(columns, dtype=np.int64)
    frame = encode_tree(h, *tree_arrays(), torch.rand(4, 3), torch.tensor([0, 1, 2]))[:5] + (cols,)
    with pytest.raises(WireError, match=message):
        decode_tree(frame)
    with pytest.raises(WireError, match="only with it"):     # columns without the header's count
        decode_tree(encode_tree(header(vocab_size=3), *tree_arrays(), torch.rand(4, 3))[:5] + (np.arange(3),))


def test_header_rejects_bad_fields_and_inconsistent_assumption():
    with pytest.raises(WireError, match="assumed"):
        header(prefix_len=13)
    body = msgpack.unpackb(pack_header(header()))
    body["prefix_len"] = -1
    with pytest.raises(WireError, match="prefix_len"):
        unpack_header(msgpack.packb(body))
    del body["stream"]
    with pytest.raises(WireError, match="stream"):
        unpack_header(msgpack.packb(body))
    body = msgpack.unpackb(pack_header(header()))
    body["kind"] = "signals"
    with pytest.raises(WireError, match="expected a tree frame"):
        unpack_header(msgpack.packb(body))


def test_signals_round_trip_and_validation():
    sigs = [Signal("step", "a", 2, 5, 40, [3, 4, 5], (4, 2), lockstep=True),
            Signal("step", "a", 2, 6, 44, [6, 7], (4, 1), lockstep=False, restart=4),
            Signal("resync", "b", 7, -1, 3, [1, 2, 3], (0, 0), {"temperature": 0.0, "seed": 3}, "ngram",
                   lockstep=False),
            Signal("leave", "c")]
    assert decode_signals(encode_signals(sigs)) == sigs
    bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": [["nope", "a", 0, 0, 0, [], [0, 0], None, None, None, None, 0]]})
    with pytest.raises(WireError, match="unknown signal kind"):
        decode_signals(bad)
    bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": [["step", "a", 0, 0, 0, ["x"], [0, 0], None, None, None, None, 0]]})
    with pytest.raises(WireError, match="malformed"):
        decode_signals(bad)
    bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": [["join", "a", 0, 0, 0, [], [0, 0], None, 7, None, None, 0]]})
    with pytest.raises(WireError, match="malformed"):
        decode_signals(bad)
    bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": [["step", "a", 0, 0, 0, [], [0, 0], None, None, None, 1, 0]]})
    with pytest.raises(WireError, match="malformed"):              # the word on lockstep: a bool or nothing
        decode_signals(bad)
    for restart in (-1, "2", None):                                # the restart tree's depth: an int >= 0
        bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals",
                             "items": [["step", "a", 0, 0, 0, [], [0, 0], None, None, None, None, restart]]})
        with pytest.raises(WireError, match="malformed"):
            decode_signals(bad)
    with pytest.raises(WireError, match="wire version"):
        decode_signals(msgpack.packb({"v": 0, "kind": "signals", "items": []}))
    # target features (an EAGLE head's input) cross as raw float32 with their shape
    import numpy as np
    import torch

    feats = torch.randn(3, 5)
    (back,) = decode_signals(encode_signals([Signal("step", "a", 0, 2, 9, [4, 5, 6], (2, 1), features=(6, feats))]))
    assert back.features[0] == 6 and np.array_equal(back.features[1], feats.numpy())
    bad = msgpack.packb({"v": WIRE_VERSION, "kind": "signals",
                         "items": [["step", "a", 0, 0, 0, [], [0, 0], None, None, [0, 2, 2, b"short"], None, 0]]})
    with pytest.raises(WireError, match="features"):
        decode_signals(bad)


def test_reset_signal_round_trips_and_a_frame_of_the_previous_version_is_rejected():
    sigs = [Signal("reset", ""), Signal("resync", "a", 1, -1, 2, [7, 8], (3, 1), {"seed": 4})]
    assert decode_signals(encode_signals(sigs)) == sigs
    old = msgpack.packb({"v": WIRE_VERSION - 1, "kind": "signals", "items": [["reset", "", 0, -1, 0, [], [0, 0],
                                                                                None, None, None, None]]})
    with pytest.raises(WireError, match="wire version"):
        decode_signals(old)
    with pytest.raises(WireError, match="must be bytes"):
        decode_signals(["step"])
    with pytest.raises(WireError, match="12 fields"):
        decode_signals(msgpack.packb({"v": WIRE_VERSION, "kind": "signals", "items": [["reset", ""]]}))
