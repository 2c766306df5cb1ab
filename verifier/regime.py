"""How a lone stream's drafter on a device of its own runs: overlapped or in lockstep, measured.

Overlapped, the drafter drafts the next tree on the outcome it assumes while the target
verifies; a contradicted outcome costs a bridge step (or a restart tree) and the drafting
beside the forward may slow it (two CPU cores share one memory bus). In lockstep the
drafter waits for each signal and drafts from the committed prefix: no rollbacks, no
bridges, the draft's levels on the critical path. Which commits more tokens per second
depends on the acceptance, the devices and the draft's speed, so where the rule would
overlap (`speculation.policy.in_lockstep` says no for one stream), the verifier runs each
way in windows of steps, keeps the one measured faster per committed token
(`verifier.choice.MeasuredChoice`) and tells the drafter with every signal
(`Signal.lockstep`). On this project's 2-core CPU, one core per model, lockstep ran 1.49x
the target alone on code and math where overlap ran 1.30x (bench/README.md).
"""
from __future__ import annotations

from verifier.choice import MeasuredChoice

OVERLAP, LOCKSTEP = False, True


class RegimeChoice:
    def __init__(self, enabled: bool, window: int = 12, trials: int = 2, recheck: int = 12,
                 settle: int = 2) -> None:
        """`window`: steps per measurement (the first step after a switch left out); `trials`,
        `recheck`: `MeasuredChoice`'s; `settle`: steps after a switch whose waits the cost models
        leave out (trees drafted the other way may still be in flight: `StepKind.settling`)."""
        self.enabled, self.window, self.settle = enabled, window, settle
        self.settling = 0                  # steps left whose waits price neither way
        self.choice = MeasuredChoice(trials, recheck)
        self.current = OVERLAP             # the rule's way until a window has run
        self.stream: str | None = None     # the lone stream being measured
        self._last: float | None = None    # when its previous step ended
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        self._skip = True                  # the next step is a switch's first: not measured

    def lockstep(self) -> bool:
        return self.current

    def observe(self, stream: str | None, tokens: int, now: float) -> None:
        """A step ended at `now`, committing `tokens` for `stream`, the lone stream this choice
        applies to (None: it does not apply now; measurement restarts when it does)."""
        self.settling = max(0, self.settling - 1)
        if stream is None or stream != self.stream:
            self.stream, self._last = stream, (now if stream is not None else None)
            self._reset_window()
            return
        seconds, self._last = now - self._last, now
        if self._skip:
            self._skip = False
            return
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        if self._steps >= self.window:
            self.choice.observe(self.current, self._seconds, self._tokens)
            chosen = bool(self.choice.pick((OVERLAP, LOCKSTEP)))
            if chosen != self.current:
                self._skip, self.settling = True, self.settle
            self.current = chosen
            self._steps, self._tokens, self._seconds = 0, 0, 0.0

    def _reset_window(self) -> None:
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        self._skip = True

    def report(self) -> dict:
        return {"regime": "lockstep" if self.current else "overlap",
                # ms per committed token of each way, measured over windows of steps
                "ms_per_token_by_regime": {("lockstep" if k else "overlap"): 1e3 * self.choice.cost(k)
                                           for k in self.choice.samples}}
