"""Random, valid inputs for the kernels: shared by tests/kernels, tests/gpu and bench/kernel_bench.py.

`make_paged_inputs` builds what a verifier step hands `tree_decode_attention`:
a paged KV cache whose pages are scattered over the pool, an over-wide block
table whose unused tail points at other sequences' pages (a kernel must not
read past a sequence's end), and a random token tree per sequence.
"""
from __future__ import annotations

import torch


def random_parents(T: int, gen: torch.Generator) -> list[int]:
    """A random topologically ordered tree: node i's parent is -1 or an earlier node."""
    return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(T)]


def tree_mask_from_parents(parents: list[int]) -> torch.Tensor:  # [T, T] bool
    """mask[i, j] = node j is node i or one of its ancestors."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def make_paged_inputs(
    B: int, T: int, Hq: int, Hkv: int, D: int, page: int, prefix: list[int],
    dtype: torch.dtype = torch.float32, seed: int = 0, device: str | torch.device = "cpu",
    pool_factor: int = 1,
):
    """(q, k_cache, v_cache, block_tables, prefix_lens, tree_mask) on `device`.

    q [B, T, Hq, D]; caches [N_blocks, page, Hkv, D]; block_tables [B, width]
    int32; prefix_lens [B] int32; tree_mask [B, T, T] bool. `pool_factor` > 1
    makes the pool that many times larger than needed (to defeat caches in
    benchmarks).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [(p + T + page - 1) // page for p in prefix]
    width = max(need) + 2
    n_blocks = pool_factor * sum(need) + 5
    perm = torch.randperm(n_blocks, generator=gen)  # pages scattered over the pool
    block_tables = torch.empty(B, width, dtype=torch.int32)
    used = 0
    for b in range(B):
        block_tables[b, : need[b]] = perm[used: used + need[b]].to(torch.int32)
        block_tables[b, need[b]:] = perm[: width - need[b]].to(torch.int32)  # junk tail
        used += need[b]
    tree_mask = torch.stack([tree_mask_from_parents(random_parents(T, gen)) for _ in range(B)])
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    cache_shape = (n_blocks, page, Hkv, D)
    k_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)
    q = torch.randn(B, T, Hq, D, generator=dev_gen, device=device, dtype=dtype)
    prefix_lens = torch.tensor(prefix, dtype=torch.int32)
    return (q, k_cache, v_cache, block_tables.to(device), prefix_lens.to(device),
            tree_mask.to(device))


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||y|| in float64; NaN anywhere makes it NaN (and fails any `<`)."""
    return float((x.double() - y.double()).norm() / y.double().norm())


def poison_allocations(monkeypatch) -> None:
    """Make tree attention's output and split scratch start as NaN (pytest monkeypatch),
    so an element the kernel fails to write shows up in the result."""
    from kernels import tree_attention

    monkeypatch.setattr(tree_attention, "_new_output", lambda q: torch.full_like(q, float("nan")))
    monkeypatch.setattr(tree_attention, "_new_scratch", lambda *shape, device: torch.full(
        shape, float("nan"), device=device, dtype=torch.float32))
