"""Tree verification forward: node logits under the tree mask equal the logits of the
root-to-node path run as a plain sequence; compaction commits a path exactly."""
from __future__ import annotations

import pytest
import torch

from models import ModelConfig, OutOfBlocks, Transformer
from models.transformer import causal_mask

from .conftest import prefill

ATOL = 1e-4
# parent of each node (-1 = child of the prefix's last token), topologically ordered
PARENTS = [-1, -1, 0, 0, 1, 2, 5, -1]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(arch="qwen2", vocab_size=80, hidden_size=48, intermediate_size=72, num_layers=2,
                      num_heads=6, num_kv_heads=2, head_dim=8, attention_bias=True, rope_theta=1000.0)
    torch.manual_seed(3)
    m = Transformer(cfg).eval()
    for p in m.parameters():
        p.normal_(0, 0.3)
    return m


def paths(parents):
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j != -1:
            path.append(j)
            j = parents[j]
        out.append(path[::-1])
    return out


def tree_inputs(parents, tokens, prefix_len):
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i, path in enumerate(paths(parents)):
        mask[i, path] = True
    depths = mask.sum(-1)
    return tokens[None], (prefix_len + depths - 1)[None], mask[None]


def run_chain(model, ids):
    cache = model.new_cache(16, 4)
    with torch.no_grad():
        return prefill(model, cache, 0, ids)


def tree_logits(model, prefix: torch.Tensor, tokens: torch.Tensor, parents=PARENTS) -> torch.Tensor:
    """Logits [T, V] of a tree of `tokens` (shaped by `parents`) over a freshly prefilled `prefix`."""
    cache = model.new_cache(16, 4)
    with torch.no_grad():
        prefill(model, cache, "s", prefix)
        ids, positions, mask = tree_inputs(parents, tokens, len(prefix))
        got = model(ids, positions, cache, ["s"], mask)[0]
    assert cache.seq_len("s") == len(prefix) + len(parents)
    return got


def test_tree_logits_equal_each_path_as_a_sequence(model):
    prefix = torch.tensor([5, 9, 2, 77, 31, 8, 1, 40, 3, 12, 6])      # 11 tokens: trees cross a block edge
    tokens = torch.tensor([4, 18, 60, 22, 7, 51, 33, 2])
    got = tree_logits(model, prefix, tokens)                          # [T, V]
    for i, path in enumerate(paths(PARENTS)):
        want = run_chain(model, torch.cat([prefix, tokens[path]]))[-1]
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0, msg=f"node {i}")


def test_batched_trees_with_logit_rows_and_positions(model):
    prefixes = [torch.tensor([5, 9, 2]), torch.tensor([7, 7, 1, 30, 12, 44, 2])]
    tokens = torch.tensor([[4, 18, 60, 22, 7, 51, 33, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
    rows = torch.tensor([3, 0, 79])
    cache = model.new_cache(32, 4)
    with torch.no_grad():
        for b, p in enumerate(prefixes):
            prefill(model, cache, b, p)
        batch = [tree_inputs(PARENTS, tokens[b], len(prefixes[b])) for b in range(2)]
        ids, positions, mask = (torch.cat(x) for x in zip(*batch))
        full, hidden = model(ids, positions, cache, [0, 1], mask, return_hidden=True)
        for b in range(2):
            cache.truncate(b, len(prefixes[b]))
        picked = model(ids, positions, cache, [0, 1], mask, logit_rows=rows,
                       logit_positions=torch.tensor([[7, 2], [0, 7]]))
    assert full.shape == (2, 8, 80) and full.dtype == torch.float32 and hidden.shape == (2, 8, 48)
    torch.testing.assert_close(picked[0], full[0][[7, 2]][:, rows], atol=ATOL, rtol=0)
    torch.testing.assert_close(picked[1], full[1][[0, 7]][:, rows], atol=ATOL, rtol=0)
    for b in range(2):
        for i, path in enumerate(paths(PARENTS)):
            want = run_chain(model, torch.cat([prefixes[b], tokens[b][path]]))[-1]
            torch.testing.assert_close(full[b, i], want, atol=ATOL, rtol=0)


def test_compacted_path_gives_the_same_next_logits_as_decoding_it(model):
    prefix = torch.tensor([5, 9, 2, 77, 31, 8])
    tokens = torch.tensor([4, 18, 60, 22, 7, 51, 33, 2])
    accepted = paths(PARENTS)[6]                                       # nodes 0, 2, 5, 6
    cache = model.new_cache(16, 4)
    with torch.no_grad():
        prefill(model, cache, "s", prefix)
        ids, positions, mask = tree_inputs(PARENTS, tokens, len(prefix))
        model(ids, positions, cache, ["s"], mask)
        cache.compact("s", len(prefix), accepted)
        n = len(prefix) + len(accepted)
        bonus = torch.tensor([[11]])
        got = model(bonus, torch.tensor([[n]]), cache, ["s"], causal_mask(1, 1))[0, -1]
    want = run_chain(model, torch.cat([prefix, tokens[accepted], bonus[0]]))[-1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    cache.free("s")
    assert cache.num_free_blocks == cache.num_blocks


def test_out_of_blocks_in_forward_leaves_every_sequence_unchanged(model):
    cache = model.new_cache(num_blocks=4, block_size=4)
    with torch.no_grad():
        prefill(model, cache, "a", torch.tensor([1, 2, 3]))
        prefill(model, cache, "b", torch.tensor([4, 5, 6, 7, 8, 9, 10]))
        before = (cache.num_free_blocks, cache.seq_len("a"), cache.seq_len("b"))
        assert before[0] == 1                     # "a" fits in it, then "b" does not
        ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
        with pytest.raises(OutOfBlocks):
            model(ids, torch.tensor([[3, 4, 5], [7, 8, 9]]), cache, ["a", "b"], causal_mask(2, 3))
    assert (cache.num_free_blocks, cache.seq_len("a"), cache.seq_len("b")) == before


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("transposed_gemv", [False, True])
def test_prepacked_cpu_linear_follows_weight_updates(rows, transposed_gemv):
    from models.linear import Linear

    torch.manual_seed(0)
    lin = Linear(16, 24)
    lin._pack.transposed_gemv = transposed_gemv
    x = torch.randn(rows, 16)                               # 5 rows: the prepacked path where available
    with torch.no_grad():
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)
        lin.weight.mul_(-2.0)                               # in-place update must drop the stale pack
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)
        lin.weight = torch.nn.Parameter(torch.randn(24, 16), requires_grad=False)
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, atol=1e-5, rtol=0)


def test_pack_groups_keeps_small_trees_together_and_a_chunk_apart():
    from models.tree import pack_groups

    trees = [1, 5, 3, 5, 2, 4, 5, 1]
    assert sorted(pack_groups(trees)[0]) == list(range(8)) and len(pack_groups(trees)) == 1   # 8 rows of padding
    groups = pack_groups(trees + [64])
    assert groups[-1] == [8] and sorted(i for g in groups[:-1] for i in g) == list(range(8))
    assert pack_groups([40, 41, 39]) == [[2, 0, 1]]                                 # similar prompts: one group
    assert pack_groups([]) == []
    # contexts: trees of similar contexts together; a short chunk deep into a long prompt apart
    # (every member of a group attends over its longest context)
    contexts = [300, 310, 290, 305, 320, 300, 295, 315]
    assert len(pack_groups(trees, contexts)) == 1
    groups = pack_groups(trees + [4], contexts + [1004])
    assert groups[-1] == [8] and len(groups) == 2
    assert len(pack_groups([5, 5, 5, 5], [100, 120, 1000, 1100])) == 2             # contexts far apart


def test_a_packed_forward_equals_each_sequence_on_its_own(model):
    """A 40-token prompt chunk beside trees of 8, 3 and 1 nodes (two groups: the trees, the
    chunk) in one packed forward: every sequence's logits, hidden states and cache contents equal
    those of its own forward, and each sequence grew by exactly its own tokens."""
    from models.tree import pack_groups, ragged_tree_forward

    torch.manual_seed(5)
    prefixes = [torch.randint(0, 80, (n,)) for n in (3, 9, 14, 6)]
    parents = [PARENTS, [-1, 0, 1], None, [-1]]          # None: the chunk, a causal chain
    chunk = torch.randint(0, 80, (40,))
    sizes = [len(PARENTS), 3, 40, 1]
    assert len(pack_groups(sizes)) == 2                    # the trees together, the chunk apart

    def inputs(b):
        if parents[b] is None:
            n = len(chunk)
            return chunk, len(prefixes[b]) + torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
        ids, pos, mask = tree_inputs(parents[b], torch.randint(0, 80, (len(parents[b]),)), len(prefixes[b]))
        return ids[0], pos[0], mask[0]

    batch = [inputs(b) for b in range(4)]
    logit_positions = [torch.arange(sizes[b]) if parents[b] is not None else torch.tensor([39, 0]) for b in range(4)]
    cache = model.new_cache(64, 4)
    with torch.no_grad():
        for b, p in enumerate(prefixes):
            prefill(model, cache, b, p)
        got, hidden = ragged_tree_forward(model, cache, list(range(4)), [x[0] for x in batch], [x[1] for x in batch],
                                          [x[2] for x in batch], logit_positions, return_hidden=True)
        for b in range(4):
            assert cache.seq_len(b) == len(prefixes[b]) + sizes[b]
            alone = model.new_cache(64, 4)
            prefill(model, alone, "s", prefixes[b])
            ids, pos, mask = batch[b]
            want_logits, want_hidden = model(ids[None], pos[None], alone, ["s"], mask[None], return_hidden=True)
            torch.testing.assert_close(got[b], want_logits[0][logit_positions[b]], atol=ATOL, rtol=0)
            torch.testing.assert_close(hidden[b], want_hidden[0], atol=ATOL, rtol=0)
            n = len(prefixes[b]) + sizes[b]
            mine, theirs = cache.block_table([b])[0].long(), alone.block_table(["s"])[0].long()
            for layer in range(model.config.num_layers):
                k_mine = cache.k[layer][mine].reshape(-1, *cache.k.shape[-2:])[:n]
                k_alone = alone.k[layer][theirs].reshape(-1, *alone.k.shape[-2:])[:n]
                torch.testing.assert_close(k_mine, k_alone, atol=ATOL, rtol=0)


def test_out_of_blocks_in_a_later_group_leaves_every_group_unchanged(model):
    from models.tree import ragged_tree_forward

    cache = model.new_cache(num_blocks=6, block_size=4)
    with torch.no_grad():
        prefill(model, cache, "a", torch.tensor([1, 2, 3]))
        prefill(model, cache, "b", torch.tensor([4, 5, 6]))
        before = (cache.num_free_blocks, cache.seq_len("a"), cache.seq_len("b"))
        chunk = torch.arange(30) % 80                 # "a"'s one-token step fits, "b"'s chunk does not
        with pytest.raises(OutOfBlocks):
            ragged_tree_forward(model, cache, ["a", "b"], [torch.tensor([7]), chunk],
                                [torch.tensor([3]), 3 + torch.arange(30)],
                                [torch.ones(1, 1, dtype=torch.bool), torch.ones(30, 30, dtype=torch.bool).tril()],
                                [torch.tensor([0]), torch.zeros(0, dtype=torch.long)])
    assert (cache.num_free_blocks, cache.seq_len("a"), cache.seq_len("b")) == before
