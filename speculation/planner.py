"""Adaptive speculation: how many draft tokens each sequence gets next step.

Leviathan et al. 2023 (§3.3, Eq. 3.2 here as in DESIGN §8): with per-token
acceptance γ a tree of depth K commits on average
    E(γ, K) = (1 - γ^(K+1)) / (1 - γ)
tokens per verification. In the asynchronous pipeline drafting overlaps
verification, so one step of a batch costs
    T(k) = max(verify(rows), draft(max_i k_i)) + w,   rows = Σ_i (1 + k_i · W_i)
(the verifier's target forward over all trees, or the drafter's K levels when
it is the slower side; w the measured wait for trees per speculating step, 0 when
every k_i is 0: trees late after a contradicted outcome, or after a switch from
decoding alone, whose tokens the drafter then catches up on). In the synchronous
engine (`overlap=False`) drafting and verification take turns, so
T(k) = verify(rows) + draft(max_i k_i) instead.
We choose the budgets k_i that maximise the batch's committed tokens per
second  R(k) = Σ_i E(γ_i, k_i) / (T(k) + c)  by greedy ascent from k = 0 (each move
adds one level to the sequence that raises R most; stop when none does); c is the
measured cost of the prompt chunk each step carries while a chunked prefill is under way
(`chunk_s`, 0 otherwise: a fixed cost per step, which deeper trees amortise). Consequences, all wanted by the issue:

- a sequence whose γ is low gains γ^(k+1) per level and stays at 0 (off);
- under heavy load the per-row cost dominates the fixed cost of a forward and
  the whole batch goes off, because plain decoding then wins;
- costs are measured, not assumed: `CostModel` fits verify time as
  a + b · rows and draft time per level from the actors' own timings.

A plan must beat plain decoding by `margin` (5 %) in predicted tokens per
second, owed in proportion to the share of the batch that speculates, or the
batch decodes alone: the cost model is an estimate, and on a shared machine a
busy drafter also slows the target (memory bandwidth), so gains of a percent
or two are noise that speculation's overheads eat. A sequence held at 0 is
probed with a short tree after `probe_every` steps so its γ can recover; each
probe that leaves it at 0 doubles its wait for the next one (up to 8×), so a
draft that keeps missing costs ever fewer wasted trees. A probe is judged on its
own tree's outcome, which the pipeline verifies a step or two after the plan that
asked for it (the plans between wait for it, `PROBE_PATIENCE` at most); a probe
accepted whole that has not yet won the sequence back is followed by another at
once, since one tree moves the γ prior only part way. A probe is only sent
when it could win: if the plan would keep the sequence at 0 even were its γ
`probe_gamma` (0.9), as in a batch so large that extra rows cost more than any
draft could return, the probe is skipped (no tree drafted, no rows verified)
and the sequence waits for the next one. The cost model learns its slope from
the batch shapes it sees (bridge and fallback steps are plain ones); while it
has seen only one, it assumes b = `slope_ratio` · a rather than a free slope.
Requests that fix their mode ("chain" / "tree" / "off") bypass the optimiser.
On a CPU target a forward of more rows than its few-row kernel takes costs ~30 %
more at once, which a linear model cannot see: `row_limit` keeps every plan
within it unless decoding alone already exceeds it.

Two facts of the asynchronous pipeline enter the plan (`overlap=True`):

- a tree whose outcome contradicts what the drafter assumed (all of it
  accepted plus its guess of the bonus token, probability ≈ γ^(k+1)) is
  followed by a bridge step in which the sequence decodes alone (DESIGN §3).
  With m = 1 - γ^(k+1), a sequence at depth k commits (E + m) / (1 + m) tokens
  and adds k·W / (1 + m) rows per step on average. With restart trees
  (`restart_depth` s) the step after a contradiction verifies a chain of
  s' = min(s, k) instead: (E + m·E_s') / (1 + m) tokens and
  (1 + k·W + m·(1 + s')) / (1 + m) rows, the wait for it in the measured costs;
- a step in which every sequence decodes alone may run on idle drafters'
  cores (verifier/scheduler.py): its measured cost, `plain_step_s`, is the
  baseline a plan must beat, not the verifier's own-thread step.

In lockstep (one tree in flight: `ring_slots` 1, a drafter on the verifier's GPU, a
lone stream beside a CPU drafter; `verifier.scheduler.Scheduler.plan_overlap`) the pipeline takes
turns like the synchronous engine: `overlap` and `bridges` are off, and the draft
cost per level is the verifier's measured wait for the trees.

A new sequence starts from the acceptance its drafter has been earning: its γ
prior (worth `prior_weight` levels) is the pooled γ of recent verifications
across the sequences of the same proposer (a draft model's, an EAGLE head's and
prompt lookup's acceptances have nothing to say of each other), or 0.6 before
there are any. A draft far from the target
thus does not pay a round of rejected trees at the start of every request, and
the probe back-off is pooled the same way: a new sequence waits as long as the
latest failed probe's (until any sequence speculates again), counted from where
the last finished sequence's clock stood, not from 0: with requests shorter than
the wait, a clock that restarted with each one never reached a probe, the pooled γ
never moved, and the pipeline stopped speculating for good after a few requests
whose draft missed (bench/e2e.py: 6 of its runs in 22 on this CPU, 2026-12-06).
"""
from __future__ import annotations

from dataclasses import dataclass

from speculation.cost_model import CostModel


def expected_tokens(gamma: float, k: int) -> float:
    """Eq. 3.2: E[committed tokens per step] for depth k and acceptance gamma."""
    if k <= 0:
        return 1.0
    if gamma >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - gamma ** (k + 1)) / (1.0 - gamma)


def verify_rows(spec_len: int, width: int = 1) -> list[int]:
    """Rows per sequence of every verification forward a plan can cause, the shape set CUDA
    graphs are captured for at start-up (`verifier.target.TargetSide.warm_up`): the root plus
    a tree of up to `spec_len` levels of `width` (`_per_step`: 1 + k · W rows for the budget
    k ≤ K the plan picks; EAGLE-2 trees are cut to any node count within it, so every size
    up to 1 + K · W). A plain, bridge or fallback step is 1 row, a restart chain 1 + s ≤ 1 + K."""
    return list(range(1, 2 + spec_len * width))


def draft_rows(spec_len: int, width: int = 1, bridge_depth: int = 0) -> list[int]:
    """Rows per sequence of every draft forward a plan's trees cost (`drafter.draft_side.
    DraftSide.warm_up`): a drafter drafts one level past the budget (its bonus guess) and
    `bridge_depth` more ahead of a bridge step; its catch-up re-feeds up to that many accepted
    tokens and the root (an EAGLE head re-feeds every accepted token), and a level's frontier
    (with uncached ancestors) is at most that many nodes of `width`."""
    return list(range(1, 2 + (spec_len + 1 + bridge_depth) * width))


def warm_up_prompt_len(cache, prompt_len: int, extra: int, max_context: int | None = None) -> int:
    """The dummy prompt a warm-up runs (`verifier.target.TargetSide.warm_up`, `drafter.draft_side.
    DraftSide.warm_up`): `prompt_len` tokens, fewer where the free blocks of `cache` (or
    `max_context` positions) cannot hold them plus the `extra` tokens its trees or drafts add
    behind them; 0 (skip the dummy) where not even 2 tokens fit, a prompt of one token
    feeding nothing to warm."""
    room = cache.num_free_blocks * cache.block_size
    if max_context is not None:
        room = min(room, max_context)
    n = min(prompt_len, room - extra)
    return n if n >= 2 else 0


@dataclass
class SeqState:
    mode: str            # "auto" | "chain" | "tree" | "off"
    max_len: int         # K ceiling (request's spec_len or the server default)
    width: int           # tree width W (1 = chain)
    attempts: float = 2.0   # EMA counts of per-level attempts / accepts (the prior γ, see `add`)
    accepts: float = 1.2
    off_steps: int = 0      # steps decoded alone since its last tree (a new sequence: its proposer's)
    probe_gap: int = 0      # steps at 0 before the next probe (0 = the controller's probe_every)
    probed: bool = False    # a probe was planned and awaits its verdict
    probe_waits: int = 0    # plans since, its tree not yet verified (the pipeline verifies it a step or two on)
    probe_full: bool | None = None   # the probe's tree was accepted whole (None: not verified yet)
    proposer: str = "model"  # whose pool its γ and probe back-off go to (`AdaptiveSpeculation.add`)

    @property
    def gamma(self) -> float:
        return self.accepts / self.attempts if self.attempts > 0 else 0.0


# plans a probe's verdict waits for its tree to be verified (`AdaptiveSpeculation._judge_probe`)
PROBE_PATIENCE = 2


class AdaptiveSpeculation:
    """Per-sequence budgets for the next tree, from running acceptance and costs."""

    def __init__(self, max_spec_len: int = 8, probe_every: int = 16, decay: float = 0.9,
                 overlap: bool = True, margin: float = 1.05, probe_gamma: float = 0.9,
                 prior_weight: float = 2.0, pool_decay: float = 0.98) -> None:
        self.max_spec_len = max_spec_len
        self.prior_weight = prior_weight
        self.pool_decay = pool_decay
        self._pool: dict[str, list[float]] = {}   # proposer -> EMA of per-level attempts / accepts
        self._pool_gap: dict[str, int] = {}       # proposer -> probe wait a new sequence starts with
        self._pool_off: dict[str, int] = {}       # proposer -> steps alone a new sequence starts with
        self.probe_every = probe_every
        self.probe_gamma = probe_gamma
        self.margin = margin
        self.decay = decay
        self.costs = CostModel(overlap=overlap)
        # the asynchronous pipeline bridges after a contradicted outcome; in lockstep (one tree
        # in flight, nothing assumed past it) it never does
        self.bridges = True
        # with restart_depth s > 0 (`speculation.settings`) a contradicted outcome is followed by a
        # restart tree of depth min(s, k) instead of a bridge step
        self.restart_depth = 0
        self.seqs: dict[str, SeqState] = {}
        # rows per forward beyond which the step costs jump (the CPU's few-row kernel,
        # `models.linear.few_row_limit`): plans stay within it unless decoding alone
        # already exceeds it. None = no such limit.
        self.row_limit: int | None = None
        # seconds each step of the plan also spends on a prompt's chunk while a chunked prefill
        # is under way (`verifier.chunking`): a fixed cost per step, which deeper trees amortise
        self.chunk_s = 0.0

    def add(self, stream: str, mode: str, spec_len: int, width: int, proposer: str = "model") -> None:
        width = 1 if mode == "chain" else max(1, width)
        w = self.prior_weight
        self.seqs[stream] = SeqState(mode, min(spec_len, self.max_spec_len), width,
                                     attempts=w, accepts=w * self.prior_gamma(proposer),
                                     off_steps=self._pool_off.get(proposer, 0),
                                     probe_gap=self._pool_gap.get(proposer, 0), proposer=proposer)

    def prior_gamma(self, proposer: str = "model") -> float:
        """The γ a new sequence of `proposer` starts from: pooled over its recent verifications,
        else 0.6."""
        attempts, accepts = self._pool.get(proposer, (0.0, 0.0))
        return accepts / attempts if attempts >= 4.0 else 0.6

    def remove(self, stream: str) -> None:
        st = self.seqs.pop(stream, None)
        if st is not None and st.mode == "auto":     # the proposer's probe clock runs on
            self._pool_off[st.proposer] = st.off_steps

    def report(self) -> dict:
        """What new sequences start from, per proposer: the pooled γ and probe back-off."""
        return {"pool_gamma": {p: self.prior_gamma(p) for p in self._pool},
                "pool_probe_gap": dict(self._pool_gap)}

    def observe(self, stream: str, max_depth: int, accepted_depth: int) -> None:
        """A tree of depth `max_depth` was verified; the accepted path reached `accepted_depth`."""
        st = self.seqs.get(stream)
        if st is None or max_depth == 0:
            return
        if st.probed and st.probe_full is None:
            st.probe_full = accepted_depth >= max_depth
        tries = min(accepted_depth + 1, max_depth)
        st.attempts = st.attempts * self.decay + tries
        st.accepts = st.accepts * self.decay + accepted_depth
        d = self.pool_decay
        attempts, accepts = self._pool.get(st.proposer, (0.0, 0.0))
        self._pool[st.proposer] = [attempts * d + tries, accepts * d + accepted_depth]

    def plan(self, streams: list[str], drafter_ok: bool = True, plain_step_s: float | None = None,
             alone: int = 0, caps: dict[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """(spec_len, tree_width) for each stream's next tree; (0, 0) = decode alone.
        `plain_step_s`: what a step of this batch costs when every sequence decodes
        alone, measured where such steps run apart (borrowed cores, a GPU's one-row kernel); None =
        the model's price. It is the baseline then, not the model's: a model fitted from tree steps
        alone only extrapolates one row (from 3- and 4-row lockstep steps, 5.7 ms against 10.8 ms
        measured on borrowed cores, and nothing speculated again: bench/e2e.py, 2026-12-06).
        `alone`: sequences outside `streams` in the same forward, each decoding alone (one row,
        one token a step). `caps`: this step's depth ceiling of some streams, below their own."""
        out, auto = self._fixed_budgets(streams, drafter_ok)
        if auto:
            fixed_rows = alone + sum(1 + k * w for k, w in out.values())
            fixed_levels = max((k for k, _ in out.values()), default=0)
            ks = self._optimise(auto, fixed_rows, fixed_levels, plain_step_s=plain_step_s, alone=alone,
                                caps=caps)
            for i, (s, k) in enumerate(zip(auto, ks)):
                st = self.seqs[s]
                if k == 0:
                    st.off_steps += 1
                    if st.probed:
                        self._judge_probe(st)
                    if not st.probed and st.off_steps >= self._probe_wait(st):
                        st.off_steps = 0      # refresh a stale γ
                        if self._optimise(auto, fixed_rows, fixed_levels, {i: self.probe_gamma},
                                          plain_step_s, alone, caps)[i]:
                            k, st.probed = min(2, st.max_len, (caps or {}).get(s, st.max_len)), True
                            st.probe_waits, st.probe_full = 0, None
                else:
                    st.off_steps, st.probe_gap, st.probed = 0, 0, False
                    self._pool_gap[st.proposer] = 0   # speculation pays again somewhere: probe as usual
                out[s] = (k, st.width) if k else (0, 0)
        return out

    def _judge_probe(self, st: SeqState) -> None:
        """A probe left its sequence at 0 (called by `plan`). Its verdict waits for its tree's
        outcome, `PROBE_PATIENCE` plans at most (the pipeline verifies a tree a step or two after
        the plan that asked for it). A tree accepted whole calls for the next probe at once (one
        tree of 2 moves a γ prior of `prior_weight` levels only part way); any other outcome, or
        none in time, doubles the wait (up to 8 × `probe_every`), for new sequences of the same
        proposer too."""
        if st.probe_full is None and st.probe_waits < PROBE_PATIENCE:
            st.probe_waits += 1
            return
        st.probed = False
        if st.probe_full:
            st.off_steps = self._probe_wait(st)
            return
        st.probe_gap = min(2 * self._probe_wait(st), 8 * self.probe_every)
        self._pool_gap[st.proposer] = max(self._pool_gap.get(st.proposer, 0), st.probe_gap)

    def _probe_wait(self, st: SeqState) -> int:
        """Steps at 0 before the sequence's next probe: its back-off, else `probe_every`."""
        return st.probe_gap or self.probe_every

    def _fixed_budgets(self, streams: list[str], drafter_ok: bool = True
                       ) -> tuple[dict[str, tuple[int, int]], list[str]]:
        """The budgets a stream's mode fixes ("off", or without a drafter: (0, 0); "chain" /
        "tree": its K and W), and the "auto" streams left to the optimiser."""
        out: dict[str, tuple[int, int]] = {}
        auto = []
        for s in streams:
            st = self.seqs[s]
            if st.mode == "off" or not drafter_ok:
                out[s] = (0, 0)
            elif st.mode in ("chain", "tree"):
                out[s] = (st.max_len, st.width)
            else:
                auto.append(s)
        return out, auto

    def plan_joining(self, streams: list[str], beside: list[tuple[int, int]],
                     plain_step_s: float | None = None) -> dict[str, tuple[int, int]]:
        """Budgets for new streams joining a batch whose running streams hold the budgets
        `beside` ((k, W) each): planned with them (their rows, one token each), not as if
        alone, so a stream joining a large batch does not start a tree that the batch's
        plan would never allow. No probe bookkeeping (a what-if: `started` records the
        outcome)."""
        out, auto = self._fixed_budgets(streams)
        if auto:
            fixed = beside + list(out.values())
            rows = sum(1 + k * w for k, w in fixed)
            levels = max((k for k, _ in fixed), default=0)
            ks = self._optimise(auto, rows, levels, plain_step_s=plain_step_s, alone=len(fixed))
            out.update({s: (k, self.seqs[s].width) if k else (0, 0) for s, k in zip(auto, ks)})
        return out

    def started(self, stream: str, depth: int) -> None:
        """The stream's first step ran at `depth` (`plan_joining`'s choice): at 0 it is its first
        step off, which the probe clock counts like any other."""
        st = self.seqs.get(stream)
        if st is not None and st.mode == "auto" and depth == 0:
            st.off_steps += 1

    def _per_step(self, gamma: float, k: int, width: int) -> tuple[float, float]:
        """(committed tokens, verified rows) per step of a sequence at depth k, on average."""
        if k <= 0:
            return 1.0, 1.0
        e = expected_tokens(gamma, k)
        if not self.costs.overlap or not self.bridges:
            return e, 1.0 + k * width
        m = 1.0 - min(gamma, 1.0) ** (k + 1)    # the outcome contradicts the drafter: a bridge step
        restart = min(self.restart_depth, k)
        if restart:       # ... or a restart tree (the wait for it lands in the measured step costs)
            return (e + m * expected_tokens(gamma, restart)) / (1.0 + m), \
                (1.0 + k * width + m * (1.0 + restart)) / (1.0 + m)
        return (e + m) / (1.0 + m), 1.0 + k * width / (1.0 + m)

    def _optimise(self, streams: list[str], fixed_rows: int, fixed_levels: int,
                  gammas: dict[int, float] | None = None, plain_step_s: float | None = None,
                  alone: int = 0, caps: dict[str, int] | None = None) -> list[int]:
        """Greedy ascent on R(k) = Σ tokens_i(k_i) / T(k); O(1) per candidate move. `gammas`
        overrides the γ of the streams at those indices (a what-if for probes). The plan
        found must beat decoding alone, at the model's cost or `plain_step_s`, by `margin`.
        `alone` sequences of the batch commit one token a step whatever the plan; `caps`
        lowers some streams' depth ceilings for this plan."""
        states = [self.seqs[s] for s in streams]
        ceiling = [min(st.max_len, (caps or {}).get(s, st.max_len)) for s, st in zip(streams, states)]
        gamma = [st.gamma for st in states]
        for i, g in (gammas or {}).items():
            gamma[i] = g
        ks = [0] * len(states)
        tokens = [1.0] * len(states)
        rows_of = [1.0] * len(states)
        total, rows, levels = float(len(states) + alone), float(fixed_rows + len(states)), fixed_levels
        peak = rows                                  # rows of the step itself (no bridge averaging)
        limit = max(self.row_limit, peak) if self.row_limit else None
        rate = base = total / (self.costs.step_time(rows, levels) + self.chunk_s)
        if plain_step_s and fixed_levels == 0:      # no fixed-mode stream drafts either: decoding alone
            base = total / (plain_step_s + self.chunk_s)   # runs as measured there, whatever the model says,
            rate = min(rate, base)                  # and the ascent starts from the lower of the two
        while True:
            best, best_rate, best_step = -1, rate, None
            for i, st in enumerate(states):
                if ks[i] >= ceiling[i] or (limit is not None and peak + st.width > limit):
                    continue
                t, r = self._per_step(gamma[i], ks[i] + 1, st.width)
                new_rate = (total - tokens[i] + t) / (self.costs.step_time(
                    rows - rows_of[i] + r, max(levels, ks[i] + 1)) + self.chunk_s)
                if new_rate > best_rate * 1.001:
                    best, best_rate, best_step = i, new_rate, (t, r)
            if best < 0:
                # the margin is owed by the sequences that speculate, in proportion to their
                # share of the batch: one sequence among 32 need not lift the whole batch 5 %
                share = sum(k > 0 for k in ks) / (len(ks) + alone)
                return ks if rate >= base * (1.0 + (self.margin - 1.0) * share) else [0] * len(ks)
            t, r = best_step
            peak += states[best].width
            ks[best] += 1
            total += t - tokens[best]
            rows += r - rows_of[best]
            tokens[best], rows_of[best] = t, r
            levels = max(levels, ks[best])
            rate = best_rate
