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
        va = VerifierActor(str(tiny_target), {"num_blocks": 64, "block_size": 16})
        await va.exchange(0, "d0", [], 0.0)                              # a drafter attaches
        va.adaptive.plan = lambda streams, drafter_ok=True: {s: (0, 0) for s in streams}   # held off
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
        va.adaptive.plan = lambda streams, drafter_ok=True: {s: (2, 1) for s in streams}
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
