"""bench/vllm_peer.py and `bench/e2e.py --peer` (issue 23 item 6), against a stand-in for vLLM.

vLLM is not a dependency, so the environment the peer script is given holds a small `vllm`
package with the calls the script makes (`LLM(...).generate`, `get_metrics`, `TokensPrompt`,
`SamplingParams`), answering with Hugging Face's greedy decoding of the same checkpoint: what
is tested is the script (one child per method, our prompt ids, the results file, the rows
bench/e2e.py prints beside ours), not vLLM.
"""
import json
import shutil
import stat
import sys

import pytest
import torch

FAKE_VLLM = '''
import torch
from dataclasses import dataclass
from transformers import AutoModelForCausalLM

__version__ = "0.0-stand-in"


@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int


@dataclass
class _Counter:
    name: str
    value: float


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class LLM:
    def __init__(self, model, speculative_config=None, **kwargs):
        assert kwargs["dtype"] == "float32"
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.spec = speculative_config
        self.counts = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}

    def generate(self, prompts, params, use_tqdm=True):
        assert params.temperature == 0.0
        out = []
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.inference_mode():
                new = self.model.generate(ids, do_sample=False, max_new_tokens=params.max_tokens,
                                          attention_mask=torch.ones_like(ids), pad_token_id=0)[0, ids.shape[1]:]
            if self.spec:
                k = self.spec["num_speculative_tokens"]
                self.counts["drafts"] += len(new)
                self.counts["draft_tokens"] += k * len(new)
                self.counts["accepted_tokens"] += len(new) // 2
            out.append(_Output(new.tolist()))
        return out

    def get_metrics(self):
        return [_Counter("vllm:spec_decode_num_" + k, v) for k, v in self.counts.items()] if self.spec else []
'''


@pytest.fixture
def vllm_python(tmp_path):
    """An executable standing for vLLM's venv Python: ours, with the stand-in package on its path."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    exe = tmp_path / "python"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_the_peer_runs_each_method_in_its_own_environment_on_our_prompt_ids(
        vllm_python, tiny_target, close_draft, tmp_path, bench_script, capsys, monkeypatch):
    peer = bench_script("vllm_peer")
    from bench import common
    parent = {**common.machine(), "python": "0.0-parent", "torch": "0.0-parent", "transformers": "0.0-parent"}
    monkeypatch.setattr(common, "machine", lambda: parent)     # our venv's versions, unlike the child's
    out = tmp_path / "peer"
    assert peer.main([
        "--vllm-python", str(vllm_python), "--target", str(tiny_target), "--draft", str(close_draft),
        "--prompts", "1", "--max-tokens", "6", "--draft-ks", "3", "--out", str(out)]) == 0
    (path,) = out.glob("vllm-*.json")
    info = json.loads(path.read_text())
    assert info["vllm"] == "0.0-stand-in"
    # the machine record names what ran vLLM, as the child reported it; our venv only tokenized
    import platform
    import transformers
    assert {k: info["machine"][k] for k in ("python", "vllm", "torch", "transformers", "cpu", "threads")} == {
        "python": platform.python_version(), "vllm": "0.0-stand-in", "torch": torch.__version__,
        "transformers": transformers.__version__, "cpu": parent["cpu"], "threads": 2}
    assert info["tokenizer_env"] == {"python": "0.0-parent", "torch": "0.0-parent", "transformers": "0.0-parent"}
    assert list(info["methods"]) == ["vllm-target", "vllm-draft-k3", "vllm-ngram"]
    assert info["methods"]["vllm-draft-k3"] == {"method": "draft_model", "model": str(close_draft),
                                                "num_speculative_tokens": 3}
    e2e = bench_script("e2e")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_target)
    runs = info["runs"]
    assert len(runs) == 3 * 3                                       # 3 methods, 1 prompt of each category
    assert {(r["category"], r["prompt"]) for r in runs} == {(c, 0) for c in e2e.PROMPTS}
    target_runs = [r for r in runs if r["method"] == "vllm-target"]
    assert all(r["drafted"] == 0 and r["steps"] == 0 for r in target_runs)
    k3 = [r for r in runs if r["method"] == "vllm-draft-k3"]
    assert all(r["drafted"] == 3 * len(r["token_ids"]) > 0 for r in k3)    # the counters read around each call
    # the token ids the child generated from are ours: its output is HF's greedy continuation of them
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    ids = torch.tensor([e2e.prompt_ids(tok, e2e.PROMPTS["math"][0])])
    with torch.inference_mode():
        want = model.generate(ids, do_sample=False, max_new_tokens=6, attention_mask=torch.ones_like(ids),
                              pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert next(r for r in target_runs if r["category"] == "math")["token_ids"] == want

    threads = torch.get_num_threads()
    try:
        assert e2e.main(["--target", str(tiny_target), "--draft", str(close_draft), "--prompts", "1",
                         "--max-tokens", "6", "--spec-len", "2", "--threads", "1", "--eagle", "none",
                         "--no-hf", "--no-async", "--methods", "off", "sync-chain", "--peer", str(path),
                         "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "| vllm-draft-k3 |" in printed and "against the peer's best speculative" in printed
    (ours,) = tmp_path.glob("e2e-*.json")
    rows = {r["method"]: r for r in json.loads(ours.read_text())["summary"]}
    assert set(rows) == {"off", "sync-chain", "vllm-target", "vllm-draft-k3", "vllm-ngram"}
    assert rows["vllm-draft-k3"]["acceptance_rate"] == pytest.approx(
        sum(len(r["token_ids"]) // 2 for r in k3) / sum(r["drafted"] for r in k3))


def test_the_peer_says_what_went_wrong(vllm_python, tiny_target, close_draft, tmp_path, bench_script, capsys):
    peer = bench_script("vllm_peer")
    with pytest.raises(SystemExit):
        peer.main(["--vllm-python", str(tmp_path / "nowhere"), "--target", str(tiny_target),
                   "--draft", str(close_draft)])
    assert "no such file" in capsys.readouterr().err
    broken = tmp_path / "broken"                    # a tokenizer, no weights: the child fails to load it
    shutil.copytree(tiny_target, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="vllm-target failed"):     # the child's error, named
        peer.main(["--vllm-python", str(vllm_python), "--target", str(broken), "--draft", str(close_draft),
                   "--methods", "vllm-target", "--prompts", "1", "--out", str(tmp_path)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"args": {"max_tokens": "48"}, "runs": []}))
    e2e = bench_script("e2e")
    with pytest.raises(SystemExit):
        e2e.main(["--target", str(tiny_target), "--draft", str(close_draft), "--max-tokens", "6",
                  "--peer", str(bad), "--no-async", "--no-hf", "--eagle", "none"])
    assert "generated 48 tokens per prompt" in capsys.readouterr().err
