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
call. It then tries Ray's channel API without a graph (`ray.experimental.channel`): the drafter
writes each message into a shared-memory channel the verifier's thread reads, the reply comes
back through a second channel; it measures that round trip, kills the drafter, reports what the
verifier's reader saw, and connects a second drafter the same way. Prints a line per finding;
`--out` writes them as JSON.
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
    """(Verifier, Drafter): the probe's two actor classes."""
    import ray

    @ray.remote(max_concurrency=16)
    class Verifier:
        async def ready(self) -> bool:
            self.loop = asyncio.get_running_loop()
            return True

        def graph_exchange(self, msg):           # on the graph's thread: hand it to our event loop
            return asyncio.run_coroutine_threadsafe(self.exchange(msg), self.loop).result()

        async def exchange(self, msg):
            return msg

        async def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def open_channel(self, req, drafter, node: str):
            """Serve `req` (drafter -> us) on a thread, answering through a new channel (us -> drafter)."""
            import threading

            from ray.experimental.channel.shared_memory_channel import Channel

            resp = Channel(ray.get_runtime_context().current_actor, [(drafter, node)])
            req.ensure_registered_as_reader()
            resp.ensure_registered_as_writer()
            self.reader_end = None
            threading.Thread(target=self._serve, args=(req, resp), daemon=True).start()
            return resp

        def _serve(self, req, resp) -> None:
            while True:
                try:
                    msg = req.read(timeout=1.0)
                except ray.exceptions.RayChannelTimeoutError:
                    continue                      # an idle writer: keep reading
                except Exception as e:            # the writer's end is gone
                    self.reader_end = type(e).__name__
                    return
                resp.write(asyncio.run_coroutine_threadsafe(self.exchange(msg), self.loop).result())

        async def channel_state(self):
            return self.reader_end

    return Verifier, drafter_class()


def drafter_class():
    import ray
    from ray.dag import InputNode

    @ray.remote(max_concurrency=4)
    class Drafter:
        def compile(self, verifier) -> bool:
            with InputNode() as inp:
                dag = verifier.graph_exchange.bind(inp)
            self.graph, self.verifier = dag.experimental_compile(), verifier
            return True

        def connect(self, verifier) -> bool:
            from ray.experimental.channel.shared_memory_channel import Channel

            ctx = ray.get_runtime_context()
            node = ray.get(verifier.node.remote())
            self.req = Channel(ctx.current_actor, [(verifier, node)])
            self.resp = ray.get(verifier.open_channel.remote(self.req, ctx.current_actor, ctx.get_node_id()))
            self.req.ensure_registered_as_writer()
            self.resp.ensure_registered_as_reader()
            self.verifier = verifier
            return True

        def round_trips(self, rounds: int, graph: bool | str, timeout_s: float = 30.0) -> float:
            msg, times = (b"header", list(range(16))), []
            for _ in range(rounds):
                start = time.perf_counter()
                if graph == "channel":
                    self.req.write(msg, timeout=timeout_s)
                    self.resp.read(timeout=timeout_s)
                elif graph:
                    ray.get(self.graph.execute(msg), timeout=timeout_s)
                else:
                    ray.get(self.verifier.exchange.remote(msg), timeout=timeout_s)
                times.append(time.perf_counter() - start)
            return 1e3 * sorted(times)[len(times) // 2]

    return Drafter


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
    out.update(channel_probe(Verifier, Drafter, rounds))
    return out


def channel_probe(Verifier, Drafter, rounds: int) -> dict:
    """Channels without a graph, on a fresh verifier: the round trip, then a drafter's death and a
    second drafter connecting the same way."""
    import ray

    out = {}
    verifier = Verifier.remote()
    ray.get(verifier.ready.remote())
    first = Drafter.remote()
    ray.get(first.connect.remote(verifier), timeout=120)
    out["channel_round_trip_ms"] = ray.get(first.round_trips.remote(rounds, "channel"))
    out["call_round_trip_ms_beside_channels"] = ray.get(first.round_trips.remote(rounds, False))
    ray.kill(first)
    time.sleep(5.0)
    out["channel_reader_after_the_death"] = ray.get(verifier.channel_state.remote(), timeout=20) or "still reading"
    second = Drafter.remote()
    try:
        ray.get(second.connect.remote(verifier), timeout=120)
        ray.get(second.round_trips.remote(1, "channel", 20.0), timeout=60)
        out["second_channel"] = "runs"
    except Exception as e:
        out["second_channel"] = f"fails: {type(e).__name__}"
    out["verifier_answers_after_the_second_channel"] = _answers(verifier)
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

    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False, configure_logging=False)
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
