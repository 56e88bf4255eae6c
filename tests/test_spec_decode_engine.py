"""Speculative decoding in the engine (n-gram prompt lookup): drafts verified in the decode buckets
give exactly the outputs of plain decoding (greedy and seeded sampling), with no recompile, the
block manager consistent after rejections, and nothing leaked after aborts."""

from __future__ import annotations

import pytest

from conftest import tiny_llm
from runtime import SamplingParams
from config.engine_config import EngineConfig

ENGINE = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=96)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llms():
    return {"plain": tiny_llm(**ENGINE), "spec": tiny_llm(**ENGINE, speculative_config=NGRAM)}


def outputs(llm, prompts, params):
    return [(c.token_ids, c.finish_reason, c.stop_reason) for o in llm.generate(prompts, params) for c in o.outputs]


# Repetitive prompts give the n-gram proposer something to find; the tiny random model repeats
# itself too, so drafts are both accepted and rejected.
PROMPTS = [[5, 6, 7, 8] * 6, list(range(3, 20)) * 2, [9, 9, 9, 9, 9, 9], list(range(40, 71)), [11, 12] * 10]


@pytest.mark.slow
def test_greedy_outputs_equal_plain_decoding(llms):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 7, 30, 45, 64)]
    assert outputs(llms["spec"], PROMPTS, params) == outputs(llms["plain"], PROMPTS, params)
    st = llms["spec"].engine.stats()
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.num_recompiles == 0
    assert llms["spec"].engine.block_manager.num_used == 0


def test_seeded_sampling_outputs_equal_plain_decoding(llms):
    """Verify row j samples output token n+j with the key a plain step uses for it, so with a seed the
    sampled tokens are the same; the output distribution is therefore the target model's."""
    params = [SamplingParams(temperature=t, top_p=0.95, seed=s, max_tokens=40, ignore_eos=True)
              for s, t in enumerate((0.3, 0.7, 1.0, 1.3, 0.5))]
    assert outputs(llms["spec"], PROMPTS, params) == outputs(llms["plain"], PROMPTS, params)


def test_stops_and_limits_inside_the_draft_window(llms):
    plain = outputs(llms["plain"], PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # Stop on a token that the greedy continuation produces mid-way: the speculative run must end
    # at the same place, though accepted drafts may run past it.
    stops = [toks[len(toks) // 2] for toks, _, _ in plain]
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t], ignore_eos=True) for t in stops]
    assert outputs(llms["spec"], PROMPTS, params) == outputs(llms["plain"], PROMPTS, params)
    assert llms["spec"].engine.block_manager.num_used == 0


def test_aborts_leak_no_blocks(llms):
    eng = llms["spec"].engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"abort-{i}", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(6):
        eng.step()
    for i in range(len(PROMPTS)):
        eng.abort_request(f"abort-{i}")
    eng.step()
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_used == 0


def test_batch_one_engine_verifies_whole_drafts(llms):
    """max_num_seqs=1 (or any count below k+1): a verify step lays one sequence's k drafts out as k+1
    rows, so the bucket table must hold k+1 rows per sequence or every full draft is dropped."""
    spec = tiny_llm(**ENGINE | dict(max_num_seqs=1), speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, trace=True)
    out = spec.generate([PROMPTS[0]], params)[0]
    assert outputs(spec, [PROMPTS[0]], params) == outputs(llms["plain"], [PROMPTS[0]], params)
    drafts = [s.get("drafts", 0) for s in out.trace["steps"]]
    assert max(drafts) == NGRAM["num_speculative_tokens"], drafts
    assert spec.engine.stats().num_recompiles == 0


def test_bad_speculative_configs_are_named():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "ngram_size": 3}')
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_acceptance_metrics_over_http(llms):
    """vLLM's spec_decode counters on /metrics carry the engine's counts, and the request trace
    reports the drafts each step verified."""
    import httpx

    from test_metrics import scrape
    from runtime.serve import ServerThread, build_app

    engine = llms["spec"].engine
    app = build_app(engine, served_model_names=["tiny"], log_stats_interval=0)
    with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24,
                                               "temperature": 0, "ignore_eos": True, "trace": True}).json()
        m = scrape(http)
    s = engine.stats()
    assert m["vllm:spec_decode_num_drafts_total"] == s.spec_num_drafts > 0
    assert m["vllm:spec_decode_num_draft_tokens_total"] == s.spec_num_draft_tokens
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == s.spec_num_accepted_tokens
    per_pos = [m[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)]
    assert sum(per_pos) == s.spec_num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    trace = r["trace"][0]
    assert trace["spec_draft_tokens"] >= trace["spec_accepted_tokens"] >= 0
    assert sum(st.get("drafts", 0) for st in trace["steps"]) == trace["spec_draft_tokens"]


@pytest.fixture(scope="module")
def smol_spec_llm(smollm2):
    """SmolLM2 with n-gram speculation, the shared engine's settings otherwise."""
    from conftest import SMOL_ARGS
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan

    config, weights, tok = smollm2
    plan = compile_plan(None, EngineConfig(**SMOL_ARGS, speculative_config=NGRAM), weights=weights, config=config,
                        tokenizer=tok)
    return LLM.from_plan(plan, check_invariants=True)


def test_smollm2_greedy_outputs_equal_plain_decoding(smol_llm, smol_spec_llm):
    """The golden prompts, and 16 mixed prompts in one batch (chat questions, a list to repeat, code),
    give the same greedy tokens with and without speculation on the real model."""
    import json

    from conftest import golden_prompts

    tok = smol_llm.get_tokenizer()
    chat = lambda q: tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))  # noqa: E731
    golden = [tok.encode(p["rendered_text"]) for p in golden_prompts()]
    questions = ["Repeat this list exactly: red, green, blue, red, green, blue, cyan, magenta",
                 "What is the capital of France?", "Write a Python function that adds two numbers.",
                 "Count from 1 to 20, separated by commas.", "Name three planets.", "Why is the sky blue?",
                 "Spell the word 'banana' letter by letter.", "Give me a JSON object with keys a and b.",
                 "Write the alphabet in capitals.", "What is 12 times 12?", "Say 'hello' five times.",
                 "List the days of the week."]
    prompts = (golden + [chat(q) for q in questions])[:16]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = outputs(smol_llm, prompts, params)
    spec = outputs(smol_spec_llm, prompts, params)
    assert spec == plain, json.dumps([i for i, (a, b) in enumerate(zip(spec, plain)) if a != b])
    s = smol_spec_llm.engine.stats()
    assert s.spec_num_accepted_tokens > 0 and s.num_recompiles == 0
    assert smol_spec_llm.engine.block_manager.num_used == 0


# Issue 48's prompt: SmolLM2 continues the list (", item12, ..., item35"), every token of it in the prompt.
COPY_LIST = ("Repeat this list exactly: " + ", ".join(f"item{i}" for i in range(40)) + ". List: "
             + ", ".join(f"item{i}" for i in range(12)))


def test_smollm2_one_sequence_engine_drafts_the_copied_list(smollm2, smol_llm):
    """A batch-1 engine (max_num_seqs=1) with the issue's settings drafts and keeps most of the copy,
    and its greedy tokens are the plain engine's."""
    from conftest import SMOL_ARGS
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan

    config, weights, tok = smollm2
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engine = EngineConfig(**SMOL_ARGS | dict(max_num_seqs=1), speculative_config=ngram)
    spec = LLM.from_plan(compile_plan(None, engine, weights=weights, config=config, tokenizer=tok))
    params = SamplingParams(temperature=0, max_tokens=96, trace=True)
    out = spec.generate([COPY_LIST], params)[0]
    assert out.outputs[0].token_ids == smol_llm.generate([COPY_LIST], params)[0].outputs[0].token_ids
    assert out.outputs[0].text.startswith(", item12, item13, item14")
    assert out.trace["spec_accepted_tokens"] >= 64, out.trace["spec_draft_tokens"]  # of 96
    assert len(out.trace["steps"]) <= 40
