"""The textbook lowering against HF transformers, and the golden SmolLM2 outputs.

Tiny random HF models (GQA; tied and untied embeddings; Qwen2's qkv bias) are saved as
safetensors by the test, loaded back through `models.weights.load_safetensors`, and run two
ways: the textbook graph (`models.llama.lower`, contiguous caches) and the served graph after
the whole pass pipeline (paged KV, fused matmuls). Each runs a ragged two-sequence prefill and
then a decode step that reads the cache; every logit must match transformers within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import golden_arrays, golden_prompts
from models.config import config_from_hf
from models.llama import lower
from models.weights import load_safetensors
from passes.pipeline import PipelineOptions, run_pipeline
from runtime.worker.executor import JNP_DTYPES, jit_step, state_names, to_device_params
from runtime.worker.params import materialize
from tolerances import GOLDEN_LOGITS, HF_LOGITS, ORDER_GAP

BLOCK_SIZE = 4


# ------------------------------------------------------------------------------ HF oracle

def _hf_model(kind: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6)
    torch.manual_seed({"gqa": 0, "tied": 1, "qwen2_bias": 2, "mha": 3}[kind])
    if kind == "qwen2_bias":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False))
    elif kind == "mha":
        model = LlamaForCausalLM(LlamaConfig(**dict(common, num_key_value_heads=4), tie_word_embeddings=True))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=(kind == "tied")))
    with torch.no_grad():
        # HF initializes norms to 1 and biases to 0; randomize everything so each tensor matters.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model.float().eval()


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


# A ragged prefill of two prompts, then one decode token each.
PROMPTS = [[5, 17, 3, 88, 42, 9, 61], [70, 2, 33, 14, 90]]
NEXT = [11, 58]


def _steps():
    prefill = [(i, 0, p) for i, p in enumerate(PROMPTS)]
    decode = [(i, len(p), [t]) for i, (p, t) in enumerate(zip(PROMPTS, NEXT))]
    return [prefill, decode]


def _contiguous_inputs(step, num_seqs):
    tokens = np.concatenate([np.array(ids, np.int32) for _, _, ids in step])
    positions = np.concatenate([np.arange(start, start + len(ids), dtype=np.int32) for _, start, ids in step])
    seq_ids = np.concatenate([np.full(len(ids), s, np.int32) for s, _, ids in step])
    return {"tokens": tokens, "positions": positions, "seq_ids": seq_ids,
            "logits_indices": np.arange(len(tokens), dtype=np.int32)}


def _paged_inputs(step, tables, window_tables=None):
    """`window_tables`: the window group's own tables (ir.kv_groups), for a graph that has one."""
    inputs = _contiguous_inputs(step, len(tables))
    seq_ids, positions = inputs.pop("seq_ids"), inputs["positions"]
    for prefix, t in (("", tables), ("window_", window_tables)):
        if t is not None:
            inputs[prefix + "slot_mapping"] = (t[seq_ids, positions // BLOCK_SIZE] * BLOCK_SIZE
                                               + positions % BLOCK_SIZE).astype(np.int32)
            inputs[prefix + "block_tables"] = np.stack([t[s] for s, _, _ in step]).astype(np.int32)
    inputs["context_lens"] = np.array([start + len(ids) for _, start, ids in step], np.int32)
    inputs["cu_q_lens"] = np.concatenate([[0], np.cumsum([len(ids) for _, _, ids in step])]).astype(np.int32)
    return inputs


def run_steps(graph, weights, steps, *, num_seqs=2, cache_len=16, num_blocks=16, seed=0, keys=None):
    """Runs the steps; returns each step's logits (rows in token order), or with `keys` each step's
    outputs of those names."""
    params = to_device_params(graph, materialize(graph, weights))
    names = set(state_names(graph))
    env = {"S": num_seqs, "L": cache_len, "B": num_blocks, "BW": num_blocks}
    state = {x.name: np.zeros([env.get(d, d) for d in x.shape], JNP_DTYPES[x.dtype])
             for x in graph.runtime_inputs if x.name in names}
    paged = any("_pool." in n for n in names)
    max_blocks = cache_len // BLOCK_SIZE
    rng = np.random.default_rng(seed)
    tables, window_tables = (rng.permutation(num_blocks)[:num_seqs * max_blocks].reshape(num_seqs, max_blocks)
                             for _ in range(2))
    if "window_block_tables" not in {x.name for x in graph.runtime_inputs}:
        window_tables = None
    fn = jit_step(graph)
    out = []
    for step in steps:
        inputs = _paged_inputs(step, tables, window_tables) if paged else _contiguous_inputs(step, num_seqs)
        outs, state = fn(params, state, inputs)
        out.append(np.asarray(outs["logits"]) if keys is None else {k: np.asarray(outs[k]) for k in keys})
    return out


@pytest.fixture(scope="module", params=["gqa", "tied", "qwen2_bias", "mha"])
def hf_case(request, tmp_path_factory):
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    assert (path / "model.safetensors").is_file()
    config = config_from_hf(path)
    weights = load_safetensors(path, config)
    expected = []
    for prompt, nxt in zip(PROMPTS, NEXT):
        expected.append(_hf_logits(model, prompt + [nxt]))
    return request.param, config, weights, expected


def _check_against_hf(logits, expected):
    prefill, decode = logits
    row = 0
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt)
        np.testing.assert_allclose(prefill[row:row + n], expected[i][:n], **HF_LOGITS,
                                   err_msg=f"prefill of sequence {i}")
        np.testing.assert_allclose(decode[i], expected[i][n], **HF_LOGITS,
                                   err_msg=f"decode of sequence {i}")
        row += n


def test_config_read_from_hf(hf_case):
    kind, config, weights, _ = hf_case
    assert config.num_kv_heads == (4 if kind == "mha" else 2)
    assert config.tie_embeddings == (kind in ("tied", "mha"))
    assert ("lm_head" in weights) == (not config.tie_embeddings)
    assert config.qkv_bias == (kind == "qwen2_bias")
    assert config.rms_eps == 1e-6


def test_textbook_graph_matches_hf(hf_case):
    _, config, weights, expected = hf_case
    _check_against_hf(run_steps(lower(config), weights, _steps()), expected)


def test_served_graph_matches_hf(hf_case):
    _, config, weights, expected = hf_case
    graph = run_pipeline(lower(config), PipelineOptions(block_size=BLOCK_SIZE, max_model_len=16,
                                                        buckets=((16, 2),), num_kv_blocks=16))
    ops = graph.op_counts()
    assert ops["paged_attention"] == config.num_layers and "attention" not in ops
    assert any(p.attr("concat") for p in graph.params)
    _check_against_hf(run_steps(graph, weights, _steps()), expected)


def test_rope_settings_read_from_hf(tmp_path):
    """rope_theta and llama3 rope scaling, as transformers 5 writes them (`rope_parameters`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    hf = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     rope_theta=500.0, rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8})
    model = LlamaForCausalLM(hf).float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = config_from_hf(tmp_path)
    assert config.rope_theta == 500.0 and dict(config.rope_scaling)["rope_type"] == "llama3"
    weights = load_safetensors(tmp_path, config)
    ids = list(range(3, 40))
    got = run_steps(lower(config), weights, [[(0, 0, ids)]], num_seqs=1, cache_len=40)[0]
    np.testing.assert_allclose(got, _hf_logits(model, ids), **HF_LOGITS)


# ------------------------------------------------------------------------------ golden SmolLM2

NUM_GEN = 32


@pytest.fixture(scope="module")
def golden_run(smollm2):
    """Every golden prompt, prefilled together through the textbook graph (all positions'
    logits), then 32 greedy decode steps on the contiguous cache."""
    config, weights, _ = smollm2
    prompts = golden_prompts()
    arrays = [golden_arrays(p["name"]) for p in prompts]
    ids = [a["prompt_ids"].astype(np.int32) for a in arrays]
    num_seqs = len(ids)
    cache_len = -(-(max(len(x) for x in ids) + NUM_GEN) // 16) * 16
    graph = lower(config)
    fn = jit_step(graph)
    params = to_device_params(graph, weights)
    state = {x.name: np.zeros((num_seqs, cache_len) + tuple(x.shape[2:]), np.float32)
             for x in graph.runtime_inputs if x.name in state_names(graph)}
    inputs = _contiguous_inputs([(s, 0, x) for s, x in enumerate(ids)], num_seqs)
    outs, state = fn(params, state, inputs)
    prefill = np.asarray(outs["logits"])
    starts = np.cumsum([0] + [len(x) for x in ids])
    prompt_logits = [prefill[starts[s]:starts[s + 1]] for s in range(num_seqs)]
    last = [p[-1] for p in prompt_logits]
    gen = [[int(np.argmax(v))] for v in last]
    step_logits = [[v] for v in last]
    for _ in range(NUM_GEN - 1):
        step = [(s, len(ids[s]) + len(gen[s]) - 1, [gen[s][-1]]) for s in range(num_seqs)]
        outs, state = fn(params, state, _contiguous_inputs(step, num_seqs))
        logits = np.asarray(outs["logits"])
        for s in range(num_seqs):
            gen[s].append(int(np.argmax(logits[s])))
            step_logits[s].append(logits[s])
    return prompts, arrays, prompt_logits, gen, step_logits


def test_golden_greedy_ids(golden_run):
    prompts, arrays, _, gen, _ = golden_run
    for p, a, g in zip(prompts, arrays, gen):
        assert g == a["gen_ids"].tolist(), p["name"]


def test_golden_last_logits(golden_run):
    prompts, arrays, prompt_logits, _, _ = golden_run
    for p, a, logits in zip(prompts, arrays, prompt_logits):
        diff = np.max(np.abs(logits[-1] - a["last_logits"]))
        assert diff < GOLDEN_LOGITS["atol"], f"{p['name']}: max abs diff {diff}"


GAP = ORDER_GAP


def _check_topk(ours: np.ndarray, ids: np.ndarray, vals: np.ndarray, where: str):
    # Our logits at their top-10 ids are their values.
    np.testing.assert_allclose(ours[ids], vals, **GOLDEN_LOGITS, err_msg=where)
    cand = np.argpartition(-ours, 11)[:11]
    order = cand[np.argsort(-ours[cand], kind="stable")]
    top = ours[order]
    # The same ids at every rank whose value is separated from its neighbours.
    for r in range(10):
        lo = vals[r] - vals[r + 1] if r < 9 else top[9] - top[10]
        hi = vals[r - 1] - vals[r] if r > 0 else np.inf
        if min(lo, hi) > GAP:
            assert order[r] == ids[r], f"{where}: rank {r} is {order[r]}, expected {ids[r]}"
    # The same set of ten wherever the 10th/11th boundary is clear.
    if top[9] - top[10] > GAP:
        assert set(order[:10]) == set(ids.tolist()), where


def test_golden_prompt_topk_at_every_position(golden_run):
    prompts, arrays, prompt_logits, _, _ = golden_run
    for p, a, logits in zip(prompts, arrays, prompt_logits):
        assert logits.shape[0] == len(a["prompt_ids"])
        for pos in range(logits.shape[0]):
            _check_topk(logits[pos], a["prompt_topk_ids"][pos], a["prompt_topk_logits"][pos],
                        f"{p['name']} position {pos}")


def test_golden_decode_topk_with_cache(golden_run):
    prompts, arrays, _, _, step_logits = golden_run
    for p, a, steps in zip(prompts, arrays, step_logits):
        for i, logits in enumerate(steps):
            _check_topk(logits, a["step_topk_ids"][i], a["step_topk_logits"][i], f"{p['name']} step {i}")
