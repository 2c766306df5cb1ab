"""Adaptive speculation (speculation/planner.py): Eq. 3.2 and measured costs decide the budgets."""
from __future__ import annotations

import pytest

from speculation.cost_model import CostModel
from speculation.planner import AdaptiveSpeculation, expected_tokens


def feed(costs: CostModel, a: float, b: float) -> None:
    for rows in (1, 5, 1, 5, 3, 5, 1, 5) * 4:
        costs.observe_verify(rows, a + b * rows)


def controller(gamma_hits: tuple[int, int], a: float, b: float, d: float = 0.001) -> AdaptiveSpeculation:
    ad = AdaptiveSpeculation(max_spec_len=8)
    ad.add("s", "auto", 8, 1)
    feed(ad.costs, a, b)
    for _ in range(20):                 # converged past the prior (the first two are one-offs)
        ad.costs.observe_draft(1, d)
    accepted, depth = gamma_hits
    for _ in range(40):
        ad.observe("s", depth, accepted)
    return ad


def test_eq_3_2():
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9
    assert expected_tokens(1.0, 3) == 4.0


def test_cost_model_recovers_a_and_b():
    c = CostModel()
    feed(c, 0.09, 0.16)
    a, b = c.coefficients
    assert abs(a - 0.09) < 0.01 and abs(b - 0.16) < 0.01


def test_a_measured_row_count_is_priced_at_its_own_mean_not_the_line():
    """This CPU's panel kernel: 1 to 6 rows in one pass over the weights, 7 in two. The line
    through 1, 4 and 7 rows misprices 4 rows; each measured count keeps its own mean, an
    unmeasured one takes the line, and averaged (fractional) rows interpolate."""
    c = CostModel(one_off=0, overlap=False)
    for _ in range(10):
        for rows, ms in ((1, 9.0), (4, 10.5), (7, 18.0)):
            c.observe_verify(rows, ms / 1e3)
    a, b = c.coefficients
    assert a + 4 * b > 0.012                                 # the line: 4 rows ~19 % dear
    assert c.verify_time(4) == pytest.approx(0.0105) and c.verify_time(1) == pytest.approx(0.009)
    assert c.verify_time(2) == pytest.approx(a + 2 * b)      # never measured: the line
    assert c.verify_time(3.5) == pytest.approx(0.5 * (a + 3 * b) + 0.5 * 0.0105)
    assert c.step_time(4, 3) == pytest.approx(0.0105 + 3 * c.d)
    c2 = CostModel(one_off=0)
    c2.observe_verify(5, 0.02)
    c2.observe_verify(5, 0.02)                                # decayed count < 3: the line still
    assert c2.verify_time(5) == pytest.approx(sum(c2.coefficients[i] * (1, 5)[i] for i in (0, 1)))


def test_first_costs_of_each_shape_are_left_out():
    """A shape's first forward compiles, its second captures a CUDA graph: 40x and 20x
    outliers there must not reach the fit."""
    c = CostModel()
    for rows in (1, 5, 3):
        c.observe_verify(rows, 0.5)          # one-off costs of three new shapes: compile ...
        c.observe_verify(rows, 0.25)         # ... and capture
    assert not c.observed
    feed(c, 0.01, 0.002)
    a, b = c.coefficients
    assert abs(a - 0.01) < 1e-3 and abs(b - 0.002) < 1e-3
    c.observe_draft(4, 2.0)                  # the first two 4-level drafts: skipped
    c.observe_draft(4, 1.0)
    assert c.d == 0.004
    c.observe_draft(4, 0.04)
    assert c.draft_coefficients == (0.0, pytest.approx(0.01))   # one depth seen: all of it per level


def test_speculation_off_when_verifying_more_tokens_costs_too_much():
    # a CPU where a 5-token verification costs 3.5x one token, and gamma ~ 0.35: plain decoding wins
    ad = controller((1, 3), a=0.09, b=0.16)
    assert ad.plan(["s"]) == {"s": (0, 0)}


def test_deep_chains_when_verification_is_nearly_free_and_acceptance_high():
    # a GPU-like memory-bound target: 5 tokens cost ~ 1; gamma ~ 0.9
    ad = controller((9, 10), a=0.03, b=0.0005)
    k, width = ad.plan(["s"])["s"]
    assert k >= 4 and width == 1


def test_fixed_modes_bypass_the_optimiser_and_off_sequences_are_probed():
    ad = AdaptiveSpeculation(probe_every=3)
    ad.add("c", "chain", 5, 4)
    ad.add("o", "off", 5, 1)
    assert ad.plan(["c", "o"]) == {"c": (5, 1), "o": (0, 0)}
    ad2 = controller((0, 4), a=0.09, b=0.16)   # gamma ~ 0: held off ...
    ad2.probe_every = 3
    plans = [ad2.plan(["s"])["s"] for _ in range(3)]
    assert plans[:2] == [(0, 0), (0, 0)] and plans[2][0] > 0   # ... but probed now and then


def test_a_gain_within_the_margin_is_not_worth_speculating():
    # gamma 0.5, a 2-token verification 1.47x one token: K = 1 is predicted to win by ~2% only
    ad = controller((1, 4), a=0.1, b=0.0887)
    assert ad.plan(["s"]) == {"s": (0, 0)}
    ad.margin = 1.0                                   # without the margin it would speculate
    assert ad.plan(["s"]) == {"s": (1, 1)}


def test_probes_that_do_not_win_speculation_back_come_ever_less_often():
    ad = controller((0, 4), a=0.09, b=0.16)           # gamma ~ 0 on a costly verifier: held off
    ad.probe_every = 3
    probes = [i for i in range(40) if ad.plan(["s"])["s"][0] > 0]
    assert probes[:3] == [2, 8, 20]                   # waits of 3, then 6, then 12 steps
    ad.seqs["s"].attempts, ad.seqs["s"].accepts = 10.0, 9.5   # the draft agrees again, verifying is cheap
    ad.costs = CostModel()
    feed(ad.costs, 0.03, 0.0005)
    plans = [ad.plan(["s"])["s"][0] for _ in range(30)]
    assert any(plans) and ad.seqs["s"].probe_gap == 0 and ad.plan(["s"])["s"][0] > 0   # back to the normal rhythm


def _held_off(names: list[str], a: float, b: float) -> AdaptiveSpeculation:
    ad = AdaptiveSpeculation(probe_every=3)
    for n in names:
        ad.add(n, "auto", 4, 1)
        for _ in range(40):
            ad.observe(n, 4, 0)                       # gamma ~ 0: every sequence held off
    feed(ad.costs, a, b)
    return ad


def test_no_probes_where_even_a_good_draft_could_not_pay():
    # a CPU-like verifier, 16 ms per extra row: in a batch of 4, a recovered draft (gamma 0.8)
    # would pay, so held-off sequences are probed; in a batch of 32 it would not, so none is
    small = _held_off([f"s{i}" for i in range(4)], a=0.09, b=0.016)
    assert any(k for _ in range(10) for k, _ in small.plan(list(small.seqs)).values())
    big = _held_off([f"s{i}" for i in range(32)], a=0.09, b=0.016)
    plans = [big.plan(list(big.seqs)) for _ in range(100)]
    assert all(k == 0 for plan in plans for k, _ in plan.values())
    assert all(st.probe_gap == 0 for st in big.seqs.values())    # skipped, not failed: no back-off
    # the same batch with cheap rows (a GPU-like verifier) is probed again
    big.costs = CostModel()
    feed(big.costs, 0.03, 0.0002)
    assert any(k for _ in range(10) for k, _ in big.plan(list(big.seqs)).values())


def test_a_new_sequence_starts_from_the_acceptance_the_drafter_has_been_earning():
    ad = AdaptiveSpeculation(max_spec_len=4)
    feed(ad.costs, 0.09, 0.016)                       # CPU-like: a 0.6 draft pays, a useless one does not
    ad.add("first", "auto", 4, 1)
    assert ad.prior_gamma() == 0.6 and ad.plan(["first"])["first"][0] > 0   # nothing known yet: optimistic
    for _ in range(30):
        ad.observe("first", 3, 0)                     # every tree rejected at its first node
    ad.remove("first")
    ad.add("next", "auto", 4, 1)
    assert ad.prior_gamma() < 0.05 and ad.plan(["next"]) == {"next": (0, 0)}   # starts off, no wasted trees
    for _ in range(60):
        ad.observe("next", 3, 3)                      # (its probes) now accepted in full
    ad.add("third", "auto", 4, 1)
    assert ad.prior_gamma() > 0.7 and ad.plan(["third"])["third"][0] >= 2


def test_each_proposer_earns_its_own_prior_and_probe_back_off():
    """Prompt lookup failing on one engine says nothing of its draft model: a model sequence
    after many failed lookup chains (and their probes backing off) starts from the model's own
    pool, which knows nothing yet (0.6), and speculates at once."""
    ad = AdaptiveSpeculation(max_spec_len=4)
    feed(ad.costs, 0.09, 0.016)
    ad.add("lookup", "auto", 4, 1, proposer="ngram")
    for _ in range(40):
        ad.observe("lookup", 3, 0)                    # every lookup chain rejected at once
        ad.plan(["lookup"])                           # its probes fail: the back-off grows
    assert ad.prior_gamma("ngram") < 0.05 and ad._pool_gap["ngram"] > 0
    ad.add("model", "auto", 4, 1)
    assert ad.prior_gamma("model") == 0.6 and ad.seqs["model"].probe_gap == 0
    assert ad.plan(["model"])["model"][0] > 0
    ad.add("lookup2", "auto", 4, 1, proposer="ngram")
    assert ad.plan(["lookup2"]) == {"lookup2": (0, 0)}   # the lookup pool's word still holds for lookup


def _pipeline(gamma_hits: tuple[int, int], a: float, b: float, overlap: bool = True) -> AdaptiveSpeculation:
    ad = AdaptiveSpeculation(max_spec_len=8, overlap=overlap)
    ad.add("s", "auto", 8, 1)
    feed(ad.costs, a, b)
    for _ in range(20):                 # converged past the prior (the first two are one-offs)
        ad.costs.observe_draft(1, 0.001)
    accepted, depth = gamma_hits
    for _ in range(40):
        ad.observe("s", depth, accepted)
    return ad


def test_the_pipeline_counts_the_bridge_step_after_a_contradicted_tree():
    # gamma ~ 0.5, each verified row costs 70 % of a plain step: a synchronous engine gains from a
    # 1-token draft, but in the pipeline that tree is followed by a bridge step 3 times in 4
    sync = _pipeline((1, 2), a=0.05, b=0.035, overlap=False)
    assert sync.plan(["s"])["s"][0] >= 1
    assert _pipeline((1, 2), a=0.05, b=0.035).plan(["s"]) == {"s": (0, 0)}
    # with a draft that is nearly always right, bridges are rare and deep trees still win
    k, _ = _pipeline((19, 20), a=0.05, b=0.003).plan(["s"])["s"]
    assert k >= 4
    # lockstep (one tree in flight, nothing assumed): no bridges, so the 1-token draft pays again
    lockstep = _pipeline((1, 2), a=0.05, b=0.035)
    lockstep.bridges = False
    assert lockstep.plan(["s"])["s"][0] >= 1


def test_a_plan_must_beat_decoding_alone_on_borrowed_cores():
    # gamma ~ 0.75 on the verifier's own core: a 2-deep tree is predicted to win by ~25 %
    ad = _pipeline((3, 4), a=0.05, b=0.01)
    assert ad.plan(["s"])["s"][0] >= 1
    # but decoding alone on the drafter's idle core too takes 40 ms, not 60: it wins
    assert ad.plan(["s"], plain_step_s=0.040) == {"s": (0, 0)}
    # a fixed-mode chain in the batch keeps the drafter busy: no borrowed baseline then
    ad.add("c", "chain", 2, 1)
    assert ad.plan(["s", "c"], plain_step_s=0.040)["s"][0] >= 1


def test_decoding_alone_on_borrowed_cores_is_the_baseline_not_the_models_one_row_guess():
    """In lockstep a pipeline's verifier fits its model from tree steps only (its plain steps
    borrow the drafter's cores and go to their own model): 2, 3 and 4 rows at 9.5, 12.4 and
    17.2 ms put one row under 6 ms on the line through them, against 10.8 ms measured for
    decoding alone, and a plan that had to beat the cheaper of the two never speculated again."""
    ad = AdaptiveSpeculation(max_spec_len=3, overlap=False)
    ad.bridges = False
    for _ in range(30):
        for rows, s in ((2, 0.0095), (3, 0.0124), (4, 0.0172)):
            ad.costs.observe_verify(rows, s)
        ad.costs.observe_draft(3, 0.0033)
    assert ad.costs.verify_time(1) < 0.006
    ad.add("s", "auto", 3, 1)
    for _ in range(20):
        ad.observe("s", 3, 2)                         # gamma 2/3: 1.67 tokens for 10.6 ms at k = 1
    assert ad.plan(["s"], plain_step_s=0.0108)["s"][0] >= 1
    assert ad.plan(["s"], plain_step_s=0.0060)["s"] == (0, 0)   # where alone is that cheap, it is not


def test_one_good_sequence_in_a_large_batch_still_speculates():
    # 31 sequences whose draft never agrees and one whose draft agrees 3 times in 4, on a GPU-like
    # verifier: that one must speculate although it lifts the whole batch by less than 5 %
    ad = _held_off([f"s{i}" for i in range(31)], a=0.03, b=0.0002)
    ad.add("good", "auto", 4, 1)
    for _ in range(40):
        ad.observe("good", 4, 3)
    plan = ad.plan(list(ad.seqs))
    assert plan["good"][0] >= 2 and all(plan[f"s{i}"] == (0, 0) for i in range(31))


def test_the_probe_back_off_and_its_clock_carry_over_to_new_sequences_until_speculation_pays_again():
    ad = controller((0, 4), a=0.09, b=0.16)           # gamma ~ 0 on a costly verifier: held off
    ad.probe_every = 3
    probes = [i for i in range(40) if ad.plan(["s"])["s"][0] > 0]
    assert probes[:3] == [2, 8, 20]                   # 3, 6, 12 steps
    assert ad.seqs["s"].probe_gap == 24 and ad.seqs["s"].off_steps == 19
    ad.remove("s")
    ad.add("t", "auto", 8, 1)                         # the next request waits out the same clock:
    probes = [i for i in range(40) if ad.plan(["t"])["t"][0] > 0]
    assert probes == [4, 28] and ad.seqs["t"].probe_gap == 24  # 24 steps after s's last probe, not 3
    ad.costs = CostModel()                            # verifying becomes cheap, the draft good
    feed(ad.costs, 0.03, 0.0005)
    ad.seqs["t"].attempts, ad.seqs["t"].accepts = 10.0, 9.5
    assert ad.plan(["t"])["t"][0] > 0                 # it speculates by plan ...
    ad.add("u", "auto", 8, 1)
    assert ad.seqs["u"].probe_gap == 0                # ... so new sequences probe as usual again


def _marginal() -> AdaptiveSpeculation:
    """The embedded pair's pipeline on this project's CPU (bench/README.md): a 1-4 row verification
    on the verifier's own core 24-28 ms, decoding alone on borrowed cores 11 ms, bridges after a
    contradicted outcome: a new sequence at the pooled γ 0.75 is held off, one whose draft is
    right 9 times in 10 speculates."""
    ad = AdaptiveSpeculation(max_spec_len=3)
    for _ in range(60):
        for rows in (1, 2, 3, 4):
            ad.costs.observe_verify(rows, 0.0225 + 0.00125 * rows)
    ad._pool["model"] = [40.0, 30.0]
    return ad


def test_short_requests_cannot_silence_a_proposer_whose_probes_have_failed():
    """Requests shorter than the pooled probe wait used to restart its clock each: with 32 to
    wait and 20 steps a request, no sequence ever probed again, the pooled γ never moved, and
    speculation stayed off for every later request however well its draft would have done
    (bench/e2e.py: code prompts whose drafts are right 19 times in 20 decoded alone). The clock
    runs on across requests, so a probe still comes every 32 steps decoded alone."""
    ad = _marginal()
    ad._pool_gap["model"] = 32
    probes = []
    for n in range(6):
        ad.add(f"r{n}", "auto", 3, 1)
        probes += [(n, i) for i in range(20) if ad.plan([f"r{n}"], plain_step_s=0.0111)[f"r{n}"][0] > 0]
        ad.remove(f"r{n}")
    assert [20 * n + i for n, i in probes] == [31, 95]   # 32 steps in, then 64 more: across requests
    ad.add("good", "auto", 3, 1)                      # a request whose draft is right throughout
    plans = []
    for i in range(130):
        plans.append(ad.plan(["good"], plain_step_s=0.0111)["good"][0])
        if plans[-1]:
            ad.observe("good", plans[-1], plans[-1])  # (verified before the next plan, as in sync)
    first = plans.index(2)
    assert first == 128 - (120 - 96) - 1              # the wait is 128 now, 24 steps of it already run
    assert set(plans[first + 1:]) == {3}              # one probe accepted whole wins it back
    assert ad._pool_gap["model"] == 0 and ad.prior_gamma() > 0.75


def test_a_probe_is_judged_on_its_trees_outcome_even_when_that_comes_a_step_later():
    """In the pipeline a probe's tree is verified a step or two after the plan that asked for it:
    the plan between must not judge the probe a failure on a γ that has not seen its tree."""
    ad = _marginal()
    ad._pool["model"] = [40.0, 24.0]                  # a pooled γ of 0.6: two whole probes to win back
    ad.probe_every = 4
    ad.add("s", "auto", 3, 1)
    plans = [ad.plan(["s"], plain_step_s=0.0111)["s"][0] for _ in range(4)]
    assert plans == [0, 0, 0, 2]
    assert ad.plan(["s"], plain_step_s=0.0111)["s"] == (0, 0)    # its tree not verified yet ...
    assert ad.seqs["s"].probed and ad.seqs["s"].probe_gap == 0   # ... so no verdict
    ad.observe("s", 2, 2)                             # it arrives, accepted whole: probe again
    assert ad.plan(["s"], plain_step_s=0.0111)["s"][0] == 2
    ad.observe("s", 2, 0)                             # that one missed at once: wait twice as long
    assert ad.plan(["s"], plain_step_s=0.0111)["s"] == (0, 0) and ad.seqs["s"].probe_gap == 8
    ad2 = _marginal()
    ad2.probe_every = 4
    ad2.add("s", "auto", 3, 1)
    plans = [ad2.plan(["s"], plain_step_s=0.0111)["s"][0] for _ in range(8)]
    assert plans == [0, 0, 0, 2, 0, 0, 0, 0]          # a tree that never came: failed after 2 plans
    assert ad2.seqs["s"].probe_gap == 8 and not ad2.seqs["s"].probed


def test_sequences_decoding_alone_beside_the_plan_count_their_tokens():
    """`alone` sequences share the forward: their rows raise its cost and their tokens its
    yield, so a weak chain that lifts one sequence alone by 8 % is not worth 1 % more time
    for a batch of 31 (counting the rows but not the tokens would say it is)."""
    from speculation.cost_model import VerifyCosts

    ad = AdaptiveSpeculation(max_spec_len=1, overlap=False)
    ad.costs = VerifyCosts(CostModel(a=0.05, b=0.001))     # no drafting: the verifier's own chains
    ad.add("s", "auto", 1, 1)
    st = ad.seqs["s"]
    st.attempts, st.accepts = 10.0, 1.0                     # γ = 0.1: E = 1.1 tokens at depth 1
    assert ad.plan(["s"]) == {"s": (1, 1)}                  # 1.1 / 0.052 beats 1 / 0.051 by 8 %
    assert ad.plan(["s"], alone=30) == {"s": (0, 0)}        # 31.1 / 0.082 < 31 / 0.081
    assert VerifyCosts(CostModel(a=0.05, b=0.001, d=1.0)).step_time(3, 4) == 0.05 + 0.003


def test_plans_stay_within_the_few_row_kernel_unless_decoding_alone_exceeds_it():
    ad = AdaptiveSpeculation(max_spec_len=4)
    ad.costs = CostModel(a=0.05, b=0.0005, d=0.0001)      # rows look nearly free to the linear model
    for s in "abcd":
        ad.add(s, "auto", 4, 1)
        st = ad.seqs[s]
        st.attempts, st.accepts = 10.0, 9.0                # γ = 0.9
    assert sum(k for k, _ in ad.plan(list("abcd")).values()) == 16     # 4 + 16 = 20 rows
    ad.row_limit = 16
    plan = ad.plan(list("abcd"))
    assert 4 + sum(k for k, _ in plan.values()) == 16 and all(k >= 2 for k, _ in plan.values())
    ad.row_limit = 3                                       # decoding alone (4 rows) already exceeds it
    assert ad.plan(list("abcd")) == {s: (0, 0) for s in "abcd"}


def test_a_stream_joining_a_batch_is_planned_with_it():
    """Alone, a new stream with the prior γ would start with a tree; beside 31 streams
    decoding alone on a CPU target (few-row kernel up to 16 rows) it must not."""
    ad = AdaptiveSpeculation(max_spec_len=4)
    ad.costs = CostModel(a=0.05, b=0.003, d=0.004)
    ad.row_limit = 16
    ad.add("new", "auto", 4, 1)
    ad.add("fixed", "chain", 3, 1)
    ad.add("quiet", "off", 4, 1)
    alone = ad.plan_joining(["new", "fixed", "quiet"], [])
    assert alone["new"][0] > 0 and alone["fixed"] == (3, 1) and alone["quiet"] == (0, 0)
    crowded = ad.plan_joining(["new"], [(0, 0)] * 31)
    assert crowded == {"new": (0, 0)}
    assert ad.seqs["new"].off_steps == 0 and not ad.seqs["new"].probed     # a what-if, no bookkeeping


def test_restart_trees_are_priced_as_the_chain_after_a_contradiction():
    """With `restart_depth` s the step after a contradicted tree verifies a chain of
    min(s, k) (E_s tokens over 1 + s rows), not one token alone: per step on average
    (E + m·E_s) / (1 + m) tokens and (1 + kW + m(1 + s)) / (1 + m) rows, m = 1 - γ^(k+1)."""
    ad = _pipeline((3, 4), a=0.05, b=0.01)
    gamma = ad.seqs["s"].gamma
    m = 1.0 - gamma ** 5
    bridged = ad._per_step(gamma, 4, 1)
    assert bridged == pytest.approx(((expected_tokens(gamma, 4) + m) / (1 + m), 1 + 4 / (1 + m)))
    ad.restart_depth = 2
    tokens, rows = ad._per_step(gamma, 4, 1)
    assert tokens == pytest.approx((expected_tokens(gamma, 4) + m * expected_tokens(gamma, 2)) / (1 + m))
    assert rows == pytest.approx((1 + 4 + m * 3) / (1 + m))
    assert tokens > bridged[0] and rows > bridged[1]
    assert ad._per_step(gamma, 1, 1) == pytest.approx(
        ((expected_tokens(gamma, 1) + (1 - gamma ** 2) * expected_tokens(gamma, 1)) / (2 - gamma ** 2),
         (2 + (1 - gamma ** 2) * 2) / (2 - gamma ** 2)))          # the restart chain within k
    ad.bridges = False                                               # lockstep: nothing contradicted
    assert ad._per_step(gamma, 4, 1) == pytest.approx((expected_tokens(gamma, 4), 5.0))


def test_lockstep_pricing_switches_speculation_off_where_taking_turns_does_not_pay():
    """Costs measured on an H200 in lockstep (2026-11-30, docs/bench-history.md): a one-row forward
    12.4 ms, five rows 18.5 ms, the wait for a 4-level tree 20 ms. Priced as turns (forward
    plus wait), a sequence at γ 0.5 decodes alone and one at γ 0.95 speculates; had the waits
    been folded into the forward's a + b·rows, a run of five-row steps alone would read as a
    slope it cannot separate from the wait, and γ 0.5 would speculate and lose (0.63× measured)."""
    from speculation.planner import AdaptiveSpeculation

    def planner(overlap: bool) -> AdaptiveSpeculation:
        a = AdaptiveSpeculation(max_spec_len=4)
        a.costs.overlap = a.bridges = overlap
        return a

    turns = planner(False)
    for _ in range(5):
        turns.costs.observe_verify(1, 0.0124)
        turns.costs.observe_verify(5, 0.0185)
        turns.costs.observe_draft(4, 0.020)
    folded = planner(True)
    for _ in range(5):
        folded.costs.observe_verify(5, 0.0385)    # the forward plus the wait, five rows each time
    for gamma, want_on in ((0.5, False), (0.95, True)):
        for a in (turns, folded):
            a.add("x", "auto", 4, 1)
            st = a.seqs["x"]
            st.attempts, st.accepts = 1000.0, 1000.0 * gamma
        assert (turns.plan(["x"])["x"][0] > 0) == want_on, (gamma, turns.plan(["x"]))
    folded.seqs["x"].accepts = 500.0           # γ 0.5: the folded model speculates (what lost on the GPU)
    assert folded.plan(["x"])["x"][0] > 0


def test_sync_costs_add_draft_and_verify():
    sync, async_ = CostModel(a=1.0, b=0.1, d=0.5, overlap=False), CostModel(a=1.0, b=0.1, d=0.5)
    assert sync.step_time(rows=5, max_levels=4) == pytest.approx(1.5 + 2.0)
    assert async_.step_time(rows=5, max_levels=4) == pytest.approx(2.0)


def test_a_prompt_chunk_in_every_step_makes_deeper_trees_pay():
    """While a chunked prefill is under way each step also pays its chunk (`chunk_s`): a fixed
    cost per step, which committing more tokens per step amortises."""
    ad = controller((1, 4), a=0.1, b=0.0887)          # K = 1 would win by ~2% alone: off
    assert ad.plan(["s"]) == {"s": (0, 0)}
    ad.chunk_s = 0.2
    assert ad.plan(["s"])["s"][0] > 0


def test_the_wait_for_trees_is_priced_once_per_speculating_step():
    """Overlapped, a step that speculates also pays the measured wait for its trees (`wait`),
    whatever its rows; one decoding alone waits for nothing. In turns (lockstep) the wait is
    the draft's per-level cost instead, and `wait` does not apply."""
    c = CostModel(a=0.030, b=0.005, d=0.004)
    c.observe_wait(0.020)
    assert c.wait == pytest.approx(0.004)
    assert c.step_time(rows=4, max_levels=3) == pytest.approx(0.050 + 0.004)
    assert c.step_time(rows=8, max_levels=3) == pytest.approx(0.070 + 0.004)
    assert c.step_time(rows=1, max_levels=0) == pytest.approx(0.035)
    turns = CostModel(a=0.030, b=0.005, d=0.004, overlap=False)
    turns.observe_wait(0.020)
    assert turns.step_time(rows=4, max_levels=3) == pytest.approx(0.050 + 0.012)


def test_a_trees_fixed_wait_is_fitted_apart_from_its_levels():
    """In lockstep a tree's wait is the exchange both ways plus its levels (a one-core-per-model
    trace: ~4 ms + 3.3 ms a level). Priced all per level, one-level trees read as 7.3 ms a
    level, and the planner kept trees shallow."""
    c = CostModel(a=0.035, b=0.005, overlap=False)
    for levels in (1, 2, 3, 4, 5, 6) * 4:
        c.observe_draft(levels, 0.004 + 0.0033 * levels)
    d0, d = c.draft_coefficients
    assert d0 == pytest.approx(0.004, abs=1e-6) and d == pytest.approx(0.0033, abs=1e-7)
    assert c.step_time(rows=4, max_levels=3) == pytest.approx(0.055 + 0.004 + 0.0099)
    assert c.step_time(rows=1, max_levels=0) == pytest.approx(0.040)      # no tree, no wait for one
