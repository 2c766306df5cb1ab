"""The drafter: proposers (a draft model's chains and EAGLE-2 trees, an EAGLE draft head, n-gram
prompt lookup) and the drafter's runtime (streams drafted ahead on an assumed outcome,
rollback, bridge and restart chains), free of Ray.

Contract: docs/internals.md, "drafter".
"""
from drafter.eagle_proposer import EagleProposer
from drafter.model_proposer import ModelProposer
from drafter.ngram import NgramProposer

__all__ = ["EagleProposer", "ModelProposer", "NgramProposer"]
