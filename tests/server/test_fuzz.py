"""schemathesis fuzzes the served OpenAPI schema of `ppd serve` (demo model): bodies that fit the
schema (positive) and bodies that break it (negative), with the real model name. No answer may be a
5xx, and no worker may die."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_process import ServerProcess

schemathesis = pytest.importorskip("schemathesis")

MODEL = "demo"
# generation is bounded so the run stays short; every other field is fuzzed over its whole schema
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server("--policy", "ppd", "--max-num-seqs", "8")


def pin(schema: dict) -> dict:
    """The server's schema with `model` fixed to the served name and output lengths capped, in every
    request body."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        props = component.get("properties", {})
        if "model" in props:
            props["model"] = {"type": "string", "enum": [MODEL]}
        for field in ("max_completion_tokens", "min_tokens"):
            if field in props:
                props[field] = {
                    "anyOf": [
                        {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS},
                        {"type": "null"},
                    ]
                }
        # Without one an answer may run to the end of the context (seconds each).
        for field in ("max_tokens", "max_output_tokens"):
            if field in props:
                props[field] = {"type": "integer", "minimum": 0, "maximum": MAX_TOKENS}
                component["required"] = sorted({*component.get("required", []), field})
        if "n" in props:
            props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
    return schema


@pytest.fixture(scope="module")
def operations(server: ServerProcess) -> list:
    raw = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(pin(raw))
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/health",
    }
    return ops


# 200 cases a mode, in the second suite: a server of its own and two minutes of requests on 2 cores,
# which the default suite's 10-minute budget cannot hold (its 60 cases a mode were a subset of
# these); tests/server/test_hostile.py's named bad inputs stay in the default suite.
@pytest.mark.slow
@pytest.mark.parametrize(("mode", "examples"), [("positive", 200), ("negative", 200)])
def test_fuzzed_requests_never_get_a_5xx(
    server: ServerProcess, operations: list, mode: str, examples: int
) -> None:
    pids = server.worker_pids()
    generation = (
        schemathesis.GenerationMode.POSITIVE
        if mode == "positive"
        else schemathesis.GenerationMode.NEGATIVE
    )
    cases = st.one_of(*(op.as_strategy(generation_mode=generation) for op in operations))
    statuses: list[int] = []

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )
    @given(case=cases)
    def fuzz(case) -> None:
        response = case.call(base_url=server.url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (
            f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
        )

    fuzz()
    assert server.worker_pids() == pids, "a worker died"
    if mode == "positive":
        assert 200 in statuses  # the fuzzer reached the model, not only the validators
