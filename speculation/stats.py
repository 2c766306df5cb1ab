"""Speculative-decoding metrics, the one stats class of every engine (DESIGN.md §8).

A plain stats dataclass with `observe_*` methods, in the manner of vLLM's
`SpecDecodingStats`; exporters (Prometheus, logs) read `as_dict()` and live in
the serving layer. One instance counts a scheduler's whole work, one each request's
(`GenerationOutput.stats`), one each drafter's; `merge` adds them up. Conventions,
written down once:

- acceptance rate = accepted draft nodes / drafted nodes (trees of zero nodes
  excluded: they drafted nothing);
- mean accepted length = committed tokens per *speculative* verification step,
  **bonus / corrected token included** (so it is >= 1, and 1 before anything
  was drafted; Eq. 3.2's
  E[tokens/step] = (1 - γ^(K+1)) / (1 - γ) is the model for it);
- acceptance per depth d = P(path reaches depth d | it reached d - 1 and the
  tree had a node at depth d), the per-level γ of a chain;
- verifier idle fraction = time the verifier loop waited with work pending
  but no tree ready, over its wall time (the async design drives it to 0);
- drafter tokens wasted = draft nodes of trees dropped as stale (rollback)
  or never verified;
- tokens per second = generated tokens / elapsed seconds (a request's wall time,
  its prefill included).
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAXIMA = ("ring_max", "exchange_s_max", "work_s_max")      # merged by max, not summed (levels, not counts)


@dataclass
class SpecStats:
    num_steps: int = 0                # sequence-steps verified (one sequence, one step)
    num_spec_steps: int = 0           # of those, with a tree of >= 1 node
    num_rejected_steps: int = 0       # of those, where the accepted path stopped short of the tree's depth
    num_drafted: int = 0              # draft nodes verified
    num_accepted: int = 0             # draft nodes accepted (bonus not counted)
    num_committed: int = 0            # tokens committed (accepted + bonus / correction)
    num_batches: int = 0              # target forwards
    depth_attempts: list[int] = field(default_factory=list)    # [D] per depth d+1
    depth_accepts: list[int] = field(default_factory=list)     # [D]
    verifier_busy_s: float = 0.0
    verifier_idle_s: float = 0.0      # waited for a tree while sequences were active
    verifier_wall_s: float = 0.0
    trees_dropped: int = 0            # stale (rollback) or orphaned ring entries
    drafter_tokens_wasted: int = 0    # nodes of those trees
    rollbacks: int = 0                # signals that contradicted the drafter's assumption
    ring_samples: int = 0
    ring_occupancy_sum: float = 0.0   # sum of (entries / capacity) per sample
    ring_max: int = 0
    spec_on_decisions: int = 0
    spec_off_decisions: int = 0
    joins_speculating: int = 0        # sequences given a first tree as they joined (not counted above)
    fallback_steps: int = 0           # sequence-steps decoded alone while speculation was wanted
    drafter_absent_steps: int = 0     # ... because the sequence's drafter was silent (dead, or busy past drafter_timeout_s)
    frames_rejected: int = 0          # malformed / version-mismatched wire frames refused
    borrowed_steps: int = 0           # target forwards run on idle drafters' cores too (CPU)
    lookup_trees: int = 0             # prompt-lookup chains the verifier drafted itself
    lookup_drafted: int = 0           # their nodes (also counted in num_drafted)
    lookup_accepted: int = 0          # of those, accepted (also counted in num_accepted)
    bridge_chains: int = 0            # bridge steps that verified the draft's chain (`bridge_depth`)
    bridge_chain_drafted: int = 0     # their nodes (also counted in num_drafted)
    bridge_chain_accepted: int = 0    # of those, accepted (also counted in num_accepted)
    restarts: int = 0                 # contradicted outcomes answered by a restart tree (`restart_depth`)
    restart_trees: int = 0            # restart trees verified (a restart waited out falls back alone)
    restart_drafted: int = 0          # their nodes (also counted in num_drafted)
    restart_accepted: int = 0         # of those, accepted (also counted in num_accepted)
    # timings (a request's own, or a scheduler's sums)
    num_generated: int = 0            # tokens handed to the caller
    prefill_s: float = 0.0            # target prefill
    draft_s: float = 0.0              # drafting (in process: the step's draft pass; a drafter: its passes)
    verify_s: float = 0.0             # target verification forwards
    elapsed_s: float = 0.0            # wall time of the request, prefill included
    # a drafter's side
    trees_drafted: int = 0            # trees sent to the verifier
    nodes_drafted: int = 0            # their nodes
    exchanges: int = 0                # calls to the verifier
    exchange_s_max: float = 0.0       # the longest of them
    work_s_max: float = 0.0           # longest stretch between two exchanges (the verifier hears nothing)
    verifier_errors: int = 0          # calls that found the verifier dead or restarting
    resets: int = 0                   # "reset" signals (a restarted verifier) obeyed
    # the target's prefix cache (models.PagedKVCache, prefix_caching): prompt tokens its prefills
    # looked up (all but the last of each prompt) and of those, found cached
    prefix_queried: int = 0
    prefix_hits: int = 0

    # -- observers ---------------------------------------------------------------
    def observe_verification(self, num_nodes: int, num_accepted: int, max_depth: int,
                             accepted_depth: int, rejected: bool | None = None) -> None:
        """One sequence's tree verified. `max_depth`: deepest node of the tree;
        `accepted_depth`: depth reached by the accepted path (= num_accepted); `rejected`:
        the walk ended at a rejection, not at a leaf (default: it stopped short of the depth)."""
        self.num_steps += 1
        self.num_committed += num_accepted + 1
        if num_nodes == 0:
            return
        self.num_spec_steps += 1
        self.num_rejected_steps += int(accepted_depth < max_depth if rejected is None else rejected)
        self.num_drafted += num_nodes
        self.num_accepted += num_accepted
        self._grow(max_depth)
        for d in range(min(accepted_depth + 1, max_depth)):
            self.depth_attempts[d] += 1
            if d < accepted_depth:
                self.depth_accepts[d] += 1

    def observe_batch(self, busy_s: float) -> None:
        self.num_batches += 1
        self.verifier_busy_s += busy_s

    def observe_idle(self, idle_s: float) -> None:
        self.verifier_idle_s += idle_s

    def observe_wall(self, wall_s: float) -> None:
        self.verifier_wall_s += wall_s

    def observe_dropped(self, num_trees: int, num_nodes: int) -> None:
        self.trees_dropped += num_trees
        self.drafter_tokens_wasted += num_nodes

    def observe_rollback(self) -> None:
        self.rollbacks += 1

    def observe_ring(self, entries: int, capacity: int) -> None:
        self.ring_samples += 1
        self.ring_occupancy_sum += entries / capacity if capacity else 0.0
        self.ring_max = max(self.ring_max, entries)

    def observe_speculation(self, on: bool) -> None:
        if on:
            self.spec_on_decisions += 1
        else:
            self.spec_off_decisions += 1

    def observe_join(self, speculating: bool) -> None:
        self.joins_speculating += int(speculating)

    def observe_fallback(self) -> None:
        self.fallback_steps += 1

    def observe_drafter_absent(self) -> None:
        self.drafter_absent_steps += 1

    def observe_rejected_frame(self) -> None:
        self.frames_rejected += 1

    def observe_lookup(self, num_nodes: int, num_accepted: int) -> None:
        self.lookup_trees += 1
        self.lookup_drafted += num_nodes
        self.lookup_accepted += num_accepted

    def observe_bridge_chain(self, num_nodes: int, num_accepted: int) -> None:
        self.bridge_chains += 1
        self.bridge_chain_drafted += num_nodes
        self.bridge_chain_accepted += num_accepted

    def observe_restart(self) -> None:
        self.restarts += 1

    def observe_restart_tree(self, num_nodes: int, num_accepted: int) -> None:
        self.restart_trees += 1
        self.restart_drafted += num_nodes
        self.restart_accepted += num_accepted

    def observe_borrowed_step(self) -> None:
        self.borrowed_steps += 1

    def observe_generated(self, n: int) -> None:
        self.num_generated += n

    def observe_time(self, kind: str, seconds: float) -> None:
        """`kind`: "prefill" | "draft" | "verify" | "elapsed"."""
        setattr(self, f"{kind}_s", getattr(self, f"{kind}_s") + seconds)

    def observe_drafted(self, num_nodes: int) -> None:
        """A drafter sent one tree of `num_nodes` nodes."""
        self.trees_drafted += 1
        self.nodes_drafted += num_nodes

    def observe_exchange(self, seconds: float) -> None:
        self.exchanges += 1
        self.exchange_s_max = max(self.exchange_s_max, seconds)

    def observe_work(self, seconds: float) -> None:
        self.work_s_max = max(self.work_s_max, seconds)

    def observe_wasted(self, num_nodes: int) -> None:
        """Draft nodes thrown away without being verified (a drafter's trees in flight at a rollback)."""
        self.drafter_tokens_wasted += num_nodes

    def observe_verifier_error(self) -> None:
        self.verifier_errors += 1

    def observe_reset(self) -> None:
        self.resets += 1

    def observe_prefix_cache(self, queried: int, cached: int) -> None:
        """A prefill looked up `queried` prompt tokens in the prefix cache and found `cached`."""
        self.prefix_queried += queried
        self.prefix_hits += cached

    def _grow(self, depth: int) -> None:
        while len(self.depth_attempts) < depth:
            self.depth_attempts.append(0)
            self.depth_accepts.append(0)

    # -- derived figures ---------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Committed tokens per speculative step, bonus included (1.0 while nothing was drafted:
        each step commits the target's own token)."""
        if not self.num_spec_steps:
            return 1.0
        return (self.num_accepted + self.num_spec_steps) / self.num_spec_steps

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.depth_accepts, self.depth_attempts)]

    @property
    def level_acceptance(self) -> float:
        """Per-level acceptance, the gamma of Eq. 3.2 (Leviathan et al. 2023): of the levels the
        walk tried, the share it passed (maximum likelihood under a constant gamma)."""
        tried = self.num_accepted + self.num_rejected_steps
        return self.num_accepted / tried if tried else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queried if self.prefix_queried else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def verifier_idle_fraction(self) -> float:
        return self.verifier_idle_s / self.verifier_wall_s if self.verifier_wall_s else 0.0

    @property
    def mean_ring_occupancy(self) -> float:
        return self.ring_occupancy_sum / self.ring_samples if self.ring_samples else 0.0

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Sum of two stats (several verifiers); returns a new object."""
        out = SpecStats()
        for name, value in vars(self).items():
            theirs = getattr(other, name)
            if isinstance(value, list):
                n = max(len(value), len(theirs))
                pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
                setattr(out, name, [a + b for a, b in zip(pad(value), pad(theirs))])
            elif name in MAXIMA:
                setattr(out, name, max(value, theirs))
            else:
                setattr(out, name, value + theirs)
        return out

    def as_dict(self) -> dict:
        out = dict(vars(self))
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_len=self.mean_accepted_len,
            acceptance_per_depth=self.acceptance_per_depth,
            verifier_idle_fraction=self.verifier_idle_fraction,
            mean_ring_occupancy=self.mean_ring_occupancy,
            level_acceptance=self.level_acceptance,
            tokens_per_s=self.tokens_per_s,
            prefix_hit_rate=self.prefix_hit_rate,
        )
        return out

    def summary(self) -> dict:
        """The few figures a person reads about one request (`specflash generate --json`)."""
        return {"drafted": self.num_drafted, "accepted": self.num_accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_len": self.mean_accepted_len,
                "tokens_per_s": self.tokens_per_s}

    @classmethod
    def from_dict(cls, d: dict) -> "SpecStats":
        names = cls.__dataclass_fields__
        return cls(**{k: (list(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})
