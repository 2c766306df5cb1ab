"""bench/gpu_e2e.py on the CPU, tiny: the EAGLE-head path through the pipeline (random EAGLE-style
head, corrupted replay, the (K+1)-shaped reference, the tie check), and bench/ties.py's verdict
catching a deliberately wrong output (the mutation control)."""
import json

import pytest
import torch


def test_the_gpu_bench_runs_the_eagle_head_pipeline_exactly(ray_cluster, tmp_path, bench_script):
    threads = torch.get_num_threads()
    forward = tmp_path / "gpu_forward.json"      # bench/gpu_forward.py's in-process graphed forward
    forward.write_text(json.dumps({"runs": [{"dtype": "float32", "T": 1, "graphs": True, "wall_ms": 2.0},
                                            {"dtype": "float32", "T": 1, "wall_ms": 9.0}]}))
    try:
        assert bench_script("gpu_e2e").main([
            "--target", "random:tiny", "--draft", "eagle", "--device", "cpu", "--dtype", "float32",
            "--max-tokens", "12", "--prompts", "2", "--prompt-len", "8", "--corruption", "0,0.5",
            "--modes", "chain", "--tag", "cpu-test", "--out", str(tmp_path), "--forward-json", str(forward)]) == 0
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "gpu_e2e_async_cpu-test.json").read_text())
    step = saved["plain_step"]              # the pipeline's plain step beside the graphed forward
    assert step["in_process_graphed_ms"] == 2.0 and step["ratio"] == pytest.approx(step["pipeline_ms"] / 2.0)
    points = {(p["method"], p["corruption"]): p for p in saved["points"]}
    assert set(points) == {("off", None), ("reference", 1.0), ("async", 0.0), ("async", 0.5)}
    ref = points["reference", 1.0]
    assert ref["gamma"] == 0.0 and ref["exact"]                  # nothing accepted: the target alone
    # fp32: rounding only (0 here: the panel kernel sums each output along k in order, as
    # oneDNN's prefill-shaped matmul does at this tiny width)
    assert 0 <= ref["check"]["tie_tolerance"] < 1e-3
    full = points["async", 0.0]
    assert full["gamma"] == 1.0 and full["check"]["equal"]       # the replayed reference, all accepted
    assert full["drafter"]["trees"] > 0                          # drafted by the EAGLE head's actor
    half = points["async", 0.5]
    assert half["exact"] and 0.0 < half["gamma"] < 1.0
    assert all(p["eq32_turns_speedup"] for p in (full, half))    # Eq. 3.2 with the draft's turn priced
    assert (tmp_path / "gpu_e2e_async_speedup_vs_acceptance_cpu-test.png").is_file()


def greedy(model, prompt, n):
    from bench import ties

    out = []
    for _ in range(n):
        out.append(int(ties.score(model, prompt, out + [0])[-1].argmax()))
    return out


@pytest.mark.parametrize("draft", ["eagle", "layered"])
def test_the_draft_choice_names_a_preset_of_the_targets_shape(bench_script, draft):
    from models.presets import config_of, is_eagle_spec

    gpu_e2e = bench_script("gpu_e2e")
    spec = gpu_e2e.draft_spec("random:llama3-8b:0", draft)
    assert is_eagle_spec(spec) == (draft == "eagle")
    if draft == "eagle":       # one layer of the target's width: its features are the head's input
        assert config_of(spec).num_layers == 1 and config_of(spec).hidden_size == 4096
    assert gpu_e2e.draft_spec("random:llama3-8b:0", "random:tiny-draft") == "random:tiny-draft"


def test_the_tie_check_catches_a_wrong_token_and_passes_a_near_tie(bench_script):
    """The mutation control: a token the target would not choose fails the check, however the
    rest of the output agrees; a flip within the tie tolerance passes, reported as a divergence."""
    from bench import ties
    from models.presets import random_model

    gpu_e2e = bench_script("gpu_e2e")
    model = random_model("random:tiny")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = greedy(model, prompt, 10)
    tol = ties.tie_tolerance(model, prompt, reference, (1, 5))
    assert 0 <= tol < 1e-3
    verdict = gpu_e2e.judge(model, [prompt], [reference], [reference], [reference], tol)
    assert verdict["ok"] and verdict["equal"]
    wrong = list(reference)
    logits = ties.score(model, prompt, reference)
    wrong[4] = int(logits[4].argsort()[len(logits[4]) // 2])      # a middling token, far from the top
    verdict = gpu_e2e.judge(model, [prompt], [wrong], [reference], [reference], tol)
    assert not verdict["ok"] and verdict["per_prompt"][0]["first_divergence"] == 4
    assert verdict["per_prompt"][0]["margin_at_divergence"] > 100 * max(tol, 1e-6)
    # a near-tie flip: equal up to position 2, then a token within the tolerance of the argmax
    flip = ties.check([7, 8, 5], [7, 8, 9], [0.0, 0.0, tol / 2], tol)
    assert flip["ok"] and not flip["equal"] and flip["first_divergence"] == 2
    assert not ties.check([7, 8, 5], [7, 8, 9], [0.0, 0.0, 2 * tol + 1e-6], tol)["ok"]
