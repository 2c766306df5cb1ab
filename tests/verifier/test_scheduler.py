"""The scheduler (verifier/scheduler.py, no Ray): its signals to a drafter, the cores its steps
run on, lockstep and the step costs it plans with.

The verifier's signals to its drafter while a sequence's speculation is off:

A sequence held at budget 0 must not wake its drafter on every step; the
tokens committed meanwhile travel with the next signal the drafter needs, so
its confirmed prefix stays exact (DraftStream checks the length).
"""
from __future__ import annotations

import asyncio

import torch

from drafter.streams import DraftStream
from models.sampling import SamplingParams
from speculation.requests import SpeculationOptions

from .harness import Harness, run_restoring_threads


def test_a_sequence_held_off_is_signalled_only_when_its_drafter_is_needed(tiny_target):
    async def scenario():
        va = Harness(tiny_target, num_blocks=64, block_size=16, lookup=False)
        await va.exchange(0, "d0", [], 0.0)                              # a drafter attaches
        ad = va.scheduler.adaptive
        ad.plan = ad.plan_joining = lambda streams, *_, **__: {s: (0, 0) for s in streams}
        prompt = list(range(3, 12))
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        gen = va.generate("r", prompt, params, {"mode": "auto"})
        tokens = []
        signals = []
        for _ in range(6):                                               # six plain steps
            tokens += (await asyncio.wait_for(gen.__anext__(), 10)).token_ids
            signals += await va.exchange(0, "d0", [], 0.0)
        assert [s.kind for s in signals] == ["resync"]                  # told once: budget 0, no steps
        assert signals[0].budget == (0, 0) and len(tokens) == 6
        # now the planner wants a tree: one signal carries every token committed meanwhile
        ad.plan = lambda streams, *_, **__: {s: (2, 1) for s in streams}
        late = []
        while not late and len(tokens) < params.max_tokens:   # chunks of steps planned before the
            tokens += (await asyncio.wait_for(gen.__anext__(), 10)).token_ids   # switch may be queued
            late = [s for s in await va.exchange(0, "d0", [], 0.0) if s.kind == "step"]
        assert len(late) == 1 and late[0].budget == (2, 1)
        while len(prompt) + len(tokens) < late[0].prefix_len:           # the chunks the signal covers
            tokens += (await asyncio.wait_for(gen.__anext__(), 10)).token_ids
        stream = DraftStream("r", signals[0].token_ids, signals[0].epoch, SamplingParams(), 0)
        for sig in [s for s in signals if s.kind == "step"] + late:
            stream.on_step(sig)
            assert len(stream.confirmed) == sig.prefix_len
        assert stream.confirmed == (prompt + tokens)[:late[0].prefix_len]   # exact, nothing lost
        await asyncio.wait_for(gen.aclose(), 10)

    run_restoring_threads(scenario())


def _borrowing_harness(tiny_target) -> Harness:
    """A verifier with no lookup chains and `lockstep_alone` off, a drafter attached on its node."""
    va = Harness(tiny_target, num_blocks=64, block_size=16, lookup=False, lockstep_alone=False)
    va.scheduler.registry.node_id = "n1"
    return va


async def _request_with_plan(tiny_target, plan: tuple[int, int]) -> tuple[list, Harness, list]:
    """Six tokens of one request under a planner fixed at `plan`, the drafter live and putting
    no tree: the threads each verification ran on, the harness, the prefill's threads."""
    va = _borrowing_harness(tiny_target)
    await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)         # a drafter on our node
    used, prefills = [], []
    verify, prefill = va.side.verify, va.side.prefill
    va.side.verify = lambda requests, threads=None, chunks=None: (used.append(threads),
                                                                 verify(requests, threads, chunks))[1]
    va.side.prefill = lambda sid, prompt, *rest: (prefills.append(torch.get_num_threads()),
                                                  prefill(sid, prompt, *rest))[1]
    va.scheduler.adaptive.plan = va.scheduler.adaptive.plan_joining = lambda streams, *_, **__: {s: plan for s in streams}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = []
    async for chunk in va.generate("r", list(range(3, 12)), params, {"mode": "auto"}):
        tokens += chunk.token_ids
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)     # stays live, puts no tree
    assert len(tokens) == 6
    return used, va, prefills


def test_plain_steps_borrow_the_idle_drafters_core_and_are_priced_as_borrowed(tiny_target):
    async def scenario():
        used, va, prefills = await _request_with_plan(tiny_target, (0, 0))   # held off: the drafter idles
        assert used == [2] * 6 and va.scheduler.stats.borrowed_steps == 6 and prefills == [2]   # the prefill too
        # those steps fit the borrowed-cores model the planner must beat, not the verifier's own
        assert va.scheduler.costs.plain.observed and not va.scheduler.adaptive.costs.observed
        assert 0 < va.plain_step_s(1) < 5
        # until a step on its own thread is measured, a speculating step (which gives the
        # drafter's core back) is priced as that plain step on one thread of two
        va.scheduler.plan_overlap()
        a, b = va.scheduler.costs.plain.coefficients
        assert va.scheduler.costs.overlap.prior == (2 * a, 2 * b)
        va.scheduler.registry.drafters[0].last_seen -= 60                      # no drafter to lend cores: no baseline
        assert va.plain_step_s(1) is None

    run_restoring_threads(scenario())


def test_speculating_steps_leave_the_drafters_core_alone(tiny_target):
    async def scenario():
        used, va, prefills = await _request_with_plan(tiny_target, (2, 1))   # trees wanted: the drafter is busy
        assert prefills == [1]
        # no tree came, so each step fell back to decoding alone on one thread; the last (one
        # token left: budget 0, the drafter told so) too, since the drafter, told to draft a
        # step before, has not yet said it is idle again
        assert used == [1] * 6 and va.scheduler.stats.borrowed_steps == 0

    run_restoring_threads(scenario())


def test_a_step_borrows_cores_only_from_a_drafter_idle_by_its_own_word(tiny_target):
    """The rule, state by state, on a live stream of a verifier with a drafter on its node."""
    from models.tree import TokenTree
    from speculation.wire import Signal, TreeHeader

    async def scenario():
        va = _borrowing_harness(tiny_target)
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0)
        s = va.stream("q", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4), budget=(0, 0))
        plain = [(s, TokenTree.empty(3), None)]
        assert va.step_threads(plain) == 2
        for field, value in (("budget", (2, 1)), ("sent_budget", (2, 1)), ("bridge", True)):
            setattr(s, field, value)                            # drafting, told to, or bridging
            assert va.step_threads(plain) == 1
            setattr(s, field, (0, 0) if field != "bridge" else False)
        tree = TokenTree(torch.tensor([9]), torch.tensor([-1]), torch.tensor([1]), None, 3, 0)
        assert va.step_threads([(s, tree, TreeHeader("q", 0, 0, 3, 3, [], 1, 0))]) == 1   # a drafter's tree
        assert va.step_threads([(s, tree, None)]) == 2         # the verifier's own lookup chain
        # a drafter lends its cores only while idle by its own word, until told to draft again
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0, idle=False)   # still drafting
        assert va.step_threads(plain) == 1
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0, idle=True)
        assert va.step_threads(plain) == 2
        va.scheduler.registry.send(0, Signal("step", "q", budget=(0, 0)))         # nothing to draft: still idle
        assert va.step_threads(plain) == 2
        va.scheduler.registry.send(0, Signal("step", "q", budget=(2, 1)))         # a tree to draft: busy again
        assert va.step_threads(plain) == 1
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0, idle=True)   # that reply carries it
        assert va.step_threads(plain) == 1
        await va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0, idle=True)   # drafted, idle again
        assert va.step_threads(plain) == 2
        # a stream drafted in our own process (the stand-in) takes turns with the target and never
        # drafts beside a forward: the idle drafter's cores stay lent, while the same work for the
        # drafter of another process takes them back
        drafter = s.drafter
        va.scheduler.registry.in_process.add(7)
        s.drafter, s.budget = 7, (2, 1)
        assert va.scheduler.members.drafters_idle() and va.step_threads(plain) == 2
        s.drafter = drafter if drafter is not None else 0
        assert not va.scheduler.members.drafters_idle() and va.step_threads(plain) == 1
        s.drafter, s.budget = drafter, (0, 0)
        va.scheduler.registry.in_process.discard(7)
        va.scheduler.registry.drafters[0].last_seen -= 60                       # a silent drafter lends nothing
        assert va.step_threads(plain) == 1
        va.scheduler.streams.pop("q")

    run_restoring_threads(scenario())


def test_lockstep_verification_borrows_only_while_every_drafter_waits_for_it(tiny_target):
    from speculation.wire import TreeHeader
    from models.tree import TokenTree

    threads = torch.get_num_threads()
    try:
        for slots in (1, 2):
            va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False,
                                                  "ring_slots": slots, "lockstep_alone": False})
            assert va.scheduler.adaptive.bridges == (slots > 1)
            va.scheduler.registry.node_id = "n1"
            asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))
            streams = {}
            for rid in ("q", "r"):
                streams[rid] = va.stream(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
            tree = TokenTree(torch.tensor([9, 4]), torch.tensor([-1, 0]), torch.tensor([1, 2]), None, 3, 0)
            both = [(streams[rid], tree, TreeHeader(rid, 0, 0, 3, 3, [], 2, 0)) for rid in ("q", "r")]
            # both sequences' one tree in flight is in the step: the drafter waits for its signals
            assert va.step_threads(both) == (2 if slots == 1 else 1)
            # r's drafter may be drafting (its tree is not in this step): no borrowing
            assert va.step_threads(both[:1]) == 1
            streams["r"].budget = streams["r"].sent_budget = (0, 0)       # r held off, drafter told
            assert va.step_threads(both[:1]) == (2 if slots == 1 else 1)
            streams["r"].bridge = True                                     # r bridging: drafter busy
            assert va.step_threads(both[:1]) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_lone_stream_runs_in_lockstep_beside_a_cpu_drafter_with_as_many_cores(tiny_target):
    """`lockstep_alone`: one stream served by a drafter on our node with at least our CPUs is in
    lockstep (its verification borrows, the planner counts no bridges); a second stream for the
    same drafter, a drafter elsewhere or with fewer CPUs, or the setting off, and it is not."""
    from speculation.wire import TreeHeader
    from models.tree import TokenTree

    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        va.scheduler.registry.node_id = "n1"
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))

        def add(rid):
            return va.stream(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))

        q = add("q")
        tree = TokenTree(torch.tensor([9, 4]), torch.tensor([-1, 0]), torch.tensor([1, 2]), None, 3, 0)
        step = [(q, tree, TreeHeader("q", 0, 0, 3, 3, [], 2, 0))]
        assert va.scheduler.members.lockstep(0) and va.step_threads(step) == 2 and not va.scheduler.members.plan_bridges()
        # a turn whose threads this process's drafters chose (verifier/inprocess.py) keeps them
        assert va.step_threads(step, turn=1) == 1 and va.step_threads(step, turn=2) == 2
        r = add("r")                                     # a second stream: overlap again
        assert not va.scheduler.members.lockstep(0) and va.scheduler.members.plan_bridges()
        assert va.step_threads(step + [(r, tree, TreeHeader("r", 0, 0, 3, 3, [], 2, 0))]) == 1
        va.scheduler.streams.pop("r")
        for key, value in (("node", "n2"), ("cpus", 0.5)):   # elsewhere, or fewer CPUs than ours
            d = va.scheduler.registry.drafters[0]
            old = getattr(d, key)
            setattr(d, key, value)
            assert not va.scheduler.members.lockstep(0) and va.step_threads(step) == 1
            setattr(d, key, old)
        va.scheduler.settings.lockstep_alone = False
        assert not va.scheduler.members.lockstep(0) and va.step_threads(step) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_joining_streams_first_tree_is_priced_the_way_its_drafter_will_run(tiny_target):
    """Admission plans a stream's first budget before it has a drafter: the step-cost model is
    the one of the drafter `_choose` will give it. A lone stream goes to the stand-in in our
    process, which drafts in lockstep; two joining together go to the drafter of another
    process, overlapped (before, a joiner without a drafter was always planned as overlapped,
    with a model fitted from other steps, and a lone stream's first step decoded alone)."""
    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        sch = va.scheduler
        sch.registry.node_id = "n1"
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))     # lockstep with one stream
        sch.registry.local = 7                                               # the stand-in
        sch.registry.in_process.add(7)
        asyncio.run(va.exchange(7, "local", [], 0.0, node="n1", idle=True))
        params = SamplingParams(temperature=0.0, max_tokens=4)
        q = sch.add("q", [5, 6, 7], params, SpeculationOptions(mode="auto"), lambda chunk: None)
        assert sch.members.plan_bridges() and not sch.members.plan_bridges([q])
        sch.plan_overlap([q])
        assert sch.adaptive.costs is sch.costs.lockstep and not sch.adaptive.bridges
        r = sch.add("r", [5, 6, 8], params, SpeculationOptions(mode="auto"), lambda chunk: None)
        assert sch.members.plan_bridges([q, r])                   # both to d0: two streams, overlapped
        sch.plan_overlap([q, r])
        assert sch.adaptive.costs is sch.costs.overlap and sch.adaptive.bridges
        off = sch.add("o", [5, 6, 9], params, SpeculationOptions(mode="off"), lambda chunk: None)
        assert not sch.members.plan_bridges([q, off])             # a stream that wants no drafter
        sch.admission._admit(["q"])                               # admission plans it so
        assert q.drafter == 7 and sch.adaptive.costs is sch.costs.lockstep
    finally:
        torch.set_num_threads(threads)


def test_a_silent_drafters_sequences_decode_alone_counted_as_absent(tiny_target):
    """Planned trees from a drafter silent past drafter_timeout_s are not waited for: those
    steps decode alone at once and count as drafter_absent_steps (not as fallbacks, which
    waited first)."""
    async def scenario():
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False,
                                              "drafter_timeout_s": 0.2, "max_tree_wait_s": 5.0})
        await va.exchange(0, "d0", [], 0.0)                              # a drafter attaches
        va.scheduler.adaptive.plan = va.scheduler.adaptive.plan_joining = lambda streams, *_, **__: {s: (2, 1) for s in streams}
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        # live and silent for less than its timeout: the first step waits for its tree (no
        # absence yet); once it has been silent past the timeout, steps run without it
        gen = va.generate("r", list(range(3, 12)), params, {"mode": "chain", "spec_len": 2})
        start = asyncio.get_running_loop().time()
        tokens = []
        async for chunk in gen:
            tokens += chunk.token_ids
        waited = asyncio.get_running_loop().time() - start
        assert len(tokens) == 4
        assert va.scheduler.stats.drafter_absent_steps >= 3, va.scheduler.stats
        assert va.scheduler.stats.fallback_steps == 0 and va.scheduler.stats.num_spec_steps == 0
        assert waited < 2.0, f"a silent drafter must not hold the verifier back ({waited:.2f} s)"

    run_restoring_threads(scenario())


def test_a_drafter_on_our_gpu_runs_in_lockstep_and_the_planner_prices_turns(tiny_target):
    """`lockstep_shared_gpu`: a drafter on the verifier's GPU is in lockstep whatever the number
    of streams (the planner then adds the wait for a tree to the forward, and counts no
    bridges); on another GPU, another node, a CPU, or with the setting off, it is not. The
    drafter decides the same from its side."""
    from types import SimpleNamespace

    from drafter.runtime import Drafter
    from speculation.settings import EngineSettings
    from speculation.transport import VerifierInfo

    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        va.scheduler.registry.node_id, va.scheduler.registry.gpu_ids = "n1", ["0"]          # as on a GPU node (the model stays on the CPU)
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0, gpus=["0"]))
        for rid in ("q", "r", "s"):
            va.stream(rid, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4))
        va.scheduler.plan_overlap()
        assert va.scheduler.members.lockstep(0) and not va.scheduler.adaptive.bridges and not va.scheduler.adaptive.costs.overlap
        assert va.scheduler.adaptive.costs is va.scheduler.costs.lockstep          # its own fit: turns, not overlap
        for key, value in (("gpus", ["1"]), ("node", "n2"), ("gpus", None)):
            d = va.scheduler.registry.drafters[0]
            old = getattr(d, key)
            setattr(d, key, value)
            va.scheduler.plan_overlap()
            assert not va.scheduler.members.lockstep(0) and va.scheduler.adaptive.bridges and va.scheduler.adaptive.costs.overlap
            assert va.scheduler.adaptive.costs is va.scheduler.costs.overlap
            setattr(d, key, old)
        va.scheduler.settings.lockstep_shared_gpu = False
        assert not va.scheduler.members.lockstep(0)
    finally:
        torch.set_num_threads(threads)

    def drafter(verifier_node="n1", verifier_gpus=("0",), settings=EngineSettings(device="cuda")):
        gpus = None if verifier_gpus is None else list(verifier_gpus)
        return SimpleNamespace(settings=settings, streams={"q": 0, "r": 0}, node="n1", gpus=["0"], told_lockstep=None,
                               verifier=VerifierInfo(verifier_node, 1.0, gpus))

    assert Drafter.lockstep(drafter())
    assert not Drafter.lockstep(drafter(verifier_gpus=["1"]))
    assert not Drafter.lockstep(drafter(verifier_node="n2"))
    assert not Drafter.lockstep(drafter(verifier_gpus=None))      # a CPU verifier
    assert not Drafter.lockstep(drafter(settings=EngineSettings(device="cuda", lockstep_shared_gpu=False)))


def test_on_a_gpu_plain_steps_are_the_baseline_a_plan_must_beat(tiny_target):
    """A GPU verifier prices decoding alone from its measured plain steps (a one-row forward
    runs another kernel than a few-row one there); a CPU one without borrowed cores keeps the
    planner's own model."""
    async def plain_tokens(device: str) -> Harness:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        va.scheduler.settings.device = device                   # the model stays on the CPU either way
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        async for _ in va.generate("p", list(range(3, 12)), params, {"mode": "off"}):
            pass
        return va

    threads = torch.get_num_threads()
    try:
        gpu = asyncio.run(asyncio.wait_for(plain_tokens("cuda"), 120))
        n, seconds = gpu.scheduler.costs.forward_by_rows[1]
        assert gpu.scheduler.costs.plain.observed and gpu.plain_step_s(1) is not None
        assert gpu.plain_step_s(1) < 3 * seconds / n + 0.01
        cpu = asyncio.run(asyncio.wait_for(plain_tokens("cpu"), 120))
        assert not cpu.scheduler.costs.plain.observed and cpu.plain_step_s(1) is None
    finally:
        torch.set_num_threads(threads)


def test_the_verifier_reports_its_processes_garbage_collector_pauses(tiny_target):
    import gc

    async def scenario():
        from verifier.loop import gc_report

        Harness(tiny_target, num_blocks=64, block_size=16, lookup=False)     # its loop times the collector

        before = gc_report()
        garbage = [[i] for i in range(200_000)]
        del garbage
        gc.collect()
        after = gc_report()
        assert after["gc_full_collections"] >= before["gc_full_collections"] + 1
        assert after["gc_s"] > before["gc_s"]

    run_restoring_threads(scenario())


def test_plans_assume_the_batch_refills_while_plain_steps_borrow(tiny_target, monkeypatch):
    """While plain steps borrow the drafters' cores, a plan counts the sequences the batch
    lost within the last REFILL_MEMORY_S as still there (decoding alone): a tree given in a
    dip between waves of requests would keep every step on the verifier's own threads while
    they join. Without borrowing, or once the memory has passed, plans see the batch as is."""
    import verifier.costs as va_mod

    threads = torch.get_num_threads()
    try:
        va = Harness(tiny_target, **{"num_blocks": 64, "block_size": 16, "lookup": False})
        va.scheduler.registry.node_id = "n1"
        asyncio.run(va.exchange(0, "d0", [], 0.0, node="n1", cpus=1.0))
        assert va.scheduler.costs.refilling(16, va.lendable_later()) == 0 and va.scheduler.costs.refilling(2, va.lendable_later()) == 0        # borrowing not measured yet
        for rows in (1, 1, 1, 4, 4, 4, 16, 16, 16):
            va.scheduler.costs.plain.observe_verify(rows, 0.03 + 0.005 * rows)     # both cores
        assert va.scheduler.costs.borrowing_measured(va.lendable_later())
        va.scheduler.costs._recent_rows.clear()
        assert va.scheduler.costs.refilling(16, va.lendable_later()) == 0
        assert va.scheduler.costs.refilling(2, va.lendable_later()) == 14                  # a dip: plan as if 16 were running
        # the planner, given those 14 as sequences decoding alone, keeps the two from speculating
        # where it would speculate for two alone (the verifier's own-thread cost is the model's)
        va.scheduler.adaptive.costs, va.scheduler.adaptive.bridges = va.scheduler.costs.overlap, False    # one tree in flight
        for rows in (2, 2, 2, 8, 8, 8, 17, 17, 17):
            va.scheduler.costs.overlap.observe_verify(rows, 0.04 + 0.011 * rows)   # our own thread
        for rid in ("a", "b"):
            va.scheduler.adaptive.add(rid, "auto", 3, 1)
            va.scheduler.adaptive.seqs[rid].attempts, va.scheduler.adaptive.seqs[rid].accepts = 10.0, 9.0   # γ 0.9
        alone = va.scheduler.adaptive.plan(["a", "b"], plain_step_s=va.plain_step_s(2))
        assert any(k for k, _ in alone.values())
        refilled = va.scheduler.adaptive.plan(["a", "b"], alone=14, plain_step_s=va.plain_step_s(16))
        assert not any(k for k, _ in refilled.values())
        monkeypatch.setattr(va_mod, "REFILL_MEMORY_S", 0.0)   # the memory has passed
        assert va.scheduler.costs.refilling(2, va.lendable_later()) == 0
        monkeypatch.setattr(va_mod, "REFILL_MEMORY_S", 1.0)
        va.scheduler.registry.drafters[0].node = "n2"   # no core to borrow: plans see the batch as is
        va.scheduler.costs._recent_rows.clear()
        va.scheduler.costs.refilling(16, va.lendable_later())
        assert va.scheduler.costs.refilling(2, va.lendable_later()) == 0
    finally:
        torch.set_num_threads(threads)


def test_a_drafter_is_told_whether_a_sampled_request_is_seeded(tiny_target):
    """A seeded request's params carry its seed (the drafter proposes under the target's noise and
    ships no q); an unseeded one's keep seed None and give the drafter its own `draft_seed`, a
    stream independent of the verifier's draws, so its trees carry the q the rejection sampler reads."""
    async def scenario():
        va = Harness(tiny_target, num_blocks=64, block_size=16, lookup=False)
        await va.exchange(0, "d0", [], 0.0)
        gens = [va.generate(rid, list(range(3, 12)), SamplingParams(temperature=1.0, seed=seed, max_tokens=4,
                                                                     ignore_eos=True), {"mode": "chain", "spec_len": 2})
                for rid, seed in (("seeded", 5), ("unseeded", None))]
        firsts = [asyncio.ensure_future(gen.__anext__()) for gen in gens]     # the requests go in
        joined = {}
        for _ in range(50):
            for s in await va.exchange(0, "d0", [], 0.0):
                if s.kind in ("join", "resync"):
                    joined[s.stream] = s.params
            if len(joined) == 2:
                break
            await asyncio.sleep(0.01)
        assert joined["seeded"]["seed"] == 5 and "draft_seed" not in joined["seeded"]
        assert joined["unseeded"]["seed"] is None and isinstance(joined["unseeded"]["draft_seed"], int)
        streams = {rid: DraftStream(rid, [1], 0, SamplingParams(**{k: v for k, v in p.items() if k != "draft_seed"}),
                                    p.get("draft_seed") or 0) for rid, p in joined.items()}
        assert streams["seeded"].params.coupled and not streams["unseeded"].params.coupled
        await asyncio.wait_for(asyncio.gather(*firsts), 30)
        for gen in gens:
            await asyncio.wait_for(gen.aclose(), 10)

    run_restoring_threads(scenario())
