"""A per-step log of an engine's timeline, for finding where a step's time goes.

With `SPECFLASH_STEP_LOG=<path>` in its environment, every engine process appends one JSON
line to that file per verification step (the verifier, `verifier.loop.EngineLoop.step`) and
per exchange (each drafter of a pipeline, `drafter.runtime.Drafter.run_once`); without it
nothing is written. The lines of all processes on a node can share one file (each is one
`write` of a line to a file opened for appending) and sort by `t`, the wall clock when the
record's work ended: read together they show, step by step, how long the verifier waited for
trees, what each forward cost, when each drafter heard a signal and how long it drafted
(bench/README.md, "The few-row kernels": such a log showed a 7-row verification costing 1.5
times a 6-row one on AVX2 panels).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field

ENV = "SPECFLASH_STEP_LOG"


@dataclass
class SequenceStep:
    """One sequence's part of a verification step."""

    seq: str                  # the request id
    nodes: int                # tree nodes verified (0: decoded alone)
    kept: int                 # tokens committed
    tree_id: int | None       # the drafter's tree id (None: not a drafter's tree)
    epoch: int | None         # the tree's epoch (None: not a drafter's tree)
    assumed: bool | None      # drafted on an assumed outcome of the tree before it (overlapped)


@dataclass
class VerifierStep:
    """A verification step, as the verifier ran it."""

    t: float                  # wall clock (s) when the step ended
    idle_s: float             # since the previous verification step without one: waits for trees (and the
    #                           prefills of passes that then found none), as the verifier's idle stats count
    draft_s: float            # in-process drafting before it (0 in a pipeline)
    forward_s: float          # the target's forward
    wall_s: float             # the whole step, admission to publishing
    threads: int              # torch threads of the forward
    lockstep: bool            # a lone stream's regime then (verifier.regime): lockstep, else overlap
    sequences: list[SequenceStep]
    role: str = "verifier"
    pid: int = field(default_factory=os.getpid)


@dataclass
class DrafterExchange:
    """One exchange of a drafter with its verifier, and the drafting after it."""

    t: float                  # wall clock (s) when the drafting after the exchange ended
    drafter: int              # the drafter's index
    exchange_s: float         # the call's wall time (a long-poll included)
    wait_s: float             # the long-poll it asked for (0: trees still to draft)
    delivered: int            # trees the call delivered
    signals: dict[str, int]   # signals it brought, by kind ("step", "join", "leave", ...)
    restarts: int             # step signals asking for a restart chain
    draft_s: float            # the draft pass after it
    levels: int               # draft forwards of that pass
    drafted: int              # trees that pass drafted
    role: str = "drafter"
    pid: int = field(default_factory=os.getpid)


class StepLog:
    """Appends records to the file named by `SPECFLASH_STEP_LOG`; off without one."""

    def __init__(self) -> None:
        self.path = os.environ.get(ENV, "")
        self._lock = threading.Lock()
        self._file = None

    @property
    def on(self) -> bool:
        return bool(self.path)

    def write(self, record: VerifierStep | DrafterExchange) -> None:
        if not self.path:
            return
        line = json.dumps(asdict(record), separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", buffering=1)
            self._file.write(line)

