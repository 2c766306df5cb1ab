"""Session affinity (serving.session_affinity, cluster/serve_app.py): on a two-replica deployment
every request of one `X-Session-Id` reaches the same replica, whose prefix cache holds the
conversation; different sessions spread over both replicas."""
from __future__ import annotations

import httpx
import pytest

from tests.cluster.prom_deployment import running


def served_by(client: httpx.Client, url: str, session: str | None) -> str:
    """The replica that answered (tests/cluster/affinity_engine.py answers with its id)."""
    headers = {} if session is None else {"X-Session-Id": session}
    r = client.post(f"{url}/v1/completions", headers=headers,
                    json={"model": "specflash", "prompt": "hi", "max_tokens": 200})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_a_session_stays_on_one_replica_and_sessions_spread(tmp_path):
    args = {"engine": "tests.cluster.affinity_engine:make", "serving": {"session_affinity": True, "max_queue": 64}}
    with running(tmp_path, args) as (url, _), httpx.Client(timeout=60) as client:
        sessions = {f"conversation-{i}": [served_by(client, url, f"conversation-{i}") for _ in range(4)]
                    for i in range(16)}
    assert all(len(set(replicas)) == 1 for replicas in sessions.values()), sessions
    # 16 sessions on two replicas all hashed to one: chance 2^-15
    assert len({replicas[0] for replicas in sessions.values()}) == 2, sessions
