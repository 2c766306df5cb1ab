"""The serving front, free of Ray: OpenAI-compatible HTTP and SSE, gRPC, the incremental
detokenizer, access control and the Prometheus exposition, over an injected engine
(docs/internals.md, "serving")."""
