"""An engine for the session-affinity test: `serving.testing.FakeEngine` answering every request
with the id of the replica that serves it. `engine: tests.cluster.affinity_engine:make`."""
from __future__ import annotations

from serving.testing import FakeEngine, tiny_byte_tokenizer


def make(app_args):
    """(engine, tokenizer, max_context), as `cluster.serve_app.make_engine` wants of a factory."""
    from ray import serve

    tokenizer = tiny_byte_tokenizer()
    replica = list(tokenizer.encode(serve.get_replica_context().replica_tag))
    return FakeEngine(lambda request: replica, tokenizer=tokenizer), tokenizer, 2048
