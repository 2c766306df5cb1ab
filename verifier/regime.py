"""How a lone stream's drafter on a device of its own runs: overlapped or in lockstep, measured.

Overlapped, the drafter drafts the next tree on the outcome it assumes while the target
verifies; a contradicted outcome costs a bridge step (or a restart tree) and the drafting
beside the forward may slow it (two CPU cores share one memory bus). In lockstep the
drafter waits for each signal and drafts from the committed prefix: no rollbacks, no
bridges, the draft's levels on the critical path. Which commits more tokens per second
depends on the acceptance, the devices and the draft's speed, so where the rule would
overlap (`speculation.policy.in_lockstep` says no for one stream), the verifier runs each
way in windows of steps, keeps the one measured faster per committed token
(`verifier.choice.WindowedChoice`) and tells the drafter with every signal
(`Signal.lockstep`). On this project's 2-core CPU, one core per model, lockstep ran 1.49x
the target alone on code and math where overlap ran 1.30x (bench/README.md).
"""
from __future__ import annotations

from verifier.choice import WindowedChoice

OVERLAP, LOCKSTEP = False, True


class RegimeChoice:
    def __init__(self, enabled: bool, window: int = 12, trials: int = 2, recheck: int = 12,
                 settle: int = 2) -> None:
        """`window`, `trials`, `recheck`: `WindowedChoice`'s; `settle`: steps after a switch whose
        waits the cost models leave out (trees drafted the other way may still be in flight:
        `StepKind.settling`)."""
        self.enabled, self.settle = enabled, settle
        self.settling = 0                  # steps left whose waits price neither way
        # the rule's way until a window has run; the waits for trees are a way's cost
        self.windows = WindowedChoice(OVERLAP, window, trials, recheck)
        self.stream: str | None = None     # the lone stream being measured

    @property
    def current(self) -> bool:
        return self.windows.current

    @current.setter
    def current(self, way: bool) -> None:
        self.windows.current = way

    def lockstep(self) -> bool:
        return self.current

    def observe(self, stream: str | None, tokens: int, now: float) -> None:
        """A step ended at `now`, committing `tokens` for `stream`, the lone stream this choice
        applies to (None: it does not apply now; measurement restarts when it does)."""
        self.settling = max(0, self.settling - 1)
        if stream is None or stream != self.stream:
            self.stream = stream
            self.windows.restart(now if stream is not None else None)
            return
        before = self.current
        self.windows.observe(tokens, now, (OVERLAP, LOCKSTEP))
        if self.current != before:
            self.settling = self.settle

    def report(self) -> dict:
        choice = self.windows.choice
        return {"regime": "lockstep" if self.current else "overlap",
                # ms per committed token of each way, measured over windows of steps
                "ms_per_token_by_regime": {("lockstep" if k else "overlap"): 1e3 * choice.cost(k)
                                           for k in choice.samples}}
