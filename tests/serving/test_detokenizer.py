"""Incremental detokenization and stop strings (serving/detokenizer.py)."""
from __future__ import annotations

import random

import pytest

from serving.detokenizer import IncrementalDetokenizer, StopStrings
from serving.testing import SAMPLE_TEXT, tiny_byte_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_byte_tokenizer()


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, ids, chunk_sizes):
    detok, pieces, i = IncrementalDetokenizer(tok), [], 0
    for k in chunk_sizes:
        pieces.append(detok.add(ids[i:i + k]))
        i += k
    pieces.append(detok.flush())
    return pieces


def test_split_multibyte_characters_exist(tok):
    # The test below is only meaningful if some tokens carry part of a character.
    partial = [i for i in range(len(tok)) if "\ufffd" in decode(tok, [i])]
    assert len(partial) > 10


@pytest.mark.parametrize("seed", range(20))
def test_pieces_concatenate_to_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = tok.encode(SAMPLE_TEXT)
    if seed % 2:  # random token soup: many invalid byte sequences, special tokens included
        ids = [rng.randrange(len(tok)) for _ in range(80)]
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(rng.randint(1, 4))
    pieces = stream(tok, ids, sizes)
    assert "".join(pieces) == decode(tok, ids)
    # Nothing but the final flush may carry a replacement char for a valid text.
    if seed % 2 == 0:
        assert all("\ufffd" not in p for p in pieces)


def test_incomplete_utf8_is_held_back(tok):
    ids = tok.encode("🙂")
    assert len(ids) >= 2, "the emoji must span several tokens for this test"
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.add(ids[1:]) == "🙂"
    assert detok.flush() == ""


def test_truncated_character_is_flushed_like_decode(tok):
    ids = tok.encode("ab 🙂")[:-1]
    pieces = stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == decode(tok, ids)
    assert pieces[-1].endswith("\ufffd")


def feed_all(stops, parts):
    s = StopStrings(stops)
    out = [s.feed(p) for p in parts]
    out.append(s.flush())
    return out, s.stopped


def test_stop_string_across_chunks_is_cut_and_never_streamed():
    out, stopped = feed_all(["END"], ["abc E", "N", "Dxyz"])
    assert stopped and "".join(out) == "abc "
    assert out[0] == "abc "          # "E" held back: it may start the stop string
    assert "E" not in "".join(out)


def test_partial_match_released_when_it_does_not_complete():
    out, stopped = feed_all(["END"], ["abc EN", "d more"])
    assert not stopped and "".join(out) == "abc ENd more"
    assert out[0] == "abc "


def test_earliest_stop_wins_and_flush_releases_tail():
    out, stopped = feed_all(["yy", "x"], ["a yy b x"])
    assert stopped and "".join(out) == "a "
    out, stopped = feed_all(["STOP"], ["tail ST"])
    assert not stopped and "".join(out) == "tail ST"


def test_stop_at_start_and_no_stops():
    out, stopped = feed_all(["<|im_end|>"], ["<|im_", "end|>after"])
    assert stopped and "".join(out) == ""
    out, stopped = feed_all([], ["a", "b"])
    assert not stopped and out == ["a", "b", ""]
