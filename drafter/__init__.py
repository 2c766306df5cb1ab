"""Token-tree proposal: draft-model chains and EAGLE-2 trees, and n-gram prompt lookup.

Contract: docs/internals.md, `drafter / verifier` section.
"""
from drafter.base import DraftRequest, Proposer
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from models.tree import TokenTree

__all__ = ["DraftRequest", "ModelProposer", "NgramProposer", "Proposer", "TokenTree"]
