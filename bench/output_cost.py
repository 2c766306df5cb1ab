"""CPU per chunk from a verifier-shaped actor to its consumer: a Ray stream against the output
socket (cluster/outputs.py).

    python bench/output_cost.py                       # 400 chunks, one every 5 ms, each way twice
    python bench/output_cost.py --items 1000 --pace-ms 2 --out output_cost.json

An async actor produces `--items` small chunks (a `GenerationChunk` of one token), one every
`--pace-ms` (a step's pace), and the consumer in this process reads them as
`cluster.pipeline.PipelineEngine` does: through `VerifierActor.generate`'s kind of Ray stream
(`num_returns="streaming"`, each item awaited), or as frames on a Unix socket the actor listens
on (`encode_chunk` / `decode_chunk`). A third way, `idle`, paces as many steps and sends nothing:
its CPU is the floor. Per way: wall ms per chunk and CPU ms per chunk of the consumer (this
process), the actor, the raylet and the GCS, from /proc (psutil). Each way runs `--repeats`
times, interleaved.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
from bench import common  # noqa: E402  (bench/ off sys.path, the repository on it: common's docstring)

WAYS = ("idle", "ray_stream", "socket")


def producer_class():
    import ray

    from cluster.outputs import encode_chunk
    from speculation.requests import GenerationChunk

    @ray.remote
    class Producer:
        def pid(self) -> int:
            return os.getpid()

        async def listen(self, path: str) -> str:
            self.writer = None

            async def on_connect(reader, writer):
                self.writer = writer

            if os.path.exists(path):
                os.unlink(path)
            self.server = await asyncio.start_unix_server(on_connect, path=path)
            return path

        async def idle(self, n: int, pace: float) -> int:
            for _ in range(n):
                await asyncio.sleep(pace)
            return n

        async def stream(self, n: int, pace: float):
            for i in range(n):
                await asyncio.sleep(pace)
                yield GenerationChunk("r", [i], False, None, 4, 4)

        async def frames(self, n: int, pace: float) -> int:
            for i in range(n):
                await asyncio.sleep(pace)
                self.writer.write(encode_chunk(GenerationChunk("r", [i], False, None, 4, 4)))
                await self.writer.drain()
            return n

    return Producer


async def consume(way: str, producer, reader, n: int, pace: float) -> int:
    from cluster.outputs import decode_chunk, read_frame

    if way == "idle":
        return await producer.idle.remote(n, pace)
    if way == "ray_stream":
        stream, got = producer.stream.options(num_returns="streaming").remote(n, pace), 0
        async for ref in stream:
            await ref
            got += 1
        return got
    done = producer.frames.remote(n, pace)
    for _ in range(n):
        decode_chunk(await read_frame(reader))
    return await done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=common.positive_int, default=400)
    p.add_argument("--pace-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=common.positive_int, default=2)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    import psutil
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        producer = producer_class().remote()
        procs = {"consumer": psutil.Process(), "actor": psutil.Process(ray.get(producer.pid.remote()))}
        for q in psutil.process_iter(["cmdline"]):
            line = " ".join(q.info["cmdline"] or [])
            if "gcs_server" in line:
                procs["gcs"] = q
            elif "raylet" in line and "raylet" not in procs:
                procs["raylet"] = q

        def cpu() -> dict:
            return {k: sum(q.cpu_times()[:2]) for k, q in procs.items()}

        path = ray.get(producer.listen.remote(os.path.join(tempfile.gettempdir(), f"specflash-bench-{os.getpid()}.sock")))
        rows = []

        async def run_all():
            reader, writer = await asyncio.open_unix_connection(path)
            for rep in range(args.repeats):
                for way in WAYS:
                    c0, t0 = cpu(), time.perf_counter()
                    await consume(way, producer, reader, args.items, args.pace_ms / 1e3)
                    c1, t1 = cpu(), time.perf_counter()
                    rows.append({"way": way, "repeat": rep, "wall_ms_per_chunk": 1e3 * (t1 - t0) / args.items,
                                 **{f"{k}_cpu_ms_per_chunk": 1e3 * (c1[k] - c0[k]) / args.items for k in c0}})
            writer.close()

        asyncio.run(run_all())
    finally:
        ray.shutdown()
    keys = [k for k in rows[0] if k.endswith("_per_chunk")]
    print(common.markdown_table(["way", "repeat", *keys],
                                [[r["way"], r["repeat"], *(f"{r[k]:.3f}" for k in keys)] for r in rows]))
    if args.out:
        common.write_json(args.out, {"date": common.utc(), "machine": common.machine(),
                                     "args": vars(args) | {"out": str(args.out)}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
