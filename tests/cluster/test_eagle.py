"""An EAGLE draft through the cluster's entry points: `specflash generate` runs it, the
asynchronous pipeline refuses it clearly."""
from __future__ import annotations

import pytest


def test_the_async_pipeline_refuses_an_eagle_draft_clearly(tiny_target, eagle_draft, far_draft):
    from cluster.pipeline import build_pipeline_engine
    from models.eagle import is_eagle_dir

    assert is_eagle_dir(eagle_draft) and not is_eagle_dir(far_draft)
    with pytest.raises(ValueError, match="only the sync engine runs"):   # before any actor starts
        build_pipeline_engine(None, target_dir=str(tiny_target), draft_dir=str(eagle_draft))


def test_generate_cli_runs_an_eagle_draft(tiny_target, eagle_draft, capsys):
    import json

    from cluster.cli import main

    code = main(["generate", "--target", str(tiny_target), "--draft", str(eagle_draft), "--prompt", "def f(",
                 "--max-tokens", "8", "--spec-len", "3", "--ignore-eos", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8 and out["stats"]["drafted"] > 0
    code = main(["generate", "--target", str(tiny_target), "--draft", str(eagle_draft), "--prompt", "x",
                 "--mode", "async", "--max-tokens", "4"])
    assert code != 0 and "sync engine" in capsys.readouterr().err
