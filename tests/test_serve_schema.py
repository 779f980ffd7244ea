"""schemathesis fuzzes `kvlab serve` from its own /openapi.json (as vLLM's test suite does): for every
operation, bounded examples and fuzzed bodies; never a 5xx, every error in OpenAI's shape, every status
and body as the schema documents them. The server is small (64-token context, 4 sequences) so that the
worst request the schema allows stays cheap.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, \
    status_code_conformance

from serve_helpers import ServerProcess, clean_exit

ERROR_KEYS = {"message", "type", "param", "code"}
MAX_EXAMPLES = 15   # per operation and mode: bounded, so CI stays quick


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess("--max-model-len", "64", "--max-num-seqs", "4", "--max-waiting", "8",
                         log_dir=tmp_path_factory.mktemp("schema"))
    yield proc
    assert clean_exit(proc.stop()), proc.log()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


WITHOUT_INPUT = ["GET /health", "GET /metrics", "GET /v1/models"]   # nothing to fuzz: positive only
WITH_INPUT = ["POST /tokenize", "POST /detokenize", "POST /reset_prefix_cache", "GET /v1/cache/state",
              "POST /v1/completions", "POST /v1/chat/completions"]
CASES = [(label, GenerationMode.POSITIVE) for label in WITHOUT_INPUT + WITH_INPUT] + \
        [(label, GenerationMode.NEGATIVE) for label in WITH_INPUT]


@pytest.mark.parametrize("label, mode", CASES)
def test_the_api_never_fails_and_keeps_to_its_schema(api_schema, label, mode):
    """Examples valid under the schema (positive) and fuzzed ones that break it (negative): never a 5xx,
    errors in OpenAI's shape, statuses, content types and bodies as documented."""
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, label

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(timeout=60)
        case.validate_response(response, checks=(not_a_server_error, status_code_conformance,
                                                 content_type_conformance, response_schema_conformance))
        if response.status_code >= 400:
            assert set(response.json()["error"]) == ERROR_KEYS, response.text

    run()


def test_the_schema_documents_openai_errors_and_no_422(server):
    spec = server.get("/openapi.json").json()
    assert sorted(f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops) == \
        sorted(WITHOUT_INPUT + WITH_INPUT)   # every operation is fuzzed
    completions = spec["paths"]["/v1/completions"]["post"]
    assert "422" not in completions["responses"]
    assert {"400", "413", "429"} <= set(completions["responses"])
    assert spec["components"]["schemas"]["ErrorResponse"]["properties"]["error"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["stop_token_ids"]["maxItems"] == 256
    assert server.wait_idle()["num_used_blocks"] == 0
