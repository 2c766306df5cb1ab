"""Graceful shutdown of `specflash serve` (issue 7): SIGTERM with a stream in flight drains it
(`specflash serve --engine fake` in a subprocess). The drain itself, in process over the
FakeEngine, is tested in tests/serving/test_shutdown.py."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.serving.test_shutdown import events

ROOT = Path(__file__).resolve().parents[2]


# ---- `specflash serve --engine fake`, SIGTERM with a stream in flight --------------------------
def _free_port() -> int:
    """A free port outside both Linux's ephemeral range (32768-60999), where every `bind(0)` of a
    Ray starting meanwhile lands, and Ray's worker ports (10002-19999): a port from `bind(0)` was
    taken by the Ray of the `specflash serve` it was meant for before Serve could bind it."""
    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def wait_serving(proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> None:
    """Until `specflash serve` (writing to `log`) prints its URL; fails with the log's tail if it exits."""
    deadline = time.monotonic() + timeout_s
    while "specflash serving" not in log.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_sigterm_to_specflash_serve_drains_a_stream_in_flight(tmp_path):
    port, gport = _free_port(), _free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--engine", "fake", "--port", str(port),
           "--grpc-port", str(gport), "--drain-timeout", "1", "--num-cpus", "2"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_serving(proc, log)
        url = f"http://127.0.0.1:{port}"
        # the fake engine sends 3 tokens every 10 ms: ~1.6 s for this stream, past the 1 s drain
        body = {"prompt": "hi", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            stream = r.iter_text()
            pieces = [next(stream)]                  # in flight
            proc.send_signal(signal.SIGTERM)
            pieces += list(stream)
        chunks = events("".join(pieces))
        last = chunks[-1]
        assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length"), last
        if "error" in last:
            assert last["error"]["code"] == "server_shutting_down"
        assert proc.wait(120) == 0
        text = log.read_text(errors="replace")
        assert "specflash: drained" in text and "'in_flight': 1" in text, text[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
