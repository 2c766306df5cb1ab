"""Record the target's final hidden states along its own greedy answers (EAGLE training data).

    python recipes/eagle_features.py [--data /tmp/specflash-distill] [--out /tmp/specflash-eagle]

For every answer recorded by `distill_draft.py generate` (prompt + greedy answer),
one target forward over the whole sequence gives, per position i, the final-norm
hidden state f_i (the vector the LM head reads, stored in fp16) and the target's
argmax next token. The feature-conditioned draft (`recipes/eagle_train.py`)
learns to predict f_{i+1} from (f_i, embedding of token i+1). Shards are written
as they finish; a rerun resumes, and skips shards already in `--out`: those
`distill_draft.py generate --eagle-out` wrote while answering.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@torch.inference_mode()
def features(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, H] fp16, argmax next token [T] int32) of the target over `ids`."""
    from models.transformer import causal_mask

    T = len(ids)
    cache = model.new_cache(-(-T // 16) + 1, 16)
    cache.add_sequence(0)
    logits, hidden = model(torch.tensor([ids]), torch.arange(T)[None], cache, [0], causal_mask(1, T),
                           return_hidden=True)
    return hidden[0].to(torch.float16), logits[0].argmax(-1).to(torch.int32)


def training_row(record: dict, ids: list[int], hidden: torch.Tensor, argmax: torch.Tensor) -> dict:
    """One answer's row as `eagle_train.py` reads it: `ids` [T] (the prompt, then answer tokens),
    `hidden` [T, H] fp16 and `argmax` [T] int32 at each of them, `answer_start` (the prompt's length)."""
    return {"domain": record["domain"], "heldout": record["heldout"], "ids": torch.tensor(ids, dtype=torch.int32),
            "answer_start": len(record["prompt_ids"]), "hidden": hidden, "argmax": argmax}


def main(argv=None) -> None:
    from tqdm import tqdm

    from models import embedded
    from models.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/specflash-distill"))
    p.add_argument("--out", type=Path, default=Path("/tmp/specflash-eagle"))
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(embedded.target_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    shards = sorted(args.data.glob("shard_*.pt"))
    start, tokens = time.time(), 0
    for shard in tqdm(shards, desc="target features", unit="shard"):
        out = args.out / shard.name
        if out.exists():
            continue
        rows = []
        for r in torch.load(shard, weights_only=False):
            ids = list(r["prompt_ids"]) + list(r["answer_ids"])
            hidden, argmax = features(model, ids)
            rows.append(training_row(r, ids, hidden, argmax))
            tokens += len(ids)
        torch.save(rows, out)
    print(f"{tokens} positions in {time.time() - start:.0f} s into {args.out}")


if __name__ == "__main__":
    main()
