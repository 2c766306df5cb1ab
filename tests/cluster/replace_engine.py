"""An engine for the replica-replacement test (tests/cluster/test_replica_replacement.py):
`serving.testing.FakeEngine` answering every request with the id of the replica that serves it.
The first replica made claims `<SPECFLASH_TEST_REPLACE_DIR>/doomed`; once the test creates
`<dir>/lose` it reports what a pipeline engine reports when its verifier's node is gone and Ray
has not placed it again for longer than the replica's grace (the `health()` of
cluster/pipeline.py), and fails requests with the verifier-died error. Replicas made after it
stay healthy. `engine: tests.cluster.replace_engine:make`."""
from __future__ import annotations

import os
from pathlib import Path

from cluster.serve_app import VERIFIER_RESTART_GRACE_S
from serving.testing import FakeEngine, tiny_byte_tokenizer

LOST_FOR_S = 2 * VERIFIER_RESTART_GRACE_S     # down past the grace: the replica must be replaced


class LosesItsVerifier(FakeEngine):
    def __init__(self, folder: Path, doomed: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.folder, self.doomed = folder, doomed

    def _lost(self) -> bool:
        return self.doomed and (self.folder / "lose").exists()

    async def generate(self, request):
        from cluster.pipeline import RETRYABLE, VERIFIER_DIED

        self.fail_with = RETRYABLE + VERIFIER_DIED if self._lost() else None
        async for chunk in super().generate(request):
            yield chunk

    async def health(self) -> dict:
        if not self._lost():
            return await super().health()
        verifier = "verifier: lost node n1 at 2026-12-03T00:00:00Z"
        return {"ok": False, "down_for_s": LOST_FOR_S, "verifier": verifier,
                "pipelines": [{"ok": False, "down_for_s": LOST_FOR_S, "verifier": verifier}]}


def make(app_args):
    """(engine, tokenizer, max_context), as `cluster.serve_app.make_engine` wants of a factory."""
    from ray import serve

    folder = Path(os.environ["SPECFLASH_TEST_REPLACE_DIR"])
    tag = serve.get_replica_context().replica_tag
    try:
        fd = os.open(folder / "doomed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        doomed = False
    else:
        os.write(fd, tag.encode())
        os.close(fd)
        doomed = True
    tokenizer = tiny_byte_tokenizer()
    answer = list(tokenizer.encode(tag))
    return LosesItsVerifier(folder, doomed, script=lambda request: answer, tokenizer=tokenizer), tokenizer, 2048
