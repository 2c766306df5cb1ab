"""Token-tree proposal: draft-model chains and EAGLE-2 trees (also with a feature-conditioned
EAGLE draft head), and n-gram prompt lookup.

Contract: docs/internals.md, `drafter / verifier` section.
"""
from drafter.base import DraftRequest, Proposer
from drafter.eagle_proposer import EagleProposer
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer
from models.tree import TokenTree

__all__ = ["DraftRequest", "EagleProposer", "ModelProposer", "NgramProposer", "Proposer", "TokenTree"]
