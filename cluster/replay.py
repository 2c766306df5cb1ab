"""BENCHMARK ONLY: a drafter with a controlled acceptance rate, and random-weight models.

Real large checkpoints are not available where the GPU benchmark runs, and a
random draft agrees with a random target about never. `CorruptedReplayProposer`
fixes that for measurement (issue 4, item 9): it runs a real draft-shaped model
(`drafter.ModelProposer`) so drafting costs what it would, then overwrites the
chain it drafted with the target's own recorded greedy continuation of the
prompt, each token replaced by a random other token with probability
`corruption`. Greedy verification then accepts each token with probability
about `1 - corruption` (numerical near-ties of random weights aside), so the
speedup can be measured against a chosen acceptance.

It is never a default: the pipeline only builds it for `proposer="replay"`,
which no user-facing config accepts (`SpeculationDefaults.proposer` is
"model" | "ngram"); bench/gpu_e2e.py passes it as a PipelineSettings override.
Exactness is untouched: whatever the drafter proposes, the verifier commits only
what the target itself would.

`random_model("random:<preset>:<seed>")` builds a Transformer of a named shape
with random weights on a device, instead of loading a checkpoint directory.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import torch

RANDOM_PRESETS = {
    # Llama-3-8B and Llama-3.2-1B shapes (vocabulary 128256, GQA 4:1)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, vocab_size=128256),
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                      num_kv_heads=8, vocab_size=128256),
    # CPU smoke shapes
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=512),
    "tiny-draft": dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                       vocab_size=512),
}


def is_random(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.startswith("random:")


def random_config(spec: str):
    from models.config import ModelConfig

    _, preset, *_ = spec.split(":")
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown random preset {preset!r}; known: {', '.join(RANDOM_PRESETS)}")
    shape = RANDOM_PRESETS[preset]
    return ModelConfig(arch="llama", head_dim=shape["hidden_size"] // shape["num_heads"],
                       max_position_embeddings=4096, rope_theta=500000.0, **shape)


def random_model(spec: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """`random:<preset>[:<seed>]` -> a models.Transformer with N(0, 0.02) weights, eval mode."""
    from models.config import rope_inv_freq
    from models.transformer import Transformer

    parts = spec.split(":")
    seed = int(parts[2]) if len(parts) > 2 else 0
    config = random_config(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = Transformer(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
    model.inv_freq = rope_inv_freq(config)[0].to(device)
    return model.requires_grad_(False).eval()


class CorruptedReplayProposer:
    """BENCHMARK ONLY. A ModelProposer whose chains are replaced by the target's recorded
    greedy continuation, each token corrupted with probability `corruption`."""

    def __init__(self, inner, references: Sequence[Sequence[int]], corruption: float, vocab_size: int,
                 seed: int = 0) -> None:
        self.inner = inner                  # drafter.ModelProposer: pays the real drafting cost
        self.references = [list(r) for r in references]   # prompt + recorded greedy continuation
        self.corruption = corruption
        self.vocab_size = vocab_size
        self.rng = torch.Generator().manual_seed(seed)

    @classmethod
    def from_file(cls, inner, path: str, corruption: float, vocab_size: int) -> "CorruptedReplayProposer":
        with open(path) as f:
            return cls(inner, json.load(f), corruption, vocab_size)

    @property
    def cache(self):
        return self.inner.cache

    def propose(self, batch):
        trees = self.inner.propose(batch)
        return [self._replay(r.token_ids, t) for r, t in zip(batch, trees)]

    def _replay(self, prefix: Sequence[int], tree):
        """Overwrite the first chain of `tree` with the (corrupted) recorded continuation."""
        n = len(prefix)
        ref = next((r for r in self.references if len(r) > n and r[:n] == list(prefix)), None)
        if ref is None or tree.num_nodes == 0:
            return tree
        tokens = tree.token_ids.clone()
        node, depth = -1, 0
        parents = tree.parent_ids.tolist()
        for i, p in enumerate(parents):          # the first-child chain from the root
            if p == node and n + depth < len(ref):
                token = ref[n + depth]
                if float(torch.rand(1, generator=self.rng)) < self.corruption:
                    token = (token + 1 + int(torch.randint(self.vocab_size - 1, (1,), generator=self.rng))) \
                        % self.vocab_size
                tokens[i] = token
                node, depth = i, depth + 1
        from models.tree import TokenTree

        return TokenTree(tokens, tree.parent_ids, tree.depths, tree.draft_probs, tree.prefix_len, tree.epoch)

    def on_verified(self, seq_id, tree, accepted_nodes) -> None:
        # the draft's K/V were computed for its own tokens, not the replayed ones: drop them, so the
        # next proposal re-feeds the committed tokens (cost stays that of a real draft catch-up)
        self.inner.on_verified(seq_id, tree, [])

    def rollback(self, seq_id, prefix_len: int) -> None:
        self.inner.rollback(seq_id, prefix_len)

    def release(self, seq_id) -> None:
        self.inner.release(seq_id)
