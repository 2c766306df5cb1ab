"""The contract between a drafter and its verifier, whatever carries it (DESIGN.md §3).

A drafter's loop makes one `exchange` per iteration: it delivers the trees it drafted and
takes back the signals queued for it. The scheduler (verifier/scheduler.py) never knows how
the call travelled: in process it is a method call (`verifier.link.InProcessLink`), between
Ray actors a message over a socket (`cluster.exchange_socket.SocketLink`, the default) or an
actor call (`cluster.transport.RayLink`; `EngineSettings.exchange`). Trees and signals cross it
as `speculation.wire` objects; a carrier that leaves the process encodes them in their
versioned wire format.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from speculation.wire import Signal, TreeHeader


@dataclass
class TreePut:
    """One drafted tree on its way to the verifier."""

    header: TreeHeader    # what the ring files it by (prefix claimed, outcome assumed)
    payload: Any          # the tree itself: a models.tree.TokenTree in process, a Ray ObjectRef of
                          # speculation.wire.encode_tree(...) between actors


@dataclass
class Exchange:
    """Drafter -> verifier, once per drafter loop iteration."""

    drafter: int                      # the drafter's index among its verifier's drafters
    incarnation: str                  # new on every (re)start: the verifier resyncs a new one
    puts: list[TreePut] = field(default_factory=list)
    wait_s: float = 0.0               # long-poll this long for a signal when none is queued
    draft_s: float = 0.0              # seconds its last draft pass took
    draft_levels: int = 0             # draft forwards (levels) of that pass
    resync: list[str] = field(default_factory=list)   # streams whose state it lost
    node: str = ""                    # its node id ("" = unknown)
    cpus: float = 0.0                 # CPUs it reserved (a plain step may borrow them while it idles)
    gpus: list[str] | None = None     # GPUs it was given (None off a GPU)
    idle: bool | None = None          # nothing left to draft until a signal comes (None: so if no puts)


@dataclass
class VerifierInfo:
    """Where a drafter's verifier runs: what `speculation.policy.in_lockstep` needs of it."""

    node: str = ""
    cpus: float = 0.0
    gpus: list[str] | None = None


class VerifierUnavailable(Exception):
    """The verifier is dead or restarting: whatever it held of this drafter's is gone."""


class FramesRefused(Exception):
    """The verifier refused this call's trees (a malformed or other-version frame)."""


class ExchangeLost(Exception):
    """The call's reply never came (its carrier broke): the trees may have been filed and the
    signals taken, so the drafter resyncs every stream."""


class VerifierLink(Protocol):
    """A drafter's way to its verifier."""

    def exchange(self, call: Exchange) -> list[Signal]:
        """Deliver `call`; the signals queued for the drafter. Raises `VerifierUnavailable`,
        `FramesRefused` or `ExchangeLost`; any other exception is transient."""

    def put_tree(self, header: TreeHeader, tree) -> TreePut:
        """How a drafted `models.tree.TokenTree` travels (kept in process, or put in a store)."""

    def verifier_info(self) -> VerifierInfo:
        """Where the verifier runs (empty where it does not say)."""
