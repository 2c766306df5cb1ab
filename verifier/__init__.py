"""Tree verification with exact rejection sampling against the target model.

Contract: docs/internals.md, `drafter / verifier` section.
"""
from verifier.verifier import StaleTreeError, Verifier, VerifyRequest, VerifyResult, rejection_sample

__all__ = ["StaleTreeError", "Verifier", "VerifyRequest", "VerifyResult", "rejection_sample"]
