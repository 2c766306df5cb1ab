"""The vocabulary both sides of speculative decoding share, free of Ray: the requests an engine
serves, the wire format of trees and signals, the settings and their limits, the planner, the
stats, and the speculative step (docs/internals.md, "speculation")."""
