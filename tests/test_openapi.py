"""/openapi.json describes the server well enough for a fuzzer: a bounded schemathesis run against
a real uvicorn server finds no server error and no response that breaks the schema."""

from __future__ import annotations

import httpx
import pytest

from runtime.serve import ServerThread, build_app


@pytest.fixture(scope="module")
def fuzz_server(smollm2):
    """A small random model with SmolLM2's real tokenizer (and vocabulary): the API is the
    subject here, not the text, and every request finishes in milliseconds."""
    from dataclasses import replace

    from models.config import get_preset
    from models.weights import random_weights
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    _, _, tok = smollm2
    cfg = replace(get_preset("tiny"), name="tiny-smolvocab", vocab_size=tok.vocab_size, eos_token_id=2)
    plan = compile_plan(None, EngineConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64,
                                           num_kv_blocks=64), weights=random_weights(cfg, seed=0),
                        config=cfg, tokenizer=tok)
    llm = LLM.from_plan(plan, check_invariants=True)
    app = build_app(llm.engine, served_model_names=["tiny"], log_stats_interval=0)
    with ServerThread(app) as st:
        yield st, llm.engine
    assert not llm.engine.has_unfinished_requests()


def test_openapi_and_docs_are_served(fuzz_server):
    st, _ = fuzz_server
    schema = httpx.get(st.url + "/openapi.json").json()
    assert schema["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
            "/health", "/metrics"} <= set(schema["paths"])
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    props = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"prompt", "max_tokens", "temperature", "top_k", "stream"} <= set(props)
    docs = httpx.get(st.url + "/docs")
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_schemathesis_finds_no_server_error_and_no_schema_break(fuzz_server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    st, engine = fuzz_server
    schema = schemathesis.openapi.from_url(st.url + "/openapi.json")
    failures = []
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=12, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            nonlocal calls
            calls += 1
            try:
                # Every check but "schema-valid data is accepted": value ranges (temperature,
                # top_p, ...) and cross-field rules are SamplingParams' and the handlers' to
                # enforce, with 400s the schema documents, not JSON-schema constraints.
                case.call_and_validate(base_url=st.url, timeout=30,
                                       excluded_checks=[positive_data_acceptance])
            except Exception as e:  # noqa: BLE001 - collect every failing operation, then report
                failures.append(f"{operation.label}: {type(e).__name__}: {str(e)[:400]}")
                raise

        try:
            check()
        except Exception:  # noqa: BLE001 - recorded above
            pass
    assert calls >= 40
    assert not failures, "\n".join(failures)
    assert httpx.get(st.url + "/health").status_code == 200
    assert engine.block_manager.num_used == 0 or engine.has_unfinished_requests()
