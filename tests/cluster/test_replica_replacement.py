"""Serve replaces a replica whose verifier is gone for good (cluster/serve_app.py,
`replace_replica` behind the ingress's `check_health`): the replica's /health says why, its
requests fail with the retryable 503, Serve's health check fails, Serve starts a new replica,
and the deployment serves again from it. The engine (tests/cluster/replace_engine.py) reports
what the pipeline engine's `health()` reports in that state; that the pipeline engine reports it
when its verifier's node dies is tested in tests/cluster/test_chaos.py."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.cluster.prom_deployment import running


def answer(client: httpx.Client, url: str) -> httpx.Response:
    return client.post(f"{url}/v1/completions", json={"model": "specflash", "prompt": "hi", "max_tokens": 200})


@pytest.mark.slow
def test_serve_replaces_a_replica_whose_verifier_is_lost_for_good(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFLASH_TEST_REPLACE_DIR", str(tmp_path))
    args = {"engine": "tests.cluster.replace_engine:make",
            "verifier_scaling": {"min_replicas": 1, "max_replicas": 1, "policy": None}}
    with running(tmp_path, args) as (url, _), httpx.Client(timeout=30) as client:
        first = answer(client, url)
        assert first.status_code == 200, first.text
        doomed = (tmp_path / "doomed").read_text()
        assert first.json()["choices"][0]["text"] == doomed
        assert client.get(f"{url}/health").status_code == 200

        (tmp_path / "lose").touch()
        health = client.get(f"{url}/health")
        assert health.status_code == 503 and "lost node n1" in health.text, health.text
        failed = answer(client, url)
        assert failed.status_code == 503 and "verifier" in failed.text, failed.text

        deadline, served_by = time.monotonic() + 150, None
        while time.monotonic() < deadline:
            r = answer(client, url)
            if r.status_code == 200:
                served_by = r.json()["choices"][0]["text"]
                break
            assert r.status_code == 503, r.text    # while Serve replaces it: the clear retryable error
            time.sleep(1.0)
        assert served_by is not None, f"Serve did not replace the replica:\n{(tmp_path / 'deployment.log').read_text()[-3000:]}"
        assert served_by != doomed
        assert client.get(f"{url}/health").status_code == 200
