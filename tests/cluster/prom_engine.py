"""An engine for the real-Prometheus test: `serving.testing.FakeEngine`'s answers, with stats of the
pipeline's shape (a real `SpecStats` that grows as it serves, one drafter, KV and ring levels), so
every dashboard query and alert has a series to read. `engine: tests.cluster.prom_engine:make`."""
from __future__ import annotations

from serving.testing import FakeEngine, tiny_byte_tokenizer
from speculation.stats import SpecStats


class SpeculatingFakeEngine(FakeEngine):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.spec, self.drafter = SpecStats(), SpecStats()

    async def stats(self) -> dict:
        s, d = self.spec, self.drafter
        for _ in range(3):   # as if three sequence-steps were verified since the last look
            s.observe_verification(num_nodes=4, num_accepted=2, max_depth=4, accepted_depth=2)
            s.observe_speculation(True)
        s.observe_speculation(False)
        s.observe_batch(0.03), s.observe_idle(0.01), s.observe_wall(0.05), s.observe_ring(1, 2)
        d.observe_drafted(4)
        d.resets += 1
        out = {**await super().stats(), **s.as_dict()}   # the ratios of these counts, not the fake's constants
        out["mean_accepted_length"] = out.pop("mean_accepted_len")
        out.update(kv_blocks_total=self.num_kv_blocks, drafters_alive=1, speculation_enabled=1,
                   drafters=[{"index": 0, **d.as_dict()}])
        return out


def make(app_args):
    """(engine, tokenizer, max_context), as `cluster.serve_app.make_engine` wants of a factory."""
    tokenizer = tiny_byte_tokenizer()
    return SpeculatingFakeEngine(tokenizer=tokenizer, delay_s=0.01), tokenizer, 2048
