"""Train the feature-conditioned draft head (EAGLE, Li et al. 2024) on the target's features.

    python recipes/eagle_features.py                 # target features along its greedy answers
    python recipes/eagle_train.py --train-seconds 1500 --out /tmp/eagle-run1
    python recipes/eagle_train.py --train-seconds 1000 --unroll 3 --lr 5e-4 \
        --init-from /tmp/eagle-run1/eagle_head.safetensors --out models/assets

The head is one Llama decoder layer of the target's width that reads, at position j,
fc([embedding(t_j), f_{j-1}]) where f_{j-1} is the target's final-norm hidden state at
the previous position, and predicts f_j; the LM head is the target's tied embedding
restricted to the draft's vocabulary subset (frozen), so a good feature prediction is
a good token prediction. Losses, all over the subset: cross-entropy on the target's
argmax next token, KL to the target's own distribution (softmax of the subset rows
applied to the true f_j), and smooth-L1 on the feature. With `--unroll D` the head
is trained on D drafted levels at once ("training-time test", EAGLE-3): level d at
position j reads the head's own level-(d-1) prediction made at j-1 and attends as a
drafter's level d does, to the verified prefix's keys (true features) and to its own
chain of predictions (`EagleHead.unrolled`). Inputs get small Gaussian noise.
With `--aux DIR` (`eagle_features.py --aux-layers`) the head is fused (EAGLE-3): level 1
reads fuse([rms(a_1), ..., rms(a_k), f_{j-1}]), the outputs of k lower target layers
(each RMS-normalised, `models.eagle.fused_input`) beside the final state, projected to H,
where `fuse` starts as f alone (so a warm start from an unfused head begins where that
head was); deeper levels read the head's own predictions.
Held-out agreement is measured at levels 1..max(D, 3) every `--eval-every` steps and
the best checkpoint (by `chain_tokens`, a chain's expected accepted tokens were the
levels independent) is exported in fp16 (`eagle_head.safetensors`, `eagle_card.json`).
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

    def __init__(self, target_dir: Path, init_layer: int, fc_init: str = "eye", aux_layers: tuple[int, ...] = ()):
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
        self.aux_layers = tuple(aux_layers)
        self.fuse = None     # EAGLE-3's fusion: [aux features, f] -> H, starting as f alone
        if aux_layers:
            self.fuse = torch.nn.Linear((len(aux_layers) + 1) * H, H, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, -H:] = torch.eye(H)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """ids [B, L], feats [B, L, H] (f_{j-1} at j) -> predicted f_j [B, L, H] (one level, causal)."""
        x = self.fc(torch.cat([self.model.embed_tokens(ids), self._fused(feats)], dim=-1))
        return self.model(inputs_embeds=x, attention_mask=attention_mask).last_hidden_state

    def _fused(self, feats: torch.Tensor) -> torch.Tensor:
        """The target's features → level 1's input [B, L, H]: as they are for a plain head, else
        [B, L, (k + 1) H] through `models.eagle.fused_input` and the fusion (as drafting does)."""
        from models.eagle import fused_input

        if self.fuse is None:
            return feats
        return self.fuse(fused_input(feats, self.config.hidden_size, self.config.rms_norm_eps))

    def unrolled(self, ids: torch.Tensor, feats: torch.Tensor, depth: int, noise: float = 0.0) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): `depth` levels drafted along the teacher-forced tokens.

        ids [B, L], feats [B, L, H] (the target's f_{j-1} at j). Level 1 reads the true features;
        level d at position j reads level d-1's prediction made at j-1 and attends as drafting
        does at level d: to level-1 keys up to j-d+1 (the verified prefix) and to its own chain,
        the level-k key at j-(d-k) for k = 2..d. Returns one [B, L, H] prediction per level.
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        layer, (B, L) = self.model.layers[0], ids.shape
        attn = layer.self_attn
        emb = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(emb, torch.arange(L)[None].expand(B, L))
        j = torch.arange(L)[:, None]                     # query position
        i = torch.arange(L)[None, :]                     # key position
        keys, values, preds = [], [], []
        for d in range(1, depth + 1):
            if d == 1:        # the target's features (fused with its lower layers' where it has them)
                x = self._fused(feats)
            else:
                x = torch.cat([torch.zeros_like(preds[-1][:, :1]), preds[-1][:, :-1]], dim=1)
            if noise:
                x = x + noise * torch.randn_like(x)
            x = self.fc(torch.cat([emb, x], dim=-1))
            h = layer.input_layernorm(x)
            shape = (B, L, -1, attn.head_dim)
            q, key = apply_rotary_pos_emb(attn.q_proj(h).view(shape).transpose(1, 2),
                                          attn.k_proj(h).view(shape).transpose(1, 2), cos, sin)
            keys.append(key)
            values.append(attn.v_proj(h).view(shape).transpose(1, 2))
            # [L, d*L]: the key of (level k, position i) is seen from (level d, position j)
            mask = torch.cat([(i <= j - d + 1) if k == 1 else (i == j - (d - k))
                              for k in range(1, d + 1)], dim=1)
            out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                                 scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(B, L, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            preds.append(self.model.norm(x))
        return preds


def warm_start(head: EagleHead, weights: Path) -> None:
    """Continue from an exported head (`eagle_head.safetensors`)."""
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(str(weights)).items()}
    head.fc.load_state_dict({k.removeprefix("eagle.fc."): v for k, v in tensors.items() if k.startswith("eagle.fc.")})
    if "eagle.fuse.weight" in tensors:
        if head.fuse is None or head.fuse.weight.shape != tensors["eagle.fuse.weight"].shape:
            raise ValueError(f"{weights} fuses {tensors['eagle.fuse.weight'].shape[1]} features: give the same --aux")
        head.fuse.weight.data.copy_(tensors["eagle.fuse.weight"])
    own = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = head.model.load_state_dict(own, strict=False)
    if unexpected or [k for k in missing if not k.startswith("embed_tokens")]:
        raise ValueError(f"{weights} does not match the head: missing {missing}, unexpected {unexpected}")


def load_rows(data: Path, aux: Path | None = None) -> list[dict]:
    """Every shard's rows; with `aux` (`eagle_features.py --aux-layers`), each row's `aux`
    [T, k * H] from the shard of the same name there."""
    rows = []
    for shard in sorted(Path(data).glob("shard_*.pt")):
        part = torch.load(shard, weights_only=False)
        if aux is not None:
            extra = torch.load(aux / shard.name, weights_only=False)
            if len(extra) != len(part) or any(len(a) != len(r["ids"]) for a, r in zip(extra, part)):
                raise ValueError(f"{aux / shard.name} does not match {shard}: rerun eagle_features.py --aux-layers")
            for r, a in zip(part, extra):
                r["aux"] = a
        rows.extend(part)
    return rows


def aux_layers_of(aux: Path | None) -> tuple[int, ...]:
    return () if aux is None else tuple(json.loads((aux / "layers.json").read_text())["aux_layers"])


def make_batch(rows: list[dict]):
    """ids [B, L], prev_feats [B, L, H'] (f_{j-1}, zero at j=0; H' = (k + 1) H with k aux features
    before it), next_feats [B, L, H] (f_j), argmax [B, L] (the target's token after j), mask [B, L]
    (real positions), answer [B, L]."""
    L, H = max(len(r["ids"]) for r in rows), rows[0]["hidden"].shape[-1]
    B, W = len(rows), H + (rows[0]["aux"].shape[-1] if "aux" in rows[0] else 0)
    ids = torch.zeros(B, L, dtype=torch.long)
    prev = torch.zeros(B, L, W)
    nxt = torch.zeros(B, L, H)
    argmax = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    answer = torch.zeros(B, L, dtype=torch.bool)
    for b, r in enumerate(rows):
        n, f = len(r["ids"]), r["hidden"].float()
        ids[b, :n] = r["ids"].long()
        prev[b, 1:n] = (torch.cat([r["aux"].float(), f], dim=-1) if "aux" in r else f)[:-1]
        nxt[b, :n] = f
        argmax[b, :n] = r["argmax"].long()
        mask[b, :n] = 1
        answer[b, max(r["answer_start"] - 1, 0):n] = True
    return ids, prev, nxt, argmax, mask, answer


def losses(head: EagleHead, batch, subset: torch.Tensor, position: torch.Tensor, noise: float,
           unroll: int = 1) -> torch.Tensor:
    """Loss over the real positions of `unroll` drafted levels (`EagleHead.unrolled`), each weighted alike."""
    ids, prev, nxt, argmax, mask, _ = batch
    E = head.model.embed_tokens.weight[subset]                     # [R, H] frozen head
    real = mask.bool()
    label = position[argmax[real]]                                 # [N] index in subset or -1
    hit = label >= 0
    target_f = nxt[real]                                           # [N, H]
    with torch.no_grad():
        p_target = torch.softmax(target_f @ E.T, dim=-1)           # [N, R]
    total = 0.0
    for pred in head.unrolled(ids, prev, unroll, noise):
        logp = torch.log_softmax(pred[real] @ E.T, dim=-1)         # [N, R]
        ce = -logp.gather(-1, label.clamp(min=0)[:, None]).squeeze(-1)[hit].mean()
        kl = -(p_target * logp).sum(-1).mean()
        reg = F.smooth_l1_loss(pred[real], target_f)
        total = total + (ce + kl + reg) / unroll
    return total


@torch.no_grad()
def agreement(head: EagleHead, rows: list[dict], subset: torch.Tensor, depth: int = 3, batch_size: int = 16) -> dict:
    """Greedy agreement with the target on answer positions, by domain, at each drafted level
    1..`depth` (`EagleHead.unrolled`: level 1 reads the true previous feature, deeper levels the
    head's own predictions, attending as drafting does), the tokens before it taken as accepted."""
    head.eval()
    E = head.model.embed_tokens.weight[subset]
    out: dict = {}
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        ids, prev, nxt, argmax, mask, answer = make_batch(chunk)
        keep = answer & mask.bool()
        for level, pred in enumerate(head.unrolled(ids, prev, depth), start=1):
            ok = (subset[(pred @ E.T).argmax(-1)] == argmax) & keep
            for b, r in enumerate(chunk):
                d = out.setdefault(r["domain"], {}).setdefault(level, [0, 0])
                d[0] += int(ok[b].sum())
                d[1] += int(keep[b].sum())
    head.train()
    result = {dom: {f"depth{k}": v[0] / max(v[1], 1) for k, v in d.items()} | {"tokens": d[1][1]}
              for dom, d in sorted(out.items())}
    result["mean_depth1"] = sum(v["depth1"] for v in result.values()) / len(out)
    # tokens a `depth`-long chain would get if the levels were independent: what checkpoints are chosen by
    result["score"] = sum(chain_tokens([v[f"depth{k}"] for k in range(1, depth + 1)])
                          for v in result.values() if isinstance(v, dict)) / len(out)
    return result


def chain_tokens(rates: list[float]) -> float:
    """Expected accepted tokens of a chain whose level k is accepted at rates[k-1], given the ones before."""
    total, reach = 0.0, 1.0
    for r in rates:
        reach *= r
        total += reach
    return total


def export(head: EagleHead, subset: list[int], card: dict, out: Path) -> None:
    """eagle_head.safetensors (fc + layer + norm, HF names, fp16) and eagle_card.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"model.{k}": v for k, v in head.model.state_dict().items() if not k.startswith("embed_tokens")}
    tensors |= {f"eagle.fc.{k}": v for k, v in head.fc.state_dict().items()}
    if head.fuse is not None:
        tensors["eagle.fuse.weight"] = head.fuse.weight
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    if head.fuse is not None:
        tensors["eagle.aux_layers"] = torch.tensor(head.aux_layers, dtype=torch.int64)
    save_file(tensors, out / "eagle_head.safetensors", metadata={"format": "pt"})
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
    p.add_argument("--unroll", type=int, default=1, help="drafted levels trained at once; from the second "
                                                          "on, the head reads its own predicted features")
    p.add_argument("--init-layer", type=int, default=29, help="target layer to start from (-1: random)")
    p.add_argument("--fc-init", choices=["eye", "random"], default="random")
    p.add_argument("--init-from", type=Path, help="continue from an exported eagle_head.safetensors")
    p.add_argument("--aux", type=Path, help="the target's lower-layer features (eagle_features.py --aux-layers): "
                                            "the head fuses them with f (EAGLE-3), starting from f alone")
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="training matmuls under bf16 autocast (weights, "
                                                      "evaluation and export stay fp32 / fp16)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    subset = embedded.draft_logit_rows(embedded.draft_dir())
    subset_t = torch.tensor(subset)
    rows = load_rows(args.data, args.aux)
    train = [r for r in rows if not r["heldout"]]
    heldout = [r for r in rows if r["heldout"]]
    head = EagleHead(embedded.target_dir(), args.init_layer, args.fc_init, aux_layers_of(args.aux))
    if args.init_from:
        warm_start(head, args.init_from)
    position = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    position[subset_t] = torch.arange(len(subset))
    print(f"{len(train)} train / {len(heldout)} held-out answers, "
          f"{sum(len(r['ids']) for r in train)} train positions, "
          f"{sum(q.numel() for q in head.parameters() if q.requires_grad)} parameters")
    def loss_of(records: list[dict]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            return losses(head, make_batch(records), subset_t, position, args.noise, args.unroll)

    best_step, history = train_for(
        head, train, loss_of,
        lambda: agreement(head, heldout, subset_t, max(args.unroll, 3)), seconds=args.train_seconds,
        eval_every=args.eval_every,
        lr=args.lr, batch_size=args.batch_size, seed=args.seed, score="score", desc="training EAGLE head")
    card = {"metric": "teacher-forced greedy agreement with the target along its greedy answers to held-out "
                      "prompts, argmax over the draft's vocabulary subset; depth1 reads the target's true "
                      "previous feature, depth d its own level-(d-1) prediction, attending as drafting does "
                      "(EagleHead.unrolled)",
            "recipe": "recipes/eagle_features.py + recipes/eagle_train.py", "args": {k: str(v) for k, v in vars(args).items()},
            "init_layer": args.init_layer, "aux_layers": list(head.aux_layers), "best_step": best_step, "final": next(h for h in history if h["step"] == best_step),
            "history": history, "train_answers": len(train), "heldout_answers": len(heldout)}
    export(head, subset, card, args.out)
    print(json.dumps(card["final"]))


if __name__ == "__main__":
    main()
