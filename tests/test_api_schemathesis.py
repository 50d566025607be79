"""Schemathesis over the running app's OpenAPI schema: generated requests, valid and invalid, never get a 5xx.

The schema's Hypothesis strategies are driven directly (one `@given` per operation) because
schemathesis' lazy pytest fixture loader (`schemathesis.pytest.from_fixture`) fails on pytest 9.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from servers import AppServer

pytestmark = pytest.mark.integration

KEY = "schemathesis-key-01"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 30  # per operation and mode: keeps the file well under two minutes on 2 shared cores
PUBLIC_PATHS = {"/tts", "/v1/audio/speech", "/v1/models", "/v1/audio/voices", "/inference_sft", "/readyz", "/healthz"}


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    # Short texts keep each synthesis cheap; keys on, so the authenticated paths are exercised too.
    env = {"TTS_API_KEYS": KEY, "TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_MAX_CHARS": "40", "TTS_QUEUE_MAX": "64"}
    server = AppServer(tmp_path_factory.mktemp("schemathesis"), tiny_bundle, env)
    server.start()
    yield server
    server.stop()
    server.dump_log()


@pytest.fixture(scope="module")
def api_schema(app: AppServer) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(app.base_url + "/openapi.json")


def error_is_json(response: schemathesis.Response) -> str | None:
    """Every error the app answers is a JSON envelope `{"error": {"message": ...}}`; returns a complaint or None."""
    if response.status_code < 400:
        return None
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} without the JSON error envelope: {response.content[:200]!r}"
    return None if isinstance(message, str) and message else f"empty error message: {response.content[:200]!r}"


def fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str) -> tuple[int, list[str]]:
    """Run one operation's strategy; return how many examples ran and the failures (one description each)."""
    failures: list[str] = []
    examples = 0
    session = requests.Session()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def run(case: schemathesis.Case) -> None:
        nonlocal examples
        examples += 1
        try:
            response = case.call_and_validate(
                base_url=base_url, session=session, headers=AUTH, checks=[not_a_server_error], timeout=60
            )
        except Exception as e:  # collect and go on: one report lists every operation that fails
            failures.append(
                f"{operation.label} [{mode.value}]: {type(e).__name__}: {str(e)[:600]}\n  {case.as_curl_command(AUTH)}"
            )
            return
        complaint = error_is_json(response)
        if complaint:
            failures.append(f"{operation.label} [{mode.value}]: {complaint}\n  {case.as_curl_command(AUTH)}")

    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (an operation without parameters or body)
        assert mode is GenerationMode.NEGATIVE and examples == 0
    finally:
        session.close()
    return examples, failures


def test_schema_lists_the_public_endpoints(api_schema: schemathesis.BaseSchema) -> None:
    paths = set(api_schema.raw_schema["paths"])
    assert paths >= PUBLIC_PATHS, PUBLIC_PATHS - paths
    api_schema.validate()  # the document itself is valid OpenAPI


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_server_errors(api_schema: schemathesis.BaseSchema, app: AppServer, mode: GenerationMode) -> None:
    results = list(api_schema.get_all_operations())
    assert all(isinstance(r, Ok) for r in results), [r for r in results if not isinstance(r, Ok)]
    operations = [r.ok() for r in results if isinstance(r, Ok)]
    assert {op.path for op in operations} >= PUBLIC_PATHS
    runs = {op.label: fuzz(op, mode, app.base_url) for op in operations}
    failures = [f for _, found in runs.values() for f in found]
    assert not failures, "\n".join(failures[:20])
    synthesis = {label: n for label, (n, _) in runs.items() if any(p in label for p in ("/tts", "/speech", "/inference_sft"))}
    assert len(synthesis) >= 4 and all(n > 0 for n in synthesis.values()), synthesis
    assert app.ready() and app.alive()
