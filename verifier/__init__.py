"""The verifier: tree verification with exact rejection sampling against the target, and the
scheduler every engine runs (admission, the ring of drafted trees, signals to the drafters,
step costs), free of Ray.

Contract: docs/internals.md, "verifier".
"""
from verifier.verifier import StaleTreeError, Verifier, VerifyRequest, VerifyResult, rejection_sample

__all__ = ["StaleTreeError", "Verifier", "VerifyRequest", "VerifyResult", "rejection_sample"]
