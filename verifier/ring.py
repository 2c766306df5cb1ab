"""Bounded ring of in-flight token trees, one per sequence stream (DESIGN.md §3).

The drafter drafts ahead: tree T(n+1) is drafted on the *assumed* outcome of
T(n) and filed here before T(n) is verified. Each entry is the tree's header
(speculation/wire.py: epoch, prefix length, the assumed tokens) plus the tree as
it travelled (in process the tree itself; between Ray actors the ObjectRef of it
in the object store, which the verifier fetches while its target runs).

Where the ring lives. The ring sits inside the verifier's scheduler
(verifier/scheduler.py), whose target forward runs on a model thread while the
event loop keeps serving the drafters' exchanges (puts): a put never waits on the
verifier's forward, and the verifier reads its ring without a remote call on its
critical path. A separate ring actor would add one hop per verification step, and
its death would be one more failure to handle; the cost of our choice is that the
ring dies with the verifier, which is fine because the verifier's KV cache, the
thing the ring feeds, dies with it too.

Backpressure. At most `slots` entries per stream: `put` refuses more. The
drafter keeps its own count of trees in flight per stream (decremented by the
verifier's signals) and never drafts for a stream whose ring is full; when all
its streams are full it blocks in a long-poll for signals (drafter/runtime.py).

Staleness. An entry is *valid* only when its claimed prefix equals the
committed prefix: same length, and the tokens it assumed beyond the drafter's
confirmed anchor equal the committed ones. Everything the drafter confirmed is
committed (it learns it from signals), so this check is exact; the epoch is a
cheap filter on top. Invalid entries at the head are dropped and counted.
Exactness never depends on the drafter's assumption being right.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from speculation.wire import TreeHeader


@dataclass
class RingEntry:
    header: TreeHeader
    payload: Any                      # the tree as it travelled (speculation.transport.TreePut)
    tree: Any = None                  # models.tree.TokenTree, once fetched and decoded
    error: str | None = None          # set when the fetch or the decode failed
    put_time: float = field(default_factory=time.monotonic)


def claims_prefix(header: TreeHeader, committed: list[int]) -> bool:
    """True when the tree was drafted after exactly the committed prefix."""
    if header.prefix_len != len(committed):
        return False
    return committed[header.anchor_len:header.prefix_len] == header.assumed


class StreamRing:
    """The in-flight trees of one stream, oldest first."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"ring_slots must be >= 1, got {slots}")
        self.slots = slots
        self.epoch = 0                       # newest epoch seen; older entries are stale
        self._entries: deque[RingEntry] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.slots

    def put(self, entry: RingEntry) -> tuple[bool, list[RingEntry]]:
        """File an entry. Returns (accepted, entries dropped as stale by its newer epoch)."""
        dropped: list[RingEntry] = []
        if entry.header.epoch < self.epoch:
            return False, [entry]
        if entry.header.epoch > self.epoch:
            self.epoch = entry.header.epoch
            dropped = self.clear()
        if self.full:
            return False, dropped
        self._entries.append(entry)
        return True, dropped

    def head_valid(self, committed: list[int]) -> tuple[RingEntry | None, list[RingEntry]]:
        """Drop stale entries at the head; return (the first valid entry or None, dropped)."""
        dropped = []
        while self._entries:
            head = self._entries[0]
            if head.header.epoch == self.epoch and claims_prefix(head.header, committed) \
                    and head.error is None:
                return head, dropped
            dropped.append(self._entries.popleft())
        return None, dropped

    def pop(self) -> RingEntry:
        return self._entries.popleft()

    def bump(self, epoch: int) -> list[RingEntry]:
        """Move to a newer epoch (drafter restart): every entry is stale."""
        self.epoch = max(self.epoch, epoch)
        return self.clear()

    def clear(self) -> list[RingEntry]:
        dropped = list(self._entries)
        self._entries.clear()
        return dropped

    def entries(self) -> list[RingEntry]:
        return list(self._entries)


class Ring:
    """The rings of all streams of one verifier."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._streams: dict[str, StreamRing] = {}

    def __contains__(self, stream: str) -> bool:
        return stream in self._streams

    def add_stream(self, stream: str, slots: int | None = None) -> None:
        if stream in self._streams:
            raise ValueError(f"stream {stream!r} already has a ring")
        self._streams[stream] = StreamRing(slots or self.slots)

    def remove_stream(self, stream: str) -> list[RingEntry]:
        """Forget the stream; returns the entries it still held (their slots are freed)."""
        ring = self._streams.pop(stream, None)
        return ring.clear() if ring else []

    def stream(self, stream: str) -> StreamRing:
        return self._streams[stream]

    def put(self, entry: RingEntry) -> tuple[bool, list[RingEntry]]:
        ring = self._streams.get(entry.header.stream)
        if ring is None:            # the stream left (finished / aborted) meanwhile
            return False, [entry]
        return ring.put(entry)

    def occupancy(self) -> dict[str, int]:
        return {s: len(r) for s, r in self._streams.items()}

    def total(self) -> int:
        return sum(len(r) for r in self._streams.values())

    def capacity(self) -> int:
        return sum(r.slots for r in self._streams.values())
