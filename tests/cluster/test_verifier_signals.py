"""The verifier's signals to its drafter while a sequence's speculation is off (no Ray).

A sequence held at budget 0 must not wake its drafter on every step; the
tokens committed meanwhile travel with the next signal the drafter needs, so
its confirmed prefix stays exact (DraftStream checks the length).
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict

import torch

from cluster.streams import DraftStream
from cluster.verifier_actor import VerifierActor
from cluster.wire import decode_signals
from models.sampling import SamplingParams


def test_a_sequence_held_off_is_signalled_only_when_its_drafter_is_needed(tiny_target):
    async def scenario():
        va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16, "lookup": False})
        await va.exchange(0, "d0", [], 0.0)                              # a drafter attaches
        va.adaptive.plan = va.adaptive.plan_joining = lambda streams, *_, **__: {s: (0, 0) for s in streams}
        prompt = list(range(3, 12))
        params = asdict(SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        gen = va.generate("r", prompt, params, {"mode": "auto"})
        tokens = []
        signals = []
        for _ in range(6):                                               # six plain steps
            tokens += (await asyncio.wait_for(gen.__anext__(), 10)).token_ids
            signals += decode_signals(await va.exchange(0, "d0", [], 0.0))
        assert [s.kind for s in signals] == ["resync"]                  # told once: budget 0, no steps
        assert signals[0].budget == (0, 0) and len(tokens) == 6
        # now the planner wants a tree: one signal carries every token committed meanwhile
        va.adaptive.plan = lambda streams, *_, **__: {s: (2, 1) for s in streams}
        tokens += (await asyncio.wait_for(gen.__anext__(), 10)).token_ids
        late = [s for s in decode_signals(await va.exchange(0, "d0", [], 0.0)) if s.kind == "step"]
        assert len(late) == 1 and late[0].budget == (2, 1)
        stream = DraftStream("r", signals[0].token_ids, signals[0].epoch, SamplingParams(), 0)
        for sig in [s for s in signals if s.kind == "step"] + late:
            stream.on_step(sig)
            assert len(stream.confirmed) == sig.prefix_len
        assert stream.confirmed == prompt + tokens                       # exact, nothing lost
        await asyncio.wait_for(gen.aclose(), 10)

    threads = torch.get_num_threads()          # the actor sets its own; give the session's back
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        torch.set_num_threads(threads)


def test_plain_step_threads_rule():
    from cluster.backends import plain_step_threads

    here = [{"node": "n1", "cpus": 1.0}]
    assert plain_step_threads(-1, 1, "cpu", "n1", here) == 2                       # borrows the drafter's core
    assert plain_step_threads(-1, 2, "cpu", "n1", here + [{"node": "n1", "cpus": 2}]) == 5
    assert plain_step_threads(-1, 1, "cpu", "n1", [{"node": "n2", "cpus": 4}]) == 1   # another node's cores
    assert plain_step_threads(-1, 1, "cpu", "", [{"node": "", "cpus": 1}]) == 1       # where unknown: no
    assert plain_step_threads(0, 1, "cpu", "n1", here) == 1                        # switched off
    assert plain_step_threads(3, 1, "cpu", "n1", []) == 3                          # fixed
    assert plain_step_threads(-1, 1, "cuda", "n1", here) == 1                      # GPUs: threads don't matter


def test_plain_steps_borrow_the_idle_drafters_core_and_speculating_steps_do_not(tiny_target):
    from models.tree import TokenTree

    async def run_request(plan: tuple[int, int]) -> tuple[list, int, VerifierActor, list]:
        va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16, "lookup": False,
                                              "lockstep_alone": False})
        va.node_id = "n1"
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)         # a drafter on our node
        used = []
        verify = va.side.verify
        va.side.verify = lambda requests, threads=None: (used.append(threads), verify(requests, threads))[1]
        prefills = []
        prefill = va.side.prefill
        va.side.prefill = lambda sid, prompt: (prefills.append(torch.get_num_threads()), prefill(sid, prompt))[1]
        va.adaptive.plan = va.adaptive.plan_joining = lambda streams, *_, **__: {s: plan for s in streams}
        params = asdict(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        tokens = []
        async for chunk in va.generate("r", list(range(3, 12)), params, {"mode": "auto"}):
            tokens += chunk.token_ids
            await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)     # stays live, puts no tree
        assert len(tokens) == 6
        return used, va.stats.borrowed_steps, va, prefills

    async def scenario():
        used, borrowed, va0, prefills = await run_request((0, 0))   # held off: the drafter idles
        assert used == [2] * 6 and borrowed == 6 and prefills == [2]   # the prompt's prefill too
        # those steps fit the borrowed-cores model the planner must beat, not the verifier's own
        assert va0.plain_costs.observed and not va0.adaptive.costs.observed
        assert 0 < va0._plain_step_s(1) < 5
        va0.drafters[0]["last_seen"] -= 60                      # no drafter to lend cores: no baseline
        assert va0._plain_step_s(1) is None
        used, borrowed, va, prefills = await run_request((2, 1))    # trees wanted: the drafter is busy
        assert prefills == [1]
        # no tree came, so each step fell back to decoding alone on one thread; only the last,
        # with one token left (no draft fits, budget 0, the drafter told so), borrows
        assert used == [1] * 5 + [2] and borrowed == 1
        # the rule, state by state, on a live stream of that actor
        s = va._new_stream("q", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), {"mode": "auto"})
        s.admitted, s.drafter = True, 0
        va.streams["q"] = s
        plain = [(s, TokenTree.empty(3), None)]
        assert va._step_threads(plain) == 2
        for field, value in (("budget", (2, 1)), ("sent_budget", (2, 1)), ("bridge", True)):
            setattr(s, field, value)                            # drafting, told to, or bridging
            assert va._step_threads(plain) == 1
            setattr(s, field, (0, 0) if field != "bridge" else False)
        from cluster.wire import TreeHeader

        tree = TokenTree(torch.tensor([9]), torch.tensor([-1]), torch.tensor([1]), None, 3, 0)
        header = TreeHeader("q", 0, 0, 3, 3, [], 1, 0)
        assert va._step_threads([(s, tree, header)]) == 1       # a drafter's tree in the batch
        assert va._step_threads([(s, tree, None)]) == 2         # the verifier's own lookup chain
        va.drafters[0]["last_seen"] -= 60                       # a silent drafter lends nothing
        assert va._step_threads(plain) == 1
        del va.streams["q"]

    threads = torch.get_num_threads()
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        torch.set_num_threads(threads)


def test_lockstep_verification_borrows_only_while_every_drafter_waits_for_it(tiny_target):
    from cluster.wire import TreeHeader
    from models.tree import TokenTree

    threads = torch.get_num_threads()
    try:
        for slots in (1, 2):
            va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16, "lookup": False,
                                                  "ring_slots": slots, "lockstep_alone": False})
            assert va.adaptive.bridges == (slots > 1)
            va.node_id = "n1"
            asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))
            streams = {}
            for rid in ("q", "r"):
                s = va._new_stream(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), {"mode": "auto"})
                s.admitted, s.drafter, s.budget = True, 0, (2, 1)
                va.streams[rid] = streams[rid] = s
            tree = TokenTree(torch.tensor([9, 4]), torch.tensor([-1, 0]), torch.tensor([1, 2]), None, 3, 0)
            both = [(streams[rid], tree, TreeHeader(rid, 0, 0, 3, 3, [], 2, 0)) for rid in ("q", "r")]
            # both sequences' one tree in flight is in the step: the drafter waits for its signals
            assert va._step_threads(both) == (2 if slots == 1 else 1)
            # r's drafter may be drafting (its tree is not in this step): no borrowing
            assert va._step_threads(both[:1]) == 1
            streams["r"].budget = streams["r"].sent_budget = (0, 0)       # r held off, drafter told
            assert va._step_threads(both[:1]) == (2 if slots == 1 else 1)
            streams["r"].bridge = True                                     # r bridging: drafter busy
            assert va._step_threads(both[:1]) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_lone_stream_runs_in_lockstep_beside_a_cpu_drafter_with_as_many_cores(tiny_target):
    """`lockstep_alone`: one stream served by a drafter on our node with at least our CPUs is in
    lockstep (its verification borrows, the planner counts no bridges); a second stream for the
    same drafter, a drafter elsewhere or with fewer CPUs, or the setting off, and it is not."""
    from cluster.wire import TreeHeader
    from models.tree import TokenTree

    threads = torch.get_num_threads()
    try:
        va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16, "lookup": False})
        va.node_id = "n1"
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))

        def add(rid):
            s = va._new_stream(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), {"mode": "auto"})
            s.admitted, s.drafter, s.budget = True, 0, (2, 1)
            va.streams[rid] = s
            return s

        q = add("q")
        tree = TokenTree(torch.tensor([9, 4]), torch.tensor([-1, 0]), torch.tensor([1, 2]), None, 3, 0)
        step = [(q, tree, TreeHeader("q", 0, 0, 3, 3, [], 2, 0))]
        assert va._lockstep(0) and va._step_threads(step) == 2 and not va._plan_bridges()
        r = add("r")                                     # a second stream: overlap again
        assert not va._lockstep(0) and va._plan_bridges()
        assert va._step_threads(step + [(r, tree, TreeHeader("r", 0, 0, 3, 3, [], 2, 0))]) == 1
        del va.streams["r"]
        for key, value in (("node", "n2"), ("cpus", 0.5)):   # elsewhere, or fewer CPUs than ours
            old, va.drafters[0][key] = va.drafters[0][key], value
            assert not va._lockstep(0) and va._step_threads(step) == 1
            va.drafters[0][key] = old
        va.settings.lockstep_alone = False
        assert not va._lockstep(0) and va._step_threads(step) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_silent_drafters_sequences_decode_alone_counted_as_absent(tiny_target):
    """Planned trees from a drafter silent past drafter_timeout_s are not waited for: those
    steps decode alone at once and count as drafter_absent_steps (not as fallbacks, which
    waited first)."""
    async def scenario():
        va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16, "lookup": False,
                                              "drafter_timeout_s": 0.2, "max_tree_wait_s": 5.0})
        await va.exchange(0, "d0", [], 0.0)                              # a drafter attaches
        va.adaptive.plan = va.adaptive.plan_joining = lambda streams, *_, **__: {s: (2, 1) for s in streams}
        params = asdict(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        # live and silent for less than its timeout: the first step waits for its tree (no
        # absence yet); once it has been silent past the timeout, steps run without it
        gen = va.generate("r", list(range(3, 12)), params, {"mode": "chain", "spec_len": 2})
        start = asyncio.get_running_loop().time()
        tokens = []
        async for chunk in gen:
            tokens += chunk.token_ids
        waited = asyncio.get_running_loop().time() - start
        assert len(tokens) == 4
        assert va.stats.drafter_absent_steps >= 3, va.stats
        assert va.stats.fallback_steps == 0 and va.stats.num_spec_steps == 0
        assert waited < 2.0, f"a silent drafter must not hold the verifier back ({waited:.2f} s)"

    threads = torch.get_num_threads()
    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        torch.set_num_threads(threads)
