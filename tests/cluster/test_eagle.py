"""An EAGLE draft head through the cluster's entry points: `specflash generate` runs it in
process and in the pipeline, and the pipeline's output with it is the target's own: the
verifier sends the target's features of each step's committed tokens with the signal (raw
float32 on the wire), and the drafter drafts ahead on its own predicted ones (issue 23)."""
from __future__ import annotations

import pytest

from tests.cluster.pipeline_helpers import assert_greedy_exact_beside_sampled, prompts, run


@pytest.mark.parametrize("lockstep_alone", [True, False])
def test_the_pipeline_with_an_eagle_head_is_the_target_alone(make_engine, tiny_target, eagle_draft, hf_target,
                                                           lockstep_alone):
    """Greedy requests, with a sampled one beside them, token for token the target's; in
    lockstep (a lone stream beside its drafter) and overlapped (trees drafted ahead on
    predicted features, contradicted outcomes rolled back)."""
    from models.eagle import is_eagle_dir

    assert is_eagle_dir(eagle_draft)
    engine = make_engine(tiny_target, eagle_draft, speculation={"lockstep_alone": lockstep_alone})
    assert_greedy_exact_beside_sampled(engine, hf_target, prompts(3, seed=31))
    stats = run(engine.stats())
    assert stats["num_drafted"] > 0 and stats["drafters"][0]["trees_drafted"] > 0, stats


def test_the_pipeline_with_a_fused_head_is_the_target_alone(make_engine, tiny_target, fused_eagle_draft, hf_target):
    """A fused head (EAGLE-3's multi-layer features): the verifier actor reads the layers it
    fuses from the draft's checkpoint and sends their outputs beside the final state, [n, 3H]
    on the wire; the drafter fuses them. Overlapped, so trees are also drafted ahead."""
    from models.eagle import eagle_dir_aux_layers

    assert eagle_dir_aux_layers(fused_eagle_draft) == (0, 1)
    engine = make_engine(tiny_target, fused_eagle_draft, speculation={"lockstep_alone": False})
    assert_greedy_exact_beside_sampled(engine, hf_target, prompts(3, seed=37))
    stats = run(engine.stats())
    assert stats["num_drafted"] > 0 and stats["drafters"][0]["trees_drafted"] > 0, stats


def test_bridge_chains_with_an_eagle_head_are_refused_before_any_actor_starts(tiny_target, eagle_draft):
    from cluster.pipeline import build_pipeline_engine
    from tests.ray_cluster import pipeline_args

    with pytest.raises(ValueError, match="bridge_depth"):
        build_pipeline_engine(pipeline_args(bridge_depth=2), target_dir=str(tiny_target), draft_dir=str(eagle_draft))


def test_generate_cli_runs_an_eagle_draft(tiny_target, eagle_draft, capsys):
    import json

    from cluster.cli import main

    code = main(["generate", "--target", str(tiny_target), "--draft", str(eagle_draft), "--prompt", "def f(",
                 "--max-tokens", "8", "--spec-len", "3", "--ignore-eos", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8 and out["stats"]["drafted"] > 0


def test_generate_cli_runs_an_eagle_draft_through_the_pipeline(tiny_target, eagle_draft, capsys):
    """`--mode async` with an EAGLE head: a local Ray and the actors, the same tokens as `off`."""
    import json
    import subprocess
    import sys

    from cluster.cli import main

    common = ["--target", str(tiny_target), "--draft", str(eagle_draft), "--prompt", "def f(x):",
              "--max-tokens", "10", "--ignore-eos", "--json", "--spec-len", "3"]
    assert main(["generate", *common, "--mode", "off"]) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    # a subprocess: the pipeline tests of this session may hold a Ray connection in this one
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", *common, "--mode", "async"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == expected and result["stats"]["drafted"] > 0
