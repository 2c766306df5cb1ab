"""Can a Ray compiled graph carry the drafter-verifier exchange? Its speed, and its faults.

    python bench/cgraph_probe.py                  # ~1 minute on a local Ray
    python bench/cgraph_probe.py --rounds 1000 --out cgraph.json

The pipeline's exchange is a drafter calling its verifier once a step (cluster/transport.py).
A compiled graph built from the drafter to the verifier (one node, the verifier's method bound
to the input) replaces the call with shared-memory channels. This probe has the shapes of our
actors: a threaded "drafter" actor compiles the graph to an asyncio "verifier" actor, whose
graph method hands each call to its event loop. It measures the median round trip of a small
message through both paths (`--rounds` each), then asks what the pipeline's faults need: the
drafter that compiled the graph is killed, a new drafter compiles a graph to the same verifier,
and the probe reports whether that graph runs and whether the verifier still answers a plain
call. Prints a line per finding; `--out` writes them as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)


def actors():
    import ray
    from ray.dag import InputNode

    @ray.remote(max_concurrency=16)
    class Verifier:
        async def ready(self) -> bool:
            self.loop = asyncio.get_running_loop()
            return True

        def graph_exchange(self, msg):           # on the graph's thread: hand it to our event loop
            return asyncio.run_coroutine_threadsafe(self.exchange(msg), self.loop).result()

        async def exchange(self, msg):
            return msg

    @ray.remote(max_concurrency=4)
    class Drafter:
        def compile(self, verifier) -> bool:
            with InputNode() as inp:
                dag = verifier.graph_exchange.bind(inp)
            self.graph, self.verifier = dag.experimental_compile(), verifier
            return True

        def round_trips(self, rounds: int, graph: bool, timeout_s: float = 30.0) -> float:
            msg, times = (b"header", list(range(16))), []
            for _ in range(rounds):
                start = time.perf_counter()
                if graph:
                    ray.get(self.graph.execute(msg), timeout=timeout_s)
                else:
                    ray.get(self.verifier.exchange.remote(msg), timeout=timeout_s)
                times.append(time.perf_counter() - start)
            return 1e3 * sorted(times)[len(times) // 2]

    return Verifier, Drafter


def probe(rounds: int) -> dict:
    import ray

    Verifier, Drafter = actors()
    out = {}
    verifier = Verifier.remote()
    ray.get(verifier.ready.remote())
    first = Drafter.remote()
    ray.get(first.compile.remote(verifier), timeout=120)
    out["graph_round_trip_ms"] = ray.get(first.round_trips.remote(rounds, True))
    out["call_round_trip_ms"] = ray.get(first.round_trips.remote(rounds, False))
    ray.kill(first)                               # the graph's compiling process dies
    time.sleep(2.0)
    out["verifier_answers_after_the_death"] = _answers(verifier)
    second = Drafter.remote()
    try:
        ray.get(second.compile.remote(verifier), timeout=120)
        ray.get(second.round_trips.remote(1, True, 20.0), timeout=60)
        out["second_graph"] = "runs"
    except Exception as e:                        # what Ray 2.60 did here: see the module doc
        out["second_graph"] = f"fails: {type(e).__name__}"
    out["verifier_answers_after_the_second_graph"] = _answers(verifier)
    return out


def _answers(verifier) -> bool:
    import ray

    try:
        ray.get(verifier.exchange.remote(1), timeout=20)
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=common.positive_int, default=300, help="round trips per path")
    p.add_argument("--out", type=Path, help="write the findings as JSON here")
    args = p.parse_args(argv)
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        found = probe(args.rounds)
    finally:
        ray.shutdown()
    for k, v in found.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    if args.out:
        common.write_json(args.out, {"date": common.utc(), "machine": common.machine(), "ray": ray.__version__,
                                     "rounds": args.rounds, **found})
    return 0


if __name__ == "__main__":
    sys.exit(main())
