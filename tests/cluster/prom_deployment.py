"""The Prometheus test's deployment, in a process of its own (tests/cluster/test_prometheus.py;
the session-affinity test's too): two ingress replicas on a local Ray whose metrics agent listens
on a known port. A test session already holds a shared Ray cluster in its own process, and a Ray
started with a metrics export port cannot join it, so this runs apart:

    python -m tests.cluster.prom_deployment METRICS_PORT HTTP_PORT [APP_ARGS_JSON]

(APP_ARGS_JSON: app args over the defaults here, block by block) prints "ready" once Serve
answers, then serves until SIGTERM (which shuts Serve and Ray down). `running` does that from a
test."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def running(folder: Path, app_args: dict | None = None):
    """The deployment in a child process, its log in `folder`: yields (HTTP URL, metrics target)."""
    from tests.cluster.test_serve_shutdown import _free_port

    metrics_port, http_port = _free_port(), _free_port()
    log = open(folder / "deployment.log", "w+")
    argv = [sys.executable, "-m", "tests.cluster.prom_deployment", str(metrics_port), str(http_port),
            json.dumps(app_args or {})]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                          os.environ.get("PYTHONPATH")]))})
    try:
        line = proc.stdout.readline()         # "ready", or "" if it died
        if line.strip() != "ready":
            log.seek(0)
            raise AssertionError(f"the deployment did not start:\n{log.read()[-3000:]}")
        yield f"http://127.0.0.1:{http_port}", f"127.0.0.1:{metrics_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main(metrics_port: int, http_port: int, extra: dict | None = None) -> None:
    import ray
    from ray import serve

    from cluster.serve_app import build_app

    os.environ["RAY_metrics_report_interval_ms"] = "1000"
    env = {"SPECFLASH_METRICS_PERIOD_S": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port,
             runtime_env={"env_vars": env})
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        args = {"engine": "tests.cluster.prom_engine:make", "serving": {"max_queue": 2},
                "verifier_scaling": {"min_replicas": 2, "max_replicas": 2, "policy": None}}
        for key, value in (extra or {}).items():
            args[key] = {**args[key], **value} if isinstance(value, dict) and key in args else value
        serve.run(build_app(args), name="specflash", route_prefix="/")
        print("ready", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
