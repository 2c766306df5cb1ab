"""Record the target's final hidden states along its own greedy answers (EAGLE training data).

    python recipes/eagle_features.py [--data /tmp/specflash-distill] [--out /tmp/specflash-eagle]

For every answer recorded by `distill_draft.py generate` (prompt + greedy answer),
one target forward over the whole sequence gives, per position i, the final-norm
hidden state f_i (the vector the LM head reads, stored in fp16) and the target's
argmax next token. The feature-conditioned draft (`recipes/eagle_train.py`)
learns to predict f_{i+1} from (f_i, embedding of token i+1). Shards are written
as they finish; a rerun resumes, and skips shards already in `--out`: those
`distill_draft.py generate --eagle-out` wrote while answering.

    python recipes/eagle_features.py --aux-layers 2,15 [--aux-out /tmp/specflash-eagle-aux]

adds the residual stream after the given target layers at every position of those rows
(EAGLE-3's low- and mid-level features, which a fused head reads beside f_i): one shard
of `[T, len(layers) * H]` fp16 tensors per shard of `--out`, row for row, under the same
name. `--dtype bfloat16` runs the target in bf16 (the training answers' own dtype).
"""

from __future__ import annotations

import argparse
import json
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


def aux_features(model, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[T, len(layers) * H] fp16: the residual stream after each of `layers` (0-based) over `ids`
    (`features` with the target returning those layers before its final state)."""
    model.set_feature_layers(layers)
    hidden, _ = features(model, ids)
    return hidden[:, :-model.config.hidden_size]


def add_aux(model, rows_dir: Path, out: Path, layers: tuple[int, ...], splits: tuple[str, ...]) -> None:
    """`aux_features` for every row of `rows_dir`'s shards of `splits`, shard by shard (resumes)."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    (out / "layers.json").write_text(json.dumps({"aux_layers": list(layers)}) + "\n")
    shards = [s for s in sorted(rows_dir.glob("shard_*.pt")) if s.name.split("-")[0].removeprefix("shard_") in splits]
    start, tokens = time.time(), 0
    for shard in tqdm(shards, desc="target aux features", unit="shard"):
        if (out / shard.name).exists():
            continue
        aux = [aux_features(model, [int(t) for t in r["ids"]], layers) for r in torch.load(shard, weights_only=False)]
        tokens += sum(len(a) for a in aux)
        torch.save(aux, out / shard.name)
    print(f"{tokens} positions in {time.time() - start:.0f} s into {out}")


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
    p.add_argument("--aux-layers", help="comma-separated target layers (0-based): record the residual stream "
                                        "after them along the rows of --out, instead of answering features")
    p.add_argument("--aux-out", type=Path, default=Path("/tmp/specflash-eagle-aux"))
    p.add_argument("--splits", default="train,heldout", help="with --aux-layers: the shards' splits")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(embedded.target_dir(), dtype=getattr(torch, args.dtype))
    if args.aux_layers:
        layers = tuple(int(x) for x in args.aux_layers.split(","))
        return add_aux(model, args.out, args.aux_out, layers, tuple(args.splits.split(",")))
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
