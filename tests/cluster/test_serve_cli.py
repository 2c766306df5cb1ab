"""`specflash serve` as a person runs it (issue 26, item 7), in a subprocess: a partial config plus
`--api-key` serves with that key; a config this machine cannot place ends at once with the reason."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cluster.test_serve_shutdown import _free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "manifests" / "cluster.example.yaml"


def _serve(*argv: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SPECFLASH_API_KEY")}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--num-cpus", "2", *argv],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.slow
def test_a_serving_only_config_with_api_key_flag_serves_with_that_key(tmp_path):
    port, gport = _free_port(), _free_port()
    config = tmp_path / "serving.yaml"
    config.write_text(f"serving:\n  port: {port}\n  grpc_port: {gport}\n  max_queue: 8\n")
    log = tmp_path / "serve.log"
    proc = _serve("--config", str(config), "--engine", "fake", "--api-key", "sk-local-1", log=log)
    try:
        wait_serving(proc, log)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        ok = httpx.get(f"{url}/v1/models", timeout=30, headers={"Authorization": "Bearer sk-local-1"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "specflash"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200     # probes stay open
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)


@pytest.mark.slow
def test_a_config_asking_for_gpus_this_machine_lacks_fails_fast(tmp_path):
    """The example config asks for GPUs and custom resources no local Ray has: it ends with what is
    missing, in well under the time Ray would spend retrying, instead of never becoming healthy."""
    log = tmp_path / "serve.log"
    start = time.monotonic()
    proc = _serve("--config", str(EXAMPLE), "--port", str(_free_port()), "--grpc-port", str(_free_port()),
                  log=log)
    try:
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert code == 1, text[-3000:]
    error = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, text[-3000:]
    assert "placement.verifier asks for CPU=8, GPU=1, specflash_verifier=1" in error[0]
    assert "This local Ray cannot grow" in error[0] and "GetTimeoutError" not in text
    assert time.monotonic() - start < 180
