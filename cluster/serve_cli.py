"""`specflash serve`: start (or join) Ray, deploy the Serve app, serve until interrupted.

    specflash serve [--target DIR] [--draft DIR] [--host H] [--port P] [--grpc-port P]
                    [--config FILE] [--engine auto|pipeline|local|fake] [--model-name NAME]
                    [--api-key KEY | --api-key-file FILE] [--max-queue N] [--request-timeout S]
                    [--spec-mode off|chain|tree|auto] [--spec-len K]

Without --target it serves the embedded default pair (`models.embedded`). `--config` may be
partial (only a `serving:` block, say): what it leaves out comes from the local defaults, and
each flag overrides the config field it names (FLAG_FIELDS). A wrong config or flag ends with one
plain sentence per field; a config asking for resources no node of a local Ray has (GPUs on a
machine without them) ends at once with what is missing, instead of waiting forever. With
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
    p.add_argument("--config", metavar="FILE",
                   help="ClusterConfig YAML, possibly partial (e.g. only a `serving:` block): the blocks it "
                        "leaves out come from the local defaults")
    p.add_argument("--engine", help="auto | pipeline | local | fake | module:factory (default: the config's, auto)")
    p.add_argument("--model-name", help="the model id clients send (default: the config's, specflash)")
    p.add_argument("--api-key", metavar="KEY",
                   help="clients must send `Authorization: Bearer KEY` (or set SPECFLASH_API_KEY); "
                        "on a cluster prefer serving.api_key_env / api_key_file from a Secret")
    p.add_argument("--api-key-file", metavar="FILE", help="file holding the API key(s), one per line")
    p.add_argument("--max-queue", type=int, metavar="N", help="requests waiting before 429/503 (default 256)")
    p.add_argument("--request-timeout", type=float, metavar="S", help="abort a request running longer (default 600)")
    p.add_argument("--spec-mode", choices=("off", "chain", "tree", "auto"), help="server default speculation")
    p.add_argument("--spec-len", type=int, metavar="K", help="draft chain length / tree depth")
    p.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                   help="on SIGTERM / Ctrl-C, let in-flight requests finish for S seconds "
                        "(default: the config's serving.drain_timeout_s, 30)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a locally started Ray")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="automatic prefix caching (the config's kv_cache.prefix_caching; default off)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill prompts N tokens at a time between other streams' steps (kv_cache.prefill_chunk)")
    p.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="tokens a streamed chunk carries at least; the first and last go at once (serving.stream_interval)")
    p.add_argument("--session-affinity", action=argparse.BooleanOptionalAction, default=None,
                   help="keep requests with the same X-Session-Id header on one replica (serving.session_affinity)")
    p.add_argument("--ready-timeout", type=float, default=900.0, metavar="S",
                   help="give up if the app does not answer /health within S seconds")


# flag -> the config field it sets (dotted); a flag left out keeps the config's value
FLAG_FIELDS = {"host": "serving.host", "port": "serving.port", "grpc_port": "serving.grpc_port",
               "drain_timeout": "serving.drain_timeout_s", "max_queue": "serving.max_queue",
               "request_timeout": "serving.request_timeout_s", "api_key_file": "serving.api_key_file",
               "engine": "engine", "model_name": "model_name", "spec_mode": "speculation.mode",
               "prefix_caching": "kv_cache.prefix_caching", "prefill_chunk": "kv_cache.prefill_chunk",
               "spec_len": "speculation.spec_len", "session_affinity": "serving.session_affinity",
               "stream_interval": "serving.stream_interval"}
API_KEY_ENV = "SPECFLASH_API_KEY"  # where `--api-key` puts the key for the replicas (a job env var)


def app_args_from(args) -> dict:
    """The Serve app's args: the config (layered over the local defaults) with the flags applied;
    a `ConfigError` naming each wrong field (flags by their config field) if the result is invalid."""
    from cluster.config import ClusterConfig, explain
    from pydantic import ValidationError
    from serving.grpc_service import GENERATED_SERVICER_FUNCTION, SERVICER_FUNCTION

    cfg = ClusterConfig.from_yaml(args.config, layered=True) if args.config else ClusterConfig.local_default()
    data = cfg.model_dump(mode="json")
    if args.target is not None:
        data["models"]["target"], data["models"]["draft"] = args.target, args.draft
    elif args.draft is not None:
        raise ValueError("--draft needs --target (the embedded pair is all-or-nothing)")
    for flag, dotted in FLAG_FIELDS.items():
        if getattr(args, flag, None) is not None:
            *path, last = dotted.split(".")
            _at(data, path)[last] = getattr(args, flag)
    if getattr(args, "api_key", None) is not None or getattr(args, "api_key_file", None) is not None:
        env = API_KEY_ENV if getattr(args, "api_key", None) is not None else None
        data["serving"]["api_key_env"], data["serving"]["api_key_file"] = env, args.api_key_file
    try:
        cfg = ClusterConfig.model_validate(data)
    except ValidationError as e:
        source = f"{args.config} with the command-line flags" if args.config else "the command-line flags"
        raise explain(e, ClusterConfig, source) from None
    data = cfg.app_args()
    servicers = [f for f in data["serving"]["grpc_servicer_functions"]
                 if f != GENERATED_SERVICER_FUNCTION]  # the same service, minus malformed-input care
    data["serving"]["grpc_servicer_functions"] = servicers + [SERVICER_FUNCTION] * (
        SERVICER_FUNCTION not in servicers)
    return data


def job_env(args) -> dict[str, str]:
    """Environment variables every replica gets (through Ray's job runtime_env): the `--api-key`."""
    if getattr(args, "api_key", None) is None:
        return {}
    if not args.api_key.strip():
        raise ValueError("--api-key is empty")
    return {API_KEY_ENV: args.api_key}


def _at(data: dict, path: list[str]) -> dict:
    for key in path:
        data = data[key]
    return data


def check_placeable(app_args, nodes: list[dict[str, float]], joined: bool) -> None:
    """Stop with the reason when no node can host an actor the config asks for (a local Ray never
    grows, so Ray would keep it pending forever) or a checkpoint is not on this machine; on a joined
    cluster only warn: its autoscaler may add such a node, and the checkpoints live on its nodes."""
    problems = app_args.placement.unplaceable(nodes, pipeline=app_args.engine in ("auto", "pipeline"))
    if joined:
        if problems:
            print("specflash: warning: " + "; ".join(problems) + "; waiting for Ray's autoscaler to add "
                  "such a node", file=sys.stderr, flush=True)
        return
    if problems:
        problems[-1] += (". This local Ray cannot grow: run it where those resources are (RAY_ADDRESS, or "
                         "the manifests), or lower placement.* in the config (e.g. num_gpus: 0 and no "
                         "custom resources on a machine without GPUs)")
    for side in ("target", "draft") if app_args.engine != "fake" else ():
        path = getattr(app_args.models, side)
        if path is not None and not os.path.isdir(path):
            problems.append(f"models.{side} {path!r} is not a checkpoint directory on this machine")
    if problems:
        raise RuntimeError("; ".join(problems))


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
        env = job_env(args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    import ray
    from ray import serve

    s = app_args.serving
    joined = bool(os.environ.get("RAY_ADDRESS"))
    try:
        _init_ray(joined, args.num_cpus, env)
    except Exception as e:
        print(f"error: cannot start or join Ray: {e}", file=sys.stderr)
        return EXIT_ERROR
    stop = _Stop()  # after ray.init, which installs its own SIGTERM handler in the driver
    try:
        check_placeable(app_args, [n["Resources"] for n in ray.nodes() if n["Alive"]], joined)
        serve.start(http_options={"host": s.host, "port": s.port},
                    grpc_options={"port": s.grpc_port,
                                  "grpc_servicer_functions": s.grpc_servicer_functions})
        serve.run(build_app(data), name=APP_NAME, route_prefix="/", blocking=False)
        host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
        url = f"http://{host}:{s.port}"
        health = wait_healthy(url, args.ready_timeout, alive=lambda: not stop.event.is_set())
        print(f"specflash serving {app_args.model_name!r} at {url}/v1 (OpenAI-compatible), "
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


def _init_ray(joined: bool, num_cpus: int | None, env: dict[str, str], attempts: int = 3) -> None:
    """Join RAY_ADDRESS, or start a local Ray; a local start that times out on an
    overloaded machine (GCS slow to answer) is retried after a clean shutdown. `env` becomes the
    job's runtime_env, which the Serve replicas `serve.run` starts inherit."""
    import ray

    runtime_env = {"env_vars": env} if env else None
    if joined:
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
        return
    for attempt in range(attempts):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env)
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
