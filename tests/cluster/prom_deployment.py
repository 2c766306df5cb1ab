"""The Prometheus test's deployment, in a process of its own (tests/cluster/test_prometheus.py):
two ingress replicas on a local Ray whose metrics agent listens on a known port. A test session
already holds a shared Ray cluster in its own process, and a Ray started with a metrics export
port cannot join it, so this runs apart:

    python -m tests.cluster.prom_deployment METRICS_PORT HTTP_PORT

prints "ready" once Serve answers, then serves until SIGTERM (which shuts Serve and Ray down)."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(metrics_port: int, http_port: int) -> None:
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
        serve.run(build_app(args), name="specflash", route_prefix="/")
        print("ready", flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
