"""Mixture of experts (Mixtral, Qwen3-MoE): the router and expert ops against their one-hot
references, the grouped lowering at ragged per-expert counts, the loaders (per-expert names,
transformers 5's fused layout, GGUF), presets and dry-run memory, int8, tensor parallelism, and
tiny random models against HF transformers.

The HF models are made with `from_config(..., attn_implementation="eager")`, norms re-randomized
and router weights scaled up (top-k then has no near-ties), saved as safetensors. The chosen
experts are compared first (HF's routers seen through forward hooks, ours as extra graph outputs),
then the logits. The tp checks run in a child process (this file as a script) on 4 forced host
devices, as tests/test_shard.py does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # the child: 4 host devices, before anything imports jax
    from host_devices import become_child

    become_child(4)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ir import Graph, IRError, make_node, parse_graph, print_graph, verify  # noqa: E402
from ir.graph import input_node, param_node  # noqa: E402
from models.config import ModelConfig, get_preset  # noqa: E402
from models.llama import lower  # noqa: E402
from models.weights import load_safetensors  # noqa: E402
from passes.pipeline import PipelineOptions, run_pipeline  # noqa: E402
from test_families import NEXT, PROMPTS, WINDOW, _steps, saved_family  # noqa: E402
from test_lowering import BLOCK_SIZE, run_steps  # noqa: E402
from tolerances import HF_LOGITS, SAME_MATH_F32  # noqa: E402

KINDS = ("mixtral", "qwen3moe")


# ------------------------------------------------------------------------------ the ops

def _case(t, e, k, empty=(), h=16, inter=24, seed=0):
    """Random tokens routed to k distinct experts each, never to the experts in `empty`."""
    rng = np.random.default_rng(seed)
    live = [i for i in range(e) if i not in empty]
    ids = np.stack([rng.choice(live, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    x = rng.standard_normal((t, h)).astype(np.float32)
    ws = [(rng.standard_normal(s) * 0.3).astype(np.float32) for s in ((e, h, inter), (e, h, inter), (e, inter, h))]
    return x, ids, weights, ws


@pytest.mark.parametrize("t,e,k,empty", [(1, 4, 2, ()), (5, 8, 2, (0, 3, 7)), (37, 8, 3, (5,)),
                                         (64, 6, 1, (1, 2, 3, 4))])
def test_grouped_lowering_matches_one_hot_reference(t, e, k, empty):
    """Sorted by expert, grouped matmuls (ragged_dot), put back: the dense one-hot reference's
    numbers, with ragged per-expert counts and experts that get no token; f32 and int8 experts."""
    import jax

    from ir.moe_ops import moe_experts_reference
    from runtime.worker.moe import moe_experts_grouped
    from runtime.worker.params import quantize_int8_weight

    x, ids, weights, ws = _case(t, e, k, empty)
    counts = np.bincount(ids.reshape(-1), minlength=e)
    assert all(counts[i] == 0 for i in empty)
    got = jax.jit(moe_experts_grouped)(x, ids, weights, *ws)
    want = moe_experts_reference(x, ids, weights, *ws)
    # Plain numpy: each token's experts one by one.
    silu = lambda v: v / (1 + np.exp(-v))
    plain = np.zeros_like(x)
    for i in range(t):
        for j in range(k):
            g, u, d = (w[ids[i, j]] for w in ws)
            plain[i] += weights[i, j] * ((silu(x[i] @ g) * (x[i] @ u)) @ d)
    np.testing.assert_allclose(np.asarray(want), plain, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **SAME_MATH_F32)
    quantized = [quantize_int8_weight(w) for w in ws]
    q, s = [q for q, _ in quantized], [s for _, s in quantized]
    got8 = jax.jit(moe_experts_grouped)(x, ids, weights, *q, *s)
    deq = [qi.astype(np.float32) * si[:, None, :] for qi, si in zip(q, s)]
    np.testing.assert_allclose(np.asarray(got8), np.asarray(moe_experts_reference(x, ids, weights, *deq)),
                               **SAME_MATH_F32)
    np.testing.assert_allclose(np.asarray(moe_experts_reference(x, ids, weights, *q, *s)),
                               np.asarray(moe_experts_reference(x, ids, weights, *deq)), **SAME_MATH_F32)


def test_one_compile_for_every_routing():
    """Static shapes: the T x k rows are the same whatever the per-expert counts."""
    import jax

    from runtime.worker.moe import moe_experts_grouped

    fn = jax.jit(lambda *a: moe_experts_grouped(*a))  # its own cache
    for empty in ((), (0, 1, 2, 3, 4, 5), (7,)):
        x, ids, weights, ws = _case(16, 8, 2, empty, seed=len(empty))
        fn(x, ids, weights, *ws).block_until_ready()
    assert fn._cache_size() == 1


def test_router_ops():
    """ids: the top-k logits (ties to the lower id); weights: softmax then top-k (renormalized or
    not), or softmax over the top-k (the same numbers as renormalized)."""
    from ir import OPS

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((7, 8)).astype(np.float32)
    logits[0, [2, 5]] = 9.0  # a tie: the lower id first
    ids = np.asarray(OPS["router_topk"].impl(logits, top_k=3))
    assert ids.dtype == np.int32 and ids[0, :2].tolist() == [2, 5]
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(np.argsort(-logits, axis=1)[:, :3], axis=1))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    chosen = np.take_along_axis(probs, ids, 1)
    w = lambda **a: np.asarray(OPS["router_weights"].impl(logits, ids, **a))
    np.testing.assert_allclose(w(scoring="softmax_topk"), chosen, rtol=1e-6)
    np.testing.assert_allclose(w(scoring="softmax_topk", norm_topk_prob=True), chosen / chosen.sum(1, keepdims=True),
                               rtol=1e-6)
    np.testing.assert_allclose(w(scoring="topk_softmax"), chosen / chosen.sum(1, keepdims=True), rtol=1e-6)


def test_verifier_checks_moe_shapes():
    x, logits = input_node("x", ("T", 16), "f32"), input_node("l", ("T", 4), "f32")
    ids = make_node("router_topk", (logits,), {"top_k": 2})
    wts = make_node("router_weights", (logits, ids), {"scoring": "softmax_topk"})
    assert (ids.shape, ids.dtype, wts.dtype) == (("T", 2), "i32", "f32")
    g, u, d = (param_node(n, s, "f32") for n, s in (("g", (4, 16, 8)), ("u", (4, 16, 8)), ("d", (4, 8, 16))))
    assert make_node("moe_experts", (x, ids, wts, g, u, d)).shape == ("T", 16)
    with pytest.raises(IRError, match="top_k 5 exceeds the 4 experts"):
        make_node("router_topk", (logits,), {"top_k": 5})
    with pytest.raises(IRError, match="scoring must be one of"):
        make_node("router_weights", (logits, ids), {"scoring": "sigmoid"})
    with pytest.raises(IRError, match=r"w_down must be \[E, I, H\] = \[4, 8, 16\]"):
        make_node("moe_experts", (x, ids, wts, g, u, param_node("d2", (4, 16, 8), "f32")))
    with pytest.raises(IRError, match="weights must be f32 with the ids' shape"):
        make_node("moe_experts", (x, ids, make_node("scale", (x,), {"value": 1.0}), g, u, d))
    with pytest.raises(IRError, match="takes 6 inputs"):
        make_node("moe_experts", (x, ids, wts, g, u))


def tiny_moe(**kw) -> ModelConfig:
    """A 3-layer Qwen3-MoE-like config whose middle layer stays dense."""
    return get_preset("tiny").replace(**dict(num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, mlp_only_layers=(1,),
                                             architecture="Qwen3MoeForCausalLM") | kw)


def test_lowering_round_trips_and_leaves_dense_layers():
    graph = verify(lower(tiny_moe()))
    text = print_graph(graph)
    assert print_graph(verify(parse_graph(text))) == text
    assert graph.op_counts()["moe_experts"] == 2 and graph.op_counts()["silu"] == 1  # layers 0 and 2 sparse
    assert re.search(r"router_weights\(%\d+, %\d+\) \{norm_topk_prob=true, scoring=\"softmax_topk\"\} : f32\[T, 2\]",
                     text)
    assert "param %layers.0.experts_down : f32[8, 32, 64] role=expert_down" in text
    assert "param %layers.1.w_down : f32[128, 64] role=down" in text


@pytest.mark.parametrize("opts", [dict(quantization="int8"), dict(matmul_precision="bfloat16")])
def test_router_stays_f32(opts):
    """int8 and bf16 products leave the router alone: its logits pick the experts."""
    graph = run_pipeline(lower(tiny_moe()), PipelineOptions(block_size=16, max_model_len=64, buckets=((16, 4),),
                                                            num_kv_blocks=16, **opts))
    readers = [n for n in graph.nodes() if any(i.op == "param" and "router" in i.name for i in n.inputs)]
    assert len(readers) == 2 and all(n.op == "matmul" and n.inputs[1].dtype == "f32" for n in readers)
    assert any(n.op != "matmul" and n.op.startswith("matmul") for n in graph.nodes())  # the others were rewritten


def test_dump_shows_the_moe_ops(capsys):
    from ir import dump

    assert dump.main(["--model", "mixtral-8x7b"]) == 0
    out = capsys.readouterr().out
    assert out.count("= router_topk(") == out.count("= router_weights(") == out.count("= moe_experts(") == 32
    assert 'scoring="topk_softmax"' in out and "top_k=2" in out
    assert "param %layers.31.experts_gate : f32[8, 4096, 14336] role=expert_gate" in out
    assert dump.main(["--model", "mixtral-8x7b", "--after", "shard", "-tp", "2", "--enable-expert-parallel", "true"]) == 0
    out = capsys.readouterr().out
    assert 'param %layers.0.experts_down : f32[8, 14336, 4096] {sharding=["tp", null, null]} role=expert_down' in out


# ------------------------------------------------------------------------------ presets and memory

# The checkpoints' parameter counts, from their config.json (Mixtral-8x7B-v0.1, Qwen3-30B-A3B,
# Qwen3-235B-A22B), summed here term by term: attention, norms, router and experts, embeddings.
def _params(layers, h, heads, kv_heads, head_dim, experts, inter, vocab, qk_norm):
    attn = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h + 2 * head_dim * qk_norm
    moe = experts * 3 * h * inter + h * experts
    return layers * (attn + moe + 2 * h) + 2 * vocab * h + h


PRESET_PARAMS = {"mixtral-8x7b": _params(32, 4096, 32, 8, 128, 8, 14336, 32000, False),
                 "qwen3-30b-a3b": _params(48, 2048, 32, 4, 128, 128, 768, 151936, True),
                 "qwen3-235b-a22b": _params(94, 4096, 64, 4, 128, 128, 1536, 151936, True)}


def test_presets_count_their_experts():
    assert round(PRESET_PARAMS["mixtral-8x7b"] / 1e9, 1) == 46.7
    assert round(PRESET_PARAMS["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert round(PRESET_PARAMS["qwen3-235b-a22b"] / 1e9) == 235
    for name, n in PRESET_PARAMS.items():
        assert get_preset(name).num_params() == n, name


@pytest.mark.parametrize("name,tp,ep", [("qwen3-30b-a3b", 1, False), ("mixtral-8x7b", 2, False),
                                        ("qwen3-235b-a22b", 8, True)])
def test_dry_run_weights_per_device(name, tp, ep):
    """The memory plan counts the experts: bf16 weights per device within 2% of params x 2 / tp."""
    from config.engine_config import EngineConfig
    from runtime.core.buckets import BucketTable
    from runtime.engine.plan import build_graph

    engine = EngineConfig(dtype="bfloat16", tensor_parallel_size=tp, device_memory=141 << 30,
                          enable_expert_parallel=ep)
    buckets = BucketTable.build(engine.max_num_batched_tokens, engine.max_num_seqs)
    _, memory, _ = build_graph(get_preset(name), engine, buckets, keep_pass_texts=False)
    want = PRESET_PARAMS[name] * 2 / tp
    assert abs(memory.weight_bytes - want) < 0.02 * want, (memory.weight_bytes, want)


def test_predicted_moe_scratch_matches_xla():
    """The memory plan's grouped-lowering scratch against XLA's temp_size on XLA:CPU (the grouped
    matmul's tile loop), on a model whose experts dominate."""
    from config.engine_config import EngineConfig
    from runtime.engine.plan import compile_plan
    from runtime.worker.model_runner import ModelRunner
    from models.weights import random_weights

    cfg = get_preset("tiny").replace(hidden_size=128, head_dim=32, num_experts=16, num_experts_per_tok=4,
                                     moe_intermediate_size=256, architecture="Qwen3MoeForCausalLM")
    engine = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, num_kv_blocks=32,
                          kernel_backend="xla")
    plan = compile_plan(None, engine, weights=random_weights(cfg), config=cfg)
    runner = ModelRunner(plan, backend="xla")
    predicted = {(b.num_tokens, b.num_seqs): b.activation_bytes for b in plan.memory.buckets}
    for bucket in ((16, 4), (128, 4)):
        xla = runner.compile_bucket(bucket).memory_analysis().temp_size_in_bytes
        assert abs(predicted[bucket] - xla) <= 0.25 * xla, (bucket, predicted[bucket], xla)


# ------------------------------------------------------------------------------ tiny HF models

def hf_moe(kind: str, seed: int = 0, vocab: int = 96):
    """A tiny random Mixtral (4 experts, top-2, window 6) or Qwen3-MoE (8 experts, top-3,
    renormalized, layer 1 dense), re-randomized as the module docstring says."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "mixtral":
        cfg = MixtralConfig(**common, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=WINDOW,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    else:
        cfg = Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=112, moe_intermediate_size=32,
                             num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + 1.0 if "norm" in name else 0.15 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)  # router logits several units apart: no near-ties in the top-k
        model.lm_head.weight.mul_(8.0)
    return model.float().eval()


def hf_forward(model, ids):
    """HF's logits of `ids` and, per sparse layer, the experts its router chose for each token."""
    import torch

    chosen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(layer.mlp, "experts"):
            hooks.append(gate.register_forward_hook(lambda m, a, out, i=i: chosen.__setitem__(i, out[2].numpy())))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, chosen


def saved_moe(kind: str, tmp_path_factory):
    """(kind, HF model, its safetensors directory, our config, our weights, HF's (logits, experts)
    of each prompt and its next token), built once per session."""
    return saved_family(kind, tmp_path_factory, build=hf_moe, forward=hf_forward)


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory):
    return saved_moe(request.param, tmp_path_factory)


def test_config_read_from_hf(moe):
    kind, model, path, config, _, _ = moe
    saved = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) \
        if (path / "model.safetensors.index.json").is_file() else None
    assert saved is None  # one file
    if kind == "mixtral":
        assert (config.num_experts, config.num_experts_per_tok, config.router_scoring) == (4, 2, "topk_softmax")
        assert config.layer_types == ("sliding", "sliding") and config.sliding_window == WINDOW
        assert config.expert_size == 48 and not config.qk_norm
    else:
        assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (8, 3, True)
        assert config.expert_size == 32 and config.intermediate_size == 112 and config.qk_norm
        assert [config.is_moe(i) for i in range(3)] == [True, False, True]
    n = sum(p.numel() for p in model.parameters())
    assert config.num_params() == n


def test_fused_layout_loads_the_same_weights(moe, tmp_path):
    """transformers 5's own state_dict (gate_up_proj [E, 2I, H], gate half first; down_proj
    [E, H, I]) loads to the same canonical weights as the per-expert names save_pretrained wrote."""
    from safetensors.torch import save_file

    kind, model, path, config, weights, _ = moe
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    fused = load_safetensors(tmp_path, config)
    assert set(fused) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(fused[name], weights[name], err_msg=name)
    del state[next(k for k in state if k.endswith("layers.0.mlp.experts.down_proj"))]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'layers.0.experts_down' .*experts.E.*fused "
                                         r"model.layers.0.mlp.experts.down_proj"):
        load_safetensors(tmp_path, config)


def _served(config, **opts):
    return run_pipeline(lower(config), PipelineOptions(block_size=BLOCK_SIZE, max_model_len=16, buckets=((32, 2),),
                                                       num_kv_blocks=16, **opts))


def test_chosen_experts_then_logits_match_hf(moe):
    """The served graph (every pass: paged KV, fused matmuls; the grouped lowering), with its
    router_topk results as extra outputs: each sparse layer's experts for every token (as sets: the
    order of equal picks is no contract) equal HF's, then the logits. Mixtral's window reaches its
    paged attention."""
    kind, _, _, config, weights, expected = moe
    graph = _served(config)
    windows = [n.attr("window") for n in graph.nodes() if n.op == "paged_attention"]
    assert windows == [WINDOW if kind == "mixtral" else None] * config.num_layers
    routers = [n for n in graph.nodes() if n.op == "router_topk"]
    extra = tuple((f"ids.{i}", n) for i, n in enumerate(routers))
    graph = Graph(graph.inputs, graph.outputs + extra, graph.meta)
    prefill, decode = run_steps(graph, weights, _steps(), cache_len=16, keys=("logits",) + tuple(k for k, _ in extra))
    sparse = [i for i in range(config.num_layers) if config.is_moe(i)]
    row = 0
    for s, prompt in enumerate(PROMPTS):
        n = len(prompt)
        logits, chosen = expected[s]
        assert sorted(chosen) == sparse and len(routers) == len(sparse)
        for j, layer in enumerate(sparse):
            ours = np.concatenate([prefill[f"ids.{j}"][row:row + n], decode[f"ids.{j}"][s:s + 1]])
            np.testing.assert_array_equal(np.sort(ours, 1), np.sort(chosen[layer], 1), err_msg=f"{kind} layer {layer}")
        np.testing.assert_allclose(prefill["logits"][row:row + n], logits[:n], **HF_LOGITS)
        np.testing.assert_allclose(decode["logits"][s], logits[n], **HF_LOGITS)
        row += n


def test_int8_experts(tmp_path_factory):
    """quantize_int8 covers the experts (per expert, per output column) and leaves the router in
    f32; the logits stay near f32's and the greedy picks agree (Qwen3-MoE: a dense layer among them)."""
    _, _, _, config, weights, expected = saved_moe("qwen3moe", tmp_path_factory)
    graph = _served(config, quantization="int8")
    text = print_graph(graph)
    assert re.search(r"param %layers.0.experts_gate.scale : f32\[\d+, \d+\] \{int8_scale=", text)
    assert graph.op_counts()["moe_experts"] == sum(config.is_moe(i) for i in range(config.num_layers))
    assert all(len(n.inputs) == 9 for n in graph.nodes() if n.op == "moe_experts")
    (prefill,) = run_steps(graph, weights, _steps()[:1], cache_len=16)
    ref = np.concatenate([expected[s][0][:len(p)] for s, p in enumerate(PROMPTS)])
    assert np.abs(prefill - ref).max() < 0.05 * np.abs(ref).max()
    assert (prefill.argmax(1) == ref.argmax(1)).mean() >= 0.9


@pytest.mark.parametrize("kind", KINDS)
def test_engine_teacher_forced_and_greedy_match_hf(kind, tmp_path_factory):
    """The whole engine (chunked prefill of 8 tokens, paged KV, decode buckets, scanned layers where
    they repeat): teacher-forced top-1
    over a 60-token sequence >= 99% of HF's (prompt logprobs), greedy continuations equal HF's
    batched, alone and (Mixtral) through the server, and no recompile while the routings change
    every step."""
    import torch

    from runtime import LLM, SamplingParams

    _, model, path, _, _, _ = saved_moe(kind, tmp_path_factory)
    # Mixtral's layers are all sparse: scanned over layers, its stacks [L, E, ...] (Qwen3-MoE's dense
    # layer keeps it unrolled).
    llm = LLM(str(path), max_model_len=80, max_num_seqs=2, max_num_batched_tokens=8, block_size=BLOCK_SIZE,
              num_kv_blocks=48, scan_layers=True)
    assert (llm.engine.runner.layout.layers is not None) == (kind == "mixtral")
    seq = np.random.default_rng(1).integers(3, 96, 60).tolist()
    (out,) = llm.generate([seq], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    ours = [max(lp, key=lambda t: lp[t]) for lp in out.prompt_logprobs[1:]]
    hf = hf_forward(model, seq)[0][:-1].argmax(1).tolist()
    assert np.mean(np.array(ours) == np.array(hf)) >= 0.99
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batched = llm.generate(PROMPTS, greedy)
    alone = [llm.generate([p], greedy)[0] for p in PROMPTS]
    for prompt, b, a in zip(PROMPTS, batched, alone):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == ref
    if kind == "mixtral":  # one request through the HTTP server: the same tokens
        import httpx

        from runtime.serve import ServerThread, build_app

        app = build_app(llm.engine, served_model_names=["moe"], log_stats_interval=0)
        with ServerThread(app) as st, httpx.Client(base_url=st.url, timeout=120) as http:
            r = http.post("/v1/completions", json={"model": "moe", "prompt": PROMPTS[0], "max_tokens": 10,
                                                   "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == batched[0].outputs[0].token_ids
    assert llm.engine.stats().num_recompiles == 0


# ------------------------------------------------------------------------------ GGUF

def _write_moe_gguf(model, kind: str, path) -> None:
    """The tiny HF model in llama.cpp's names: Mixtral as architecture llama with expert_count (q/k
    rows permuted for its interleaved RoPE), Qwen3-MoE as qwen3moe; each layer's experts stacked
    ffn_{gate,up,down}_exps, the router ffn_gate_inp; f32."""
    import gguf

    from models.weight_names import WEIGHT_MAP, MIXTRAL_HF_NAMES, FUSED_EXPERT_HF_NAMES
    from models.weights import permute_qk_rows

    cfg = model.config
    arch = "llama" if kind == "mixtral" else "qwen3moe"
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "expert_count": cfg.num_local_experts,
            "expert_used_count": cfg.num_experts_per_tok}
    if kind != "mixtral":
        meta["expert_feed_forward_length"] = cfg.moe_intermediate_size
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    hf_to_gguf = {hf: gg for hf, gg, _ in WEIGHT_MAP.values()}
    hf_to_gguf["model.layers.{}.mlp.gate.weight"] = "blk.{}.ffn_gate_inp.weight"
    for canon, (fused, half) in FUSED_EXPERT_HF_NAMES.items():
        hf_to_gguf[fused] = WEIGHT_MAP[canon][1]
    hf_to_gguf["model.layers.{}.mlp.experts.gate_up_proj"] = None  # split below
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        pattern = ".".join(parts[:2] + ["{}"] + parts[3:]) if layer is not None else name
        arr = tensor.float().numpy()
        if pattern.endswith("gate_up_proj"):
            inter = arr.shape[1] // 2
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(arr[:, :inter]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(arr[:, inter:]))
            continue
        if kind == "mixtral" and pattern.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in pattern else cfg.num_key_value_heads
            arr = permute_qk_rows(arr, heads)
        dst = hf_to_gguf[pattern]
        w.add_tensor(dst if layer is None else dst.format(layer), np.ascontiguousarray(arr))
    assert MIXTRAL_HF_NAMES  # Mixtral's own HF names are the per-expert files' (save_pretrained)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_moe_loads_like_the_safetensors(kind, tmp_path_factory):
    from models.weights import load_gguf

    _, model, _, config, weights, expected = saved_moe(kind, tmp_path_factory)
    path = tmp_path_factory.mktemp(f"{kind}-gguf") / f"{kind}.gguf"
    _write_moe_gguf(model, kind, path)
    gconfig, gweights, _ = load_gguf(path)
    for field in ("num_layers", "num_experts", "num_experts_per_tok", "expert_size", "router_scoring", "qk_norm",
                  "architecture", "mlp_only_layers"):
        assert getattr(gconfig, field) == getattr(config, field), field
    assert gconfig.norm_topk_prob == config.norm_topk_prob
    assert set(gweights) == set(weights)
    for name in weights:
        np.testing.assert_array_equal(gweights[name], weights[name], err_msg=name)


# ------------------------------------------------------------------------------ tensor parallelism

def test_shard_splits_each_expert():
    """gate/up split by column, down by row inside each expert, or (expert_parallel) the experts
    among the devices; one all-reduce per MoE layer; the router replicated; sizes that do not
    divide are refused."""
    from passes.shard import shard

    o = PipelineOptions(block_size=16, max_model_len=64, buckets=((16, 4),), num_kv_blocks=16, tensor_parallel_size=2)
    text = print_graph(run_pipeline(lower(tiny_moe()), o))
    assert re.search(r'param %layers.0.experts_gate : f32\[8, 64, 32\] \{sharding=\[null, null, "tp"\]\}', text)
    assert re.search(r'param %layers.0.experts_down : f32\[8, 32, 64\] \{sharding=\[null, "tp", null\]\}', text)
    assert re.search(r'param %layers.0.router : f32\[64, 8\] \{sharding=\[null, null\]\}', text)
    assert len(re.findall(r'= moe_experts\(.*all_reduce="tp", sharding=\[null, null\]', text)) == 2
    # Int8 experts: their scales split with their columns (gate/up) or replicated (down); the
    # sharded graph computes on one device what the unsharded one does.
    from conftest import one_step_logits
    from models.weights import random_weights

    one_layer = tiny_moe(num_layers=1, mlp_only_layers=())

    def int8_graph(tp):
        return run_pipeline(lower(one_layer), PipelineOptions(block_size=16, max_model_len=128, buckets=((16, 4),),
                                                               num_kv_blocks=32, tensor_parallel_size=tp,
                                                               quantization="int8"))
    g2 = int8_graph(2)
    text8 = print_graph(g2)
    assert re.search(r'param %layers.0.experts_up.scale : f32\[8, 32\] \{.*sharding=\[null, "tp"\]', text8)
    assert re.search(r'param %layers.0.experts_down.scale : f32\[8, 64\] \{.*sharding=\[null, null\]', text8)
    weights = random_weights(one_layer, seed=2)
    np.testing.assert_allclose(one_step_logits(g2, weights), one_step_logits(int8_graph(1), weights), **SAME_MATH_F32)
    ep = run_pipeline(lower(tiny_moe()), PipelineOptions(block_size=16, max_model_len=64, buckets=((16, 4),),
                                                         num_kv_blocks=16, tensor_parallel_size=4,
                                                         quantization="int8", expert_parallel=True))
    text = print_graph(ep)
    assert ep.meta_value("tp_experts") == "expert_parallel"
    assert re.search(r'param %layers.0.experts_down.int8 : i8\[8, 32, 64\] \{.*sharding=\["tp", null, null\]', text)
    assert re.search(r'param %layers.0.experts_down.scale : f32\[8, 64\] \{.*sharding=\["tp", null\]', text)
    assert len(re.findall(r'= moe_experts\(.*all_reduce="tp", sharding=\[null, null\]', text)) == 2
    with pytest.raises(ValueError, match="the 8 experts must divide by tp"):
        run_pipeline(lower(tiny_moe()), PipelineOptions(block_size=16, max_model_len=64, buckets=((16, 4),),
                                                        num_kv_blocks=16, tensor_parallel_size=16, expert_parallel=True))
    with pytest.raises(ValueError, match="experts' intermediate size 32 must divide by tp"):
        shard(run_pipeline(lower(tiny_moe()), PipelineOptions(block_size=16, max_model_len=64, buckets=((16, 4),),
                                                             num_kv_blocks=16), stop_after="bf16_matmuls"), tp=64)


@pytest.mark.slow
def test_tp_engines_match_tp1():
    """tp=2 and 4 (4 forced host devices) with each expert split, and tp=4 with the experts split
    among the devices (enable_expert_parallel): tp=1's greedy tokens, no recompile, and the HLO moves only what the rule
    implies: per layer an all-reduce after o_proj and one after the MLP, the embedding's, and the
    logits' gather; no weight is gathered."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, __file__, "tp"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"child failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = res["moe"]["1"]["tokens"]
    for name, cases in res.items():
        for tp, out in cases.items():
            assert out["tokens"] == reference, (name, tp)
            assert out["recompiles"] == 0
            if tp == "1":
                continue
            coll = out["collectives"]
            # [T, hidden] partial sums: after o_proj and after each MLP (the experts' on each device
            # in shard_map, summed per token first), and the embedding's.
            assert [s for s, kind in coll if kind == "all-reduce"] == ["f32[8,64]"] * (1 + 2 * out["num_layers"]), coll
            assert [c for c in coll if c[1] != "all-reduce"] == [["f32[2,256]", "all-gather"]], coll
            want = [8 // int(tp), 32, 64] if name == "moe_ep" else [8, 32 // int(tp), 64]
            assert out["local_shapes"]["layers.0.experts_down"] == want


def _child_tp() -> dict:
    from conftest import CACHE_DIR
    from models.weights import random_weights
    from runtime import SamplingParams
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM
    from runtime.worker.model_runner import enable_compilation_cache
    from test_shard import COLLECTIVE

    enable_compilation_cache(CACHE_DIR)
    prompts = [[5, 9, 33, 100, 7], [3] * 20 + [17, 18], [200, 11, 12, 13, 99, 1, 4]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg = tiny_moe(num_experts_per_tok=3)
    weights = random_weights(cfg, seed=0)
    for k in weights:
        if k.endswith("router"):
            weights[k] = weights[k] * 100  # routing margins far above the all-reduce's rounding
    res = {}
    # Expert parallel at tp=4 only (2 of the 8 experts per device): an engine costs ~15 s cold here.
    for name, tps, ep in (("moe", (1, 2, 4), False), ("moe_ep", (4,), True)):
        cases = {}
        for tp in tps:
            engine = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=32,
                                  tensor_parallel_size=tp, enable_expert_parallel=ep)
            plan = compile_plan(None, engine, weights=weights, config=cfg)
            llm = LLM.from_plan(plan)
            outs = llm.generate(prompts, greedy)
            out = {"tokens": [o.outputs[0].token_ids for o in outs], "recompiles": llm.engine.stats().num_recompiles}
            if tp > 1:
                runner = llm.engine.runner
                hlo = runner.compile_bucket((8, 2)).as_text()  # a bucket the engine compiled
                out["collectives"] = [(m.group(1).split("{")[0], m.group(2)) for m in COLLECTIVE.finditer(hlo)]
                out["num_layers"] = cfg.num_layers
                out["local_shapes"] = {k: list(v.addressable_shards[0].data.shape) for k, v in runner.params.items()}
            cases[str(tp)] = out
        res[name] = cases
    return res


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps({"tp": _child_tp}[sys.argv[1]]()))
