"""`specflash serve`: start (or join) Ray, deploy the Serve app, serve until interrupted.

    specflash serve [--target DIR] [--draft DIR] [--host H] [--port P] [--grpc-port P]
                    [--config FILE] [--engine auto|pipeline|local|fake] [--model-name NAME]

Without --target it serves the embedded default pair (`models.embedded`). With
`RAY_ADDRESS` set it deploys onto that cluster and, on exit, deletes only its
own application; otherwise it starts a local Ray and shuts it down on exit.
The URL is printed once `/health` answers 200. Ctrl-C or SIGTERM drains, then
shuts down: every ingress replica stops admitting (503 with Retry-After, /health
"draining"), in-flight requests get `--drain-timeout` seconds to finish, the rest
end with a clear error (a stream: an error event, then [DONE]); a second signal
skips the wait. Until `cluster/cli.py` registers it, `python -m cluster.serve_cli ...`
runs the same command.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

APP_NAME = "specflash"
EXIT_ERROR = 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible API and gRPC on Ray Serve",
                              description="Serve a target/draft pair over HTTP (OpenAI-compatible) "
                                          "and gRPC on Ray Serve, until interrupted.")
    _add_arguments(p)
    p.set_defaults(func=run)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", metavar="DIR", help="target HF checkpoint directory (default: embedded)")
    p.add_argument("--draft", metavar="DIR", help="draft HF checkpoint directory (default: embedded)")
    p.add_argument("--host", help="HTTP bind address (default: the config's, 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default: the config's, 8000)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default: the config's, 9000)")
    p.add_argument("--config", metavar="FILE", help="ClusterConfig YAML (default: local defaults)")
    p.add_argument("--engine", default="auto", help="auto | pipeline | local | fake | module:factory")
    p.add_argument("--model-name", default="specflash", help="the model id clients send")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="on SIGTERM / Ctrl-C, let in-flight requests finish for S seconds "
                        "(default: the config's serving.drain_timeout_s, 30)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a locally started Ray")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching (the config's kv_cache.prefix_caching; default off)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill prompts N tokens at a time between other streams' steps (kv_cache.prefill_chunk)")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="give up if the app does not answer /health within S seconds")


def app_args_from(args) -> dict:
    """The Serve app's args: the config (or local defaults) with the flags applied."""
    from cluster.config import ClusterConfig
    from serving.grpc_service import GENERATED_SERVICER_FUNCTION, SERVICER_FUNCTION

    cfg = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig.local_default()
    data = cfg.app_args()
    if args.target is not None:
        data["models"]["target"], data["models"]["draft"] = args.target, args.draft
    elif args.draft is not None:
        raise ValueError("--draft needs --target (the embedded pair is all-or-nothing)")
    for flag, key in (("host", "host"), ("port", "port"), ("grpc_port", "grpc_port"),
                      ("drain_timeout", "drain_timeout_s")):
        if getattr(args, flag) is not None:
            data["serving"][key] = getattr(args, flag)
    for flag in ("prefix_caching", "prefill_chunk"):
        if getattr(args, flag, None) is not None:
            data["kv_cache"][flag] = getattr(args, flag)
    servicers = [f for f in data["serving"]["grpc_servicer_functions"]
                 if f != GENERATED_SERVICER_FUNCTION]  # the same service, minus malformed-input care
    data["serving"]["grpc_servicer_functions"] = servicers + [SERVICER_FUNCTION] * (
        SERVICER_FUNCTION not in servicers)
    data["engine"], data["model_name"] = args.engine, args.model_name
    return data


def wait_healthy(url: str, timeout_s: float, alive=lambda: True) -> dict:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline and alive():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return json.loads(r.read())
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:.0f} s ({last})")


class _Stop:
    """Set by SIGINT / SIGTERM; the main thread waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set():  # the second signal: stop waiting for the drain
            raise KeyboardInterrupt
        self.event.set()


def run(args) -> int:
    from cluster.serve_app import build_app, split_args

    try:
        data = app_args_from(args)
        if data["models"]["target"] is None and data["engine"] != "fake":
            data["models"]["target"], data["models"]["draft"] = _embedded_pair()
        app_args, _ = split_args(data)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    import ray
    from ray import serve

    s = app_args.serving
    joined = bool(os.environ.get("RAY_ADDRESS"))
    try:
        _init_ray(joined, args.num_cpus)
    except Exception as e:
        print(f"error: cannot start or join Ray: {e}", file=sys.stderr)
        return EXIT_ERROR
    stop = _Stop()  # after ray.init, which installs its own SIGTERM handler in the driver
    try:
        serve.start(http_options={"host": s.host, "port": s.port},
                    grpc_options={"port": s.grpc_port,
                                  "grpc_servicer_functions": s.grpc_servicer_functions})
        serve.run(build_app(data), name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
        url = f"http://{host}:{s.port}"
        health = wait_healthy(url, args.ready_timeout, alive=lambda: not stop.event.is_set())
        print(f"specflash serving {args.model_name!r} at {url}/v1 (OpenAI-compatible), "
              f"gRPC on {host}:{s.grpc_port}; speculation "
              f"{'on' if health.get('speculation') else 'off'}. Ctrl-C to stop.", flush=True)
        stop.event.wait()
        print(f"specflash: draining (up to {s.drain_timeout_s:g} s; signal again to skip)", flush=True)
        try:
            print(f"specflash: drained {drain(s.drain_timeout_s)}", flush=True)
        except KeyboardInterrupt:
            pass
        except Exception as e:  # shutting down anyway
            print(f"specflash: drain failed: {e!r}", file=sys.stderr, flush=True)
        print("specflash: shutting down", flush=True)
        return 0
    except (TimeoutError, RuntimeError) as e:  # RuntimeError: Serve could not deploy the app
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        _shutdown(joined)


def drain(timeout_s: float) -> list[dict]:
    """`SpecflashIngress.drain` on every running replica of the app; their reports.

    A handle routes each call to some replica, so calls go out until every replica has
    answered (each drain after the first returns at once)."""
    from ray import serve

    from cluster.config import INGRESS_DEPLOYMENT

    status = serve.status().applications[APP_NAME].deployments[INGRESS_DEPLOYMENT]
    replicas = max(1, status.replica_states.get("RUNNING", 0))
    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME)
    reports: dict[str, dict] = {}
    for _ in range(4 * replicas):
        calls = [handle.drain.remote(timeout_s) for _ in range(replicas - len(reports))]
        for call in calls:
            report = call.result(timeout_s=timeout_s + 30)
            reports[report["replica"]] = report
        if len(reports) >= replicas:
            break
    return list(reports.values())


def _embedded_pair() -> tuple[str, str]:
    """The embedded default pair, built here (once, with progress) rather than in a replica."""
    from models import embedded

    try:
        target, draft = embedded.default_pair()
    except embedded.EmbeddedModelError as e:
        raise RuntimeError(f"the embedded model pair is not available: {e}; "
                           "name a checkpoint with --target/--draft") from e
    return str(target), str(draft)


def _init_ray(joined: bool, num_cpus: int | None, attempts: int = 3) -> None:
    """Join RAY_ADDRESS, or start a local Ray; a local start that times out on an
    overloaded machine (GCS slow to answer) is retried after a clean shutdown."""
    import ray

    if joined:
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
            return
        except Exception as e:
            ray.shutdown()
            if attempt == attempts - 1 or "timed out" not in str(e):
                raise
            print(f"specflash: Ray start failed ({e}); retrying", file=sys.stderr, flush=True)


def _shutdown(joined: bool) -> None:
    import ray
    from ray import serve

    try:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    except Exception as e:  # shutting down anyway
        print(f"specflash: serve shutdown: {e!r}", file=sys.stderr)
    ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.serve_cli", description=__doc__.split("\n\n")[0])
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
