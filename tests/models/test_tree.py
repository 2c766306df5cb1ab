"""TokenTree bookkeeping (models/tree.py): chains, masks, the empty tree and malformed trees."""
from __future__ import annotations

import pytest
import torch

from models.tree import TokenTree

V = 12


def test_chain_and_masks():
    tree = TokenTree.chain([5, 6, 7], None, prefix_len=10, epoch=2)
    assert tree.parent_ids.tolist() == [-1, 0, 1] and tree.depths.tolist() == [1, 2, 3]
    assert torch.equal(tree.tree_mask(), torch.ones(3, 3, dtype=torch.bool).tril())
    vm = tree.verification_mask()
    assert vm.shape == (4, 4) and vm[:, 0].all() and not vm[0, 1:].any()


def test_tree_mask_of_a_branching_tree():
    #        root
    #       /    \
    #      0      1
    #     / \     |
    #    2   3    4
    tree = TokenTree(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([-1, -1, 0, 0, 1]),
                     torch.tensor([1, 1, 2, 2, 2]), None, prefix_len=4)
    m = tree.tree_mask()
    assert m[3].tolist() == [True, False, False, True, False]
    assert m[4].tolist() == [False, True, False, False, True]
    assert not m[2, 3] and not m[0, 1]
    assert tree.path_to(4) == [1, 4]


def test_empty_tree_and_bad_trees():
    empty = TokenTree.empty(prefix_len=3)
    assert empty.num_nodes == 0 and empty.tree_mask().shape == (0, 0)
    assert empty.verification_mask().tolist() == [[True]]
    with pytest.raises(ValueError, match="topologically"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([1, -1]), torch.tensor([2, 1]), None, 3)
    with pytest.raises(ValueError, match="T\\+1"):
        TokenTree.chain([1, 2], torch.zeros(2, V), prefix_len=3)
