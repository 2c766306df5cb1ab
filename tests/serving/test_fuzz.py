"""Fuzz the HTTP API from its own OpenAPI schema with schemathesis (issue 7): no 5xx.

The FastAPI app runs in-process over the FakeEngine; schemathesis reads `/openapi.json` (which
carries the request models, serving/openai_routes.py) and Hypothesis generates, with a fixed
budget and a fixed seed (derandomize), bodies that fit the schema (positive) and bodies that
break it (negative). Every response must not be a server error, must have a documented status
and content type, must match its documented schema, and schema-breaking bodies must be refused.
Model-dependent refusals of schema-valid bodies (prompt plus max_tokens over the context) are
fine, so schemathesis's positive-data-acceptance check is not run. Run with `-s` for the tally.
"""
from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

from serving.openai_api import OpenAIServer, ServerSettings
from serving.openai_routes import build_fastapi_app  # noqa: E402
from serving.testing import FakeEngine, tiny_byte_tokenizer  # noqa: E402

EXAMPLES = 100   # per operation and generation mode
CHECKS = [not_a_server_error, openapi_checks.status_code_conformance,
          openapi_checks.content_type_conformance, openapi_checks.response_schema_conformance,
          openapi_checks.response_headers_conformance, openapi_checks.negative_data_rejection]


def test_fuzz_the_http_api_from_its_openapi_schema():
    tok = tiny_byte_tokenizer()
    engine = FakeEngine(tokenizer=tok, eos_token_id=0)
    server = OpenAIServer(engine, tok, ServerSettings(max_context=64, max_queue=16))
    app = build_fastapi_app(server)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} == {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
        "GET /v1/models/{model_id}", "GET /health",
        "GET /metrics"}
    tally: Counter = Counter()
    for op in operations:
        modes = [GenerationMode.POSITIVE]
        if op.body:  # the GET routes take no input to break
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                response = case.call()
                tally[op.label, mode.value, response.status_code] += 1
                case.validate_response(response, checks=CHECKS)
            fuzz()
    print_tally(tally)
    tried = sum(tally.values())
    server_errors = sum(n for (_, _, status), n in tally.items() if status >= 500)
    assert server_errors == 0 and tried >= 4 * EXAMPLES
    for path in ("POST /v1/completions", "POST /v1/chat/completions"):
        # the schema is precise enough that valid bodies really reach the engine
        assert tally[path, "positive", 200] >= EXAMPLES // 10, tally
        assert tally[path, "negative", 400] > 0
    assert server.outstanding == 0 and engine.active == {}


def print_tally(tally: Counter) -> None:
    print(f"\n{'operation':28} {'mode':9} {'status':>6} {'count':>6}")
    for (label, mode, status), n in sorted(tally.items()):
        print(f"{label:28} {mode:9} {status:>6} {n:>6}")
    print(f"examples tried: {sum(tally.values())}, "
          f"5xx: {sum(n for k, n in tally.items() if k[2] >= 500)}")
