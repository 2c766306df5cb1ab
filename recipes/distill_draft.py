"""Distil the embedded draft from SmolLM2-135M-Instruct by on-policy self-distillation.

Knowledge distillation for speculative decoding (DistillSpec, Zhou et al. 2023):
the draft is trained on the target's own greedy answers, so that what it learns
is exactly what greedy verification accepts — the target's argmax next token
along the target's own continuations.

    python recipes/distill_draft.py generate --gen-seconds 900   # target answers -> data dir
    python recipes/distill_draft.py train --train-seconds 2700   # draft -> models/assets/

1. `generate`: programmatic prompts (recipes/draft_prompts.py: code from the Python
   standard library's docstrings, templated math word problems, templated chat
   questions), wrapped in the target's chat template, answered greedily in
   left-padded batches with the KV cache; each step records the target's top-k
   log-probabilities. Shards are written as they finish; a rerun resumes. `--split` answers
   only the training or the held-out prompts, `--dtype bfloat16` answers about twice as fast on a
   CPU with AVX512-BF16 (near-greedy: the bf16 target's choices), and `--eagle-out DIR` also writes
   the EAGLE head's training rows (`eagle_features.py`'s format) from the generating forwards;
   `--seed S --beside N` draws a second corpus whose prompts are none of the seed-0 set's.
2. `train` (recipes/draft_train.py): a 3-layer Llama of hidden 576 initialised from
   chosen target layers on the target's frozen tied embeddings, with its own final
   norm and a reduced LM head (the target's embedding rows of the N most frequent
   greedy tokens), trained with cross-entropy on the target's greedy tokens plus a
   KL term on its recorded top-k probabilities; held-out agreement is measured
   every `--eval-every` steps and the best checkpoint is exported in fp16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import draft_prompts  # noqa: E402
import draft_train  # noqa: E402
import eagle_features  # noqa: E402

DEFAULT_DATA = draft_train.DEFAULT_DATA


class TopKRecorder:
    """A logits processor that records the target's top-k log-probs at every step.

    Greedy `generate` passes it the raw next-token logits `[B, V]` and keeps what it returns.
    """

    def __init__(self, k: int):
        self.k = k
        self.ids: list[torch.Tensor] = []  # per step [B, k] int32
        self.logp: list[torch.Tensor] = []  # per step [B, k] float16

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        top = logp.topk(self.k, dim=-1)
        self.ids.append(top.indices.to(torch.int32))     # stays on the model's device until the end
        self.logp.append(top.values.to(torch.float16))
        return scores


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of the prompt wrapped in the target's chat template, ready for the answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class FeatureRecorder:
    """A forward hook on the target's final norm: the hidden state the LM head reads, per forward.

    `generate`'s first forward covers the (left-padded) prompts, each later one the token just chosen.
    """

    def __init__(self, norm: torch.nn.Module):
        self.outputs: list[torch.Tensor] = []   # per forward [B, T, H] float16
        self.handle = norm.register_forward_hook(lambda _m, _i, out: self.outputs.append(out.detach().half().cpu()))

    def rows(self, b: int, prompt_len: int, fed: int) -> torch.Tensor:
        """[prompt_len + fed, H]: row b's features over its prompt and its first `fed` answer tokens."""
        head = self.outputs[0][b, self.outputs[0].shape[1] - prompt_len:]
        return torch.cat([head, *(o[b] for o in self.outputs[1:1 + fed])])


@torch.no_grad()
def answer_batch(model, tokenizer, rows: list[dict], max_new_tokens: int, k: int,
                 features: bool = False) -> list[dict]:
    """Greedy answers of the target for one batch of prompts, with top-k log-probs per step; with
    `features`, also what `eagle_features.py` records (the final-norm hidden state of every position
    of prompt + answer, fp16, and the target's argmax after it), taken from the generating forwards."""
    from transformers import LogitsProcessorList

    prompts = [chat_ids(tokenizer, r["prompt"]) for r in rows]
    width = max(len(p) for p in prompts)
    pad = draft_train.pad_id_of(tokenizer)
    device = model.device
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P] left-padded
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    recorder = TopKRecorder(k)
    hook = FeatureRecorder(model.model.norm) if features else None
    try:
        out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             logits_processor=LogitsProcessorList([recorder]),
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    finally:
        if hook:
            hook.handle.remove()
    answers = out[:, width:].cpu()  # [B, T]
    top_ids = torch.stack(recorder.ids, 1).cpu()        # [B, T, k]
    top_logp = torch.stack(recorder.logp, 1).cpu()
    # the tied LM head, once a batch (a bf16 model's is converted here): the prompts' argmax
    head = model.get_output_embeddings().weight.detach().float().cpu() if hook else None   # [V, H]
    records = []
    for b, row in enumerate(rows):
        ids = answers[b].tolist()
        n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        record = {**row, "prompt_ids": prompts[b], "answer_ids": ids[:n],
                  "topk_ids": top_ids[b, :n].clone(), "topk_logp": top_logp[b, :n].clone()}
        if hook:
            record["eagle"] = eagle_row(head, record, hook.rows(b, len(prompts[b]), n - 1))
        records.append(record)
    return records


def eagle_row(head: torch.Tensor, record: dict, hidden: torch.Tensor) -> dict:
    """`eagle_features.py`'s row for one answer from features recorded while generating, over the
    prompt and the answer but its last token (whose next token was never chosen): after the prompt's
    last position the argmax is the answer's next token, within the prompt the tied LM head's
    (`head` [V, H] float32)."""
    prompt, answer = list(record["prompt_ids"]), list(record["answer_ids"])
    within = (hidden[:len(prompt) - 1].float() @ head.T).argmax(-1)              # [P - 1]
    argmax = torch.cat([within, torch.tensor(answer, dtype=torch.long)]).to(torch.int32)   # [P - 1 + n]
    return eagle_features.training_row(record, prompt + answer[:-1], hidden, argmax)


def excluded(args) -> set[str]:
    """With `--beside N`, every prompt of the seed-0 set of N a domain (its training and held-out
    prompts alike): a corpus drawn with another `--seed` then adds only new prompts, and its own
    held-out ones are never answered by the other's training shards nor the other way round."""
    if not args.beside:
        return set()
    if args.seed == 0:
        raise SystemExit("--beside draws a second set: give it a --seed other than 0")
    return {r["prompt"] for r in draft_prompts.build_prompts(args.beside, seed=0)}


def cmd_generate(args) -> None:
    """Answer prompts batch by batch until the time budget is spent; one shard per batch."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models import embedded

    torch.set_num_threads(args.threads)
    target = embedded.target_dir()
    tokenizer = AutoTokenizer.from_pretrained(target)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval().to(args.device)
    if args.device != "cpu":      # fp32 weights, fp32 accumulation: TF32 would round the logits
        torch.backends.cuda.matmul.allow_tf32 = False
    rows = draft_prompts.build_prompts(args.prompts_per_domain, seed=args.seed, exclude=excluded(args))
    if args.split != "all":       # the held-out answers in fp32, the training ones faster in bf16
        rows = [r for r in rows if r["heldout"] == (args.split == "heldout")]
    prefix = ("" if args.split == "all" else f"{args.split}-") + (f"s{args.seed}-" if args.beside else "")
    args.data.mkdir(parents=True, exist_ok=True)
    start, tokens = time.time(), 0
    batches = range(0, len(rows), args.batch_size)
    bar = tqdm(batches, desc="target greedy answers", unit="batch")
    for i in bar:
        shard = args.data / f"shard_{prefix}{i // args.batch_size:05d}.pt"
        if shard.exists():
            continue
        if time.time() - start > args.gen_seconds:
            break
        t0 = time.time()
        records = [{**r, "dtype": args.dtype} for r in answer_batch(
            model, tokenizer, rows[i:i + args.batch_size], args.max_new_tokens, args.topk, bool(args.eagle_out))]
        if args.eagle_out:        # the EAGLE rows beside, under the same name: eagle_features.py skips them
            args.eagle_out.mkdir(parents=True, exist_ok=True)
            torch.save([r.pop("eagle") for r in records], args.eagle_out / shard.name)
        torch.save(records, shard)
        n = sum(len(r["answer_ids"]) for r in records)
        tokens += n
        bar.set_postfix(tokens=tokens, tok_s=f"{n / (time.time() - t0):.1f}")
    print(f"generated {tokens} answer tokens in {time.time() - start:.0f} s into {args.data}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="record the target's greedy answers")
    gen.add_argument("--data", type=Path, default=DEFAULT_DATA)
    gen.add_argument("--gen-seconds", type=float, default=900)
    gen.add_argument("--prompts-per-domain", type=int, default=2000)
    gen.add_argument("--batch-size", type=int, default=24)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--topk", type=int, default=8)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument("--device", default="cpu", help="where the target answers (cpu, cuda)")
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="the target's weights while answering: bfloat16 answers about twice as fast on a CPU "
                          "with AVX512-BF16, near-greedy rather than the fp32 target's greedy")
    gen.add_argument("--eagle-out", type=Path, default=None,
                     help="also write eagle_features.py's rows, from the generating forwards' final-norm "
                          "states (in --dtype), to this directory")
    gen.add_argument("--split", default="all", choices=("all", "train", "heldout"),
                     help="answer only the training or only the held-out prompts (shard_<split>-*.pt)")
    gen.add_argument("--beside", type=int, default=0, metavar="N",
                     help="draw a second corpus beside the seed-0 one of N prompts a domain: leave out all of "
                          "its prompts (needs --seed other than 0; shards shard_<split>-s<seed>-*.pt)")
    gen.set_defaults(func=cmd_generate)
    draft_train.add_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
