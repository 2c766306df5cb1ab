"""Train the feature-conditioned draft head (EAGLE, Li et al. 2024) on the target's features.

    python recipes/eagle_features.py                 # target features along its greedy answers
    python recipes/eagle_train.py --train-seconds 1500 --out /tmp/eagle-run1
    python recipes/eagle_train.py --train-seconds 1000 --unroll 2 --lr 5e-4 \
        --init-from /tmp/eagle-run1/eagle_head.safetensors --out models/assets

The head is one Llama decoder layer of the target's width that reads, at position j,
fc([embedding(t_j), f_{j-1}]) where f_{j-1} is the target's final-norm hidden state at
the previous position, and predicts f_j; the LM head is the target's tied embedding
restricted to the draft's vocabulary subset (frozen), so a good feature prediction is
a good token prediction. Losses, all over the subset: cross-entropy on the target's
argmax next token, KL to the target's own distribution (softmax of the subset rows
applied to the true f_j), and smooth-L1 on the feature. A second unrolled pass feeds
the head its own predicted features (as drafting does from the second level on) and
is trained the same way with `--unroll 2` ("training-time test", EAGLE-3). Inputs get
small Gaussian noise. Held-out agreement is measured at both depths every
`--eval-every` steps and the best checkpoint (by d1 * (1 + d2), a two-level chain's
expected tokens) is exported in fp16 (`eagle_head.safetensors`, `eagle_card.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from draft_train import train_for  # noqa: E402

ASSETS = ROOT / "models" / "assets"


class EagleHead(torch.nn.Module):
    """Training-time twin of `models.eagle.EagleDraft`: fc + one HF Llama layer + final norm."""

    def __init__(self, target_dir: Path, init_layer: int, fc_init: str = "eye"):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaModel

        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        config = AutoConfig.from_pretrained(target_dir)
        config.num_hidden_layers = 1
        H = config.hidden_size
        self.config = config
        self.model = LlamaModel(config)
        self.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
        self.model.embed_tokens.weight.requires_grad_(False)
        if init_layer >= 0:    # else the layer keeps transformers' random init
            self.model.layers[0].load_state_dict(target.model.layers[init_layer].state_dict())
        self.model.norm.load_state_dict(target.model.norm.state_dict())
        self.fc = torch.nn.Linear(2 * H, H, bias=True)
        if fc_init == "eye":   # start from the sum of the token's embedding and the feature
            with torch.no_grad():
                self.fc.weight.zero_()
                self.fc.weight[:, :H] = torch.eye(H)
                self.fc.weight[:, H:] = torch.eye(H)
                self.fc.bias.zero_()

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """ids [B, L], feats [B, L, H] (f_{j-1} at j) -> predicted f_j [B, L, H]."""
        x = self.fc(torch.cat([self.model.embed_tokens(ids), feats], dim=-1))
        return self.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state


def warm_start(head: EagleHead, weights: Path) -> None:
    """Continue from an exported head (`eagle_head.safetensors`)."""
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(str(weights)).items()}
    head.fc.load_state_dict({k.removeprefix("eagle.fc."): v for k, v in tensors.items() if k.startswith("eagle.fc.")})
    own = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = head.model.load_state_dict(own, strict=False)
    if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
        raise ValueError(f"{weights} does not match the head: missing {missing}, unexpected {unexpected}")


def load_rows(data: Path) -> list[dict]:
    rows = []
    for shard in sorted(Path(data).glob("shard_*.pt")):
        rows.extend(torch.load(shard, weights_only=False))
    return rows


def make_batch(rows: list[dict]):
    """ids [B, L], prev_feats [B, L, H] (f_{j-1}, zero at j=0), next_feats [B, L, H] (f_j),
    argmax [B, L] (the target's token after j), mask [B, L] (real positions), answer [B, L]."""
    L, H = max(len(r["ids"]) for r in rows), rows[0]["hidden"].shape[-1]
    B = len(rows)
    ids = torch.zeros(B, L, dtype=torch.long)
    prev = torch.zeros(B, L, H)
    nxt = torch.zeros(B, L, H)
    argmax = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    answer = torch.zeros(B, L, dtype=torch.bool)
    for b, r in enumerate(rows):
        n, f = len(r["ids"]), r["hidden"].float()
        ids[b, :n] = r["ids"].long()
        prev[b, 1:n] = f[:-1]
        nxt[b, :n] = f
        argmax[b, :n] = r["argmax"].long()
        mask[b, :n] = 1
        answer[b, max(r["answer_start"] - 1, 0):n] = True
    return ids, prev, nxt, argmax, mask, answer


def losses(head: EagleHead, batch, subset: torch.Tensor, position: torch.Tensor, noise: float,
           unroll: int = 1) -> torch.Tensor:
    """Loss over the real positions of `unroll` passes (the first reads the true features)."""
    ids, prev, nxt, argmax, mask, _ = batch
    E = head.model.embed_tokens.weight[subset]                     # [R, H] frozen head
    real = mask.bool()
    label = position[argmax[real]]                                 # [N] index in subset or -1
    hit = label >= 0
    target_f = nxt[real]                                           # [N, H]
    with torch.no_grad():
        p_target = torch.softmax(target_f @ E.T, dim=-1)           # [N, R]
    total = 0.0
    feats = prev
    for depth in range(unroll):
        inp = feats + noise * torch.randn_like(feats) if noise else feats
        pred = head(ids, inp, mask)                                # [B, L, H]
        logp = torch.log_softmax(pred[real] @ E.T, dim=-1)         # [N, R]
        ce = -logp.gather(-1, label.clamp(min=0)[:, None]).squeeze(-1)[hit].mean()
        kl = -(p_target * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(pred[real], target_f)
        total = total + (1.0 if depth == 0 else 0.5) * (ce + kl + reg)
        # next pass: position j reads the prediction made at j-1 (as a second draft level does)
        feats = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], dim=1)
    return total


@torch.no_grad()
def agreement(head: EagleHead, rows: list[dict], subset: torch.Tensor, batch_size: int = 16) -> dict:
    """Greedy agreement with the target on answer positions: depth 1 reads the true
    previous feature, depth 2 the head's own prediction of it. By domain."""
    head.eval()
    E = head.model.embed_tokens.weight[subset]
    out: dict = {}
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        ids, prev, nxt, argmax, mask, answer = make_batch(chunk)
        keep = answer & mask.bool()
        pred1 = head(ids, prev, mask)
        feats2 = torch.cat([torch.zeros_like(pred1[:, :1]), pred1[:, :-1]], dim=1)
        pred2 = head(ids, feats2, mask)
        for depth, pred in ((1, pred1), (2, pred2)):
            guess = subset[(pred @ E.T).argmax(-1)]
            ok = (guess == argmax) & keep
            for b, r in enumerate(chunk):
                d = out.setdefault(r["domain"], {}).setdefault(depth, [0, 0])
                d[0] += int(ok[b].sum())
                d[1] += int(keep[b].sum())
    head.train()
    result = {dom: {f"depth{k}": v[0] / max(v[1], 1) for k, v in d.items()} | {"tokens": d[1][1]}
              for dom, d in sorted(out.items())}
    result["mean_depth1"] = sum(v["depth1"] for v in result.values()) / len(out)
    # tokens a 2-long chain would get if the levels were independent: what checkpoints are chosen by
    result["score"] = sum(v["depth1"] * (1 + v["depth2"]) for k, v in result.items()
                          if isinstance(v, dict)) / len(out)
    return result


def export(head: EagleHead, subset: list[int], card: dict, out: Path) -> None:
    """eagle_head.safetensors (fc + layer + norm, HF names, fp16) and eagle_card.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in head.model.state_dict().items() if not k.startswith("embed_tokens")}
    tensors |= {f"eagle.fc.{k}": v for k, v in head.fc.state_dict().items()}
    save_file({k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()},
              out / "eagle_head.safetensors", metadata={"format": "pt"})
    (out / "eagle_card.json").write_text(json.dumps(card, indent=2) + "\n")


def main(argv=None) -> None:
    from models import embedded

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("/tmp/specflash-eagle"))
    p.add_argument("--out", type=Path, default=ASSETS)
    p.add_argument("--train-seconds", type=float, default=1500)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--unroll", type=int, default=1, help="training passes; from the second on, the head "
                                                          "reads its own predicted features")
    p.add_argument("--init-layer", type=int, default=29, help="target layer to start from (-1: random)")
    p.add_argument("--fc-init", choices=["eye", "random"], default="random")
    p.add_argument("--init-from", type=Path, help="continue from an exported eagle_head.safetensors")
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    subset = embedded.draft_logit_rows(embedded.draft_dir())
    subset_t = torch.tensor(subset)
    rows = load_rows(args.data)
    train = [r for r in rows if not r["heldout"]]
    heldout = [r for r in rows if r["heldout"]]
    head = EagleHead(embedded.target_dir(), args.init_layer, args.fc_init)
    if args.init_from:
        warm_start(head, args.init_from)
    position = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    position[subset_t] = torch.arange(len(subset))
    print(f"{len(train)} train / {len(heldout)} held-out answers, "
          f"{sum(len(r['ids']) for r in train)} train positions, "
          f"{sum(q.numel() for q in head.parameters() if q.requires_grad)} parameters")
    best_step, history = train_for(
        head, train, lambda records: losses(head, make_batch(records), subset_t, position, args.noise, args.unroll),
        lambda: agreement(head, heldout, subset_t), seconds=args.train_seconds, eval_every=args.eval_every,
        lr=args.lr, batch_size=args.batch_size, seed=args.seed, score="score", desc="training EAGLE head")
    card = {"metric": "teacher-forced greedy agreement with the target along its greedy answers to held-out "
                      "prompts, argmax over the draft's vocabulary subset; depth1 reads the target's true "
                      "previous feature, depth2 the head's own prediction of it",
            "recipe": "recipes/eagle_features.py + recipes/eagle_train.py", "args": {k: str(v) for k, v in vars(args).items()},
            "init_layer": args.init_layer, "best_step": best_step, "final": next(h for h in history if h["step"] == best_step),
            "history": history, "train_answers": len(train), "heldout_answers": len(heldout)}
    export(head, subset, card, args.out)
    print(json.dumps(card["final"]))


if __name__ == "__main__":
    main()
