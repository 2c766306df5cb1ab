"""bench/load.py against the OpenAI front in process (FakeEngine, no Ray): both workloads'
requests are accepted, tokens and latencies are counted, and the summary's ratios are the
geometric means over rounds."""
from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app
from serving.testing import FakeEngine, tiny_byte_tokenizer

@pytest.fixture(scope="module")
def load(bench_script):
    return bench_script("load")


@pytest.mark.parametrize("workload", ["completions", "chat-code-math"])
def test_cell_counts_tokens_of_both_workloads(load, workload):
    tok = tiny_byte_tokenizer()
    engine = FakeEngine(tokenizer=tok, delay_s=0.005)
    server = OpenAIServer(engine, tok, ServerSettings(max_context=512))
    transport = httpx.ASGITransport(app=build_fastapi_app(server))
    cell = asyncio.run(load.run_cell("http://load.test", 2, "auto", 1.5, 12, None, workload,
                                     transport=transport))
    assert cell["errors"] == 0 and cell["requests"] >= 2
    assert cell["tokens"] >= 12 and cell["throughput_tok_s"] > 0
    assert cell["ttft_p50_s"] is not None and cell["tpot_p50_s"] is not None
    sent = engine.requests[0]
    assert sent.sampling.max_tokens == 12 and sent.sampling.temperature == 0
    prompt = tok.decode(sent.prompt_token_ids)
    if workload == "chat-code-math":
        assert any(p in prompt for p in load.CHAT_PROMPTS) and prompt not in load.CHAT_PROMPTS
    else:
        assert prompt in load.PROMPTS


def test_sampled_cells_send_the_temperature_the_nucleus_and_no_seed(load):
    tok = tiny_byte_tokenizer()
    engine = FakeEngine(tokenizer=tok, delay_s=0.005)
    server = OpenAIServer(engine, tok, ServerSettings(max_context=512))
    transport = httpx.ASGITransport(app=build_fastapi_app(server))
    args = load.argparse.Namespace(temperature=1.0, top_p=0.9)
    cell = asyncio.run(load.run_cell("http://load.test", 1, "auto", 0.5, 8, None, "chat-code-math",
                                     transport=transport, sampling=load.sampling(args)))
    assert cell["errors"] == 0 and engine.requests
    assert all(r.sampling.temperature == 1.0 and r.sampling.top_p == pytest.approx(0.9) and r.sampling.seed is None
               for r in engine.requests)
    assert load.sampling(load.argparse.Namespace(temperature=0.7, top_p=1.0)) == {"temperature": 0.7}
    for argv in (["--start", "--top-p", "0.9"], ["--start", "--temperature", "1", "--top-p", "1.5"]):
        with pytest.raises(SystemExit):
            load.main(argv)


def test_summary_is_the_geometric_mean_over_rounds(load):
    cells = []
    for rnd, (on, off) in enumerate([(30.0, 20.0), (20.0, 20.0)]):
        for mode, tps in (("auto", on), ("off", off)):
            cells.append({"concurrency": 1, "mode": mode, "round": rnd, "throughput_tok_s": tps,
                          "itl_p50_s": 1 / tps, "tpot_p50_s": None})
    s = load.summary(cells, "auto")
    assert s["c1_throughput_ratio"] == pytest.approx(math.sqrt(1.5))
    assert s["c1_itl_p50_ratio"] == pytest.approx(math.sqrt(1 / 1.5))
    assert s["c1_throughput_ratio_rounds"] == pytest.approx([1.5, 1.0])
    assert "c1_tpot_p50_ratio" not in s
