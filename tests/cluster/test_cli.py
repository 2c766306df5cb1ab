"""`specflash generate`: the JSON contract, and bad input ending in one clear error line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.cli import main


def generate(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def pair_args(tiny_target, close_draft):
    return ["--target", str(tiny_target), "--draft", str(close_draft)]


def test_json_output_contract(capsys, pair_args, tiny_target, close_draft):
    from transformers import AutoTokenizer

    code, out, _ = generate(capsys, *pair_args, "--prompt", "def f(x):", "--max-tokens", "12",
                            "--ignore-eos", "--json", "--spec-len", "3", "--tree-width", "2")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"text", "token_ids", "target", "draft", "stats"}
    assert set(result["stats"]) == {"drafted", "accepted", "acceptance_rate", "mean_accepted_len",
                                    "tokens_per_s"}
    assert len(result["token_ids"]) == 12
    assert result["target"] == str(tiny_target.resolve()) and result["draft"] == str(close_draft.resolve())
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    assert result["text"] == tokenizer.decode(result["token_ids"], skip_special_tokens=True)
    assert result["stats"]["drafted"] > 0 and result["stats"]["mean_accepted_len"] >= 1.0


def test_modes_and_proposers_agree_greedily(capsys, pair_args):
    outputs = []
    for extra in (["--mode", "off"], ["--mode", "sync"], ["--proposer", "ngram"], ["--chat"]):
        code, out, _ = generate(capsys, *pair_args, "--prompt", "abcabcabc", "--max-tokens", "8",
                                "--ignore-eos", "--json", *extra)
        assert code == 0
        outputs.append(json.loads(out.strip().splitlines()[-1])["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[3] != outputs[0]             # the chat template changes the prompt


def test_penalties_and_min_p_reach_the_sampler_in_every_mode(capsys, pair_args):
    """--presence-penalty, --frequency-penalty, --repetition-penalty and --min-p are the request's:
    greedy with penalties, speculation gives the target alone's tokens, and they differ from the
    unpenalised ones; a seeded min-p request's tokens are the seed's in either mode."""
    common = [*pair_args, "--prompt", "abcabcabc", "--max-tokens", "16", "--ignore-eos", "--json"]
    outputs = {}
    for name, extra in (("plain", []), ("penalised", ["--presence-penalty", "1.5", "--frequency-penalty", "0.5",
                                                     "--repetition-penalty", "1.3"]),
                        ("min-p", ["--temperature", "1", "--seed", "4", "--min-p", "0.2"])):
        for mode in ("off", "sync"):
            code, out, _ = generate(capsys, *common, *extra, "--mode", mode)
            assert code == 0
            outputs[name, mode] = json.loads(out.strip().splitlines()[-1])["token_ids"]
    assert all(outputs[name, "off"] == outputs[name, "sync"] for name in ("plain", "penalised", "min-p"))
    assert outputs["penalised", "off"] != outputs["plain", "off"]
    assert outputs["min-p", "off"] != outputs["plain", "off"]


def test_async_mode_runs_the_ray_pipeline_exactly(capsys, pair_args):
    """`--mode async` starts a local Ray and the drafter/verifier actors: same tokens as `off`."""
    common = [*pair_args, "--prompt", "def f(x):", "--max-tokens", "10", "--ignore-eos", "--json"]
    code, out, _ = generate(capsys, *common, "--mode", "off")
    assert code == 0
    expected = json.loads(out.strip().splitlines()[-1])["token_ids"]
    # A subprocess: the pipeline tests of this session may hold a Ray connection in this one.
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", *common, "--mode", "async",
                           "--spec-len", "3"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == expected
    assert result["stats"]["drafted"] > 0


@pytest.mark.parametrize("args,message", [
    (["--spec-len", "0"], "spec-len"),
    (["--spec-len", "17"], "spec-len"),
    (["--tree-width", "0"], "tree-width"),
    (["--tree-width", "9"], "tree-width"),
    (["--temperature", "-0.5"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--min-p", "1.5"], "min_p"),
    (["--presence-penalty", "3"], "presence_penalty"),
    (["--frequency-penalty", "-2.5"], "frequency_penalty"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--prompt", "x" * 300], "context"),
])
def test_bad_input_is_one_clear_error(capsys, pair_args, args, message):
    prompt = [] if "--prompt" in args else ["--prompt", "hi"]
    code, out, err = generate(capsys, *pair_args, *prompt, *args)
    assert code == 1 and out == ""
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1]


def test_bad_directories(capsys, tiny_target, close_draft, other_vocab_draft, tmp_path):
    cases = [
        ([str(tmp_path / "missing"), str(close_draft)], "does not exist"),
        ([str(tmp_path), str(close_draft)], "not a Hugging Face model directory"),
        ([str(tiny_target), str(tmp_path)], "not a Hugging Face model directory"),
        ([str(tiny_target), str(other_vocab_draft)], "vocabularies differ"),
    ]
    for (target, draft), message in cases:
        code, _, err = generate(capsys, "--target", target, "--draft", draft, "--prompt", "hi")
        assert code == 1 and err.strip().splitlines()[-1].startswith("error: ") and message in err


def test_different_tokenizers_are_refused(capsys, tiny_target, tmp_path):
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_target, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]                   # same size, other meaning
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    code, _, err = generate(capsys, "--target", str(tiny_target), "--draft", str(draft), "--prompt", "hi")
    assert code == 1 and "tokenizers differ" in err


def test_console_script_exits_without_traceback(tiny_target, tmp_path):
    """The real entry point in a subprocess: non-zero exit, one error line, no traceback."""
    cmd = [sys.executable, "-c", "from cluster.cli import main; raise SystemExit(main())", "generate",
           "--target", str(tiny_target), "--draft", str(tmp_path / "nope"), "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "does not exist" in proc.stderr
