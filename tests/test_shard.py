"""Tensor parallelism: the shard pass (specs, layouts, divisibility), per-device memory, and
tp=2/4 engines on 4 forced CPU devices giving tp=1's greedy tokens with the expected collectives.

The multi-device checks run in a subprocess: `--xla_force_host_platform_device_count` must be
set before JAX initializes, and in a full test run JAX is already up (one CPU device). The
child is this file run as a script: `python tests/test_shard.py <case>` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # the child: 4 host devices, before anything imports jax
    from host_devices import become_child

    become_child(4)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from ir import parse_graph, print_graph, verify  # noqa: E402
from models.config import get_preset  # noqa: E402
from models.llama import lower  # noqa: E402
from passes.pipeline import PipelineOptions, run_pipeline  # noqa: E402
from conftest import one_step_logits  # noqa: E402
from tolerances import PROMPT_LOGPROBS_TP, SAME_MATH_F32  # noqa: E402

SMALL_ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=48)
HLO_BUCKET = (16, 4)
COLLECTIVE = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                        r"(?:-start)?\(")


def tiny(**kw):
    return get_preset("tiny").replace(**kw)


def tiny_8q4kv():
    """Heads that divide 4: 8 q / 4 kv heads of dim 8."""
    return tiny(num_q_heads=8, num_kv_heads=4, head_dim=8)


def compiled_graph(cfg, tp: int, quantization=None, **opts):
    o = PipelineOptions(block_size=16, max_model_len=128, buckets=((16, 4),), num_kv_blocks=32,
                        tensor_parallel_size=tp, quantization=quantization, **opts)
    return run_pipeline(lower(cfg), o)


# ----------------------------------------------------------------------------- the pass

def test_tp1_is_identity():
    g = compiled_graph(tiny(), 1)
    assert "sharding" not in print_graph(g)


def test_shard_ir_tiny_tp2():
    """Megatron specs on every weight and activation; reduction points marked on the matmuls."""
    g = compiled_graph(tiny(), 2)
    text = print_graph(g)
    lines = text.splitlines()
    find = lambda pat: [l for l in lines if re.search(pat, l)]
    assert find(r'^meta .*tp=2, tp_attention="split"')
    assert find(r'^param %embed : f32\[256, 64\] \{sharding=\["tp", null\]\}')
    assert find(r'^param %lm_head : f32\[64, 256\] \{sharding=\[null, "tp"\]\}')
    assert find(r'^param %layers.0.wqkv : f32\[64, 128\] \{concat=.*sharding=\[null, "tp"\], '
                r'tp_layout=\{"head_dim": 16, "parts": \[64, 32, 32\], "repeat": \[1, 1, 1\], "shards": 2\}')
    assert find(r'^param %layers.0.w_gate_up : .*sharding=\[null, "tp"\], tp_layout=')
    assert find(r'^param %layers.0.wo : f32\[64, 64\] \{sharding=\["tp", null\]\}')
    assert find(r'^param %layers.0.w_down : f32\[128, 64\] \{sharding=\["tp", null\]\}')
    assert find(r'^param %layers.0.attn_norm : f32\[64\] \{sharding=\[null\]\}')
    assert find(r'^input %k_pool.0 : f32\[B, 16, 2, 16\] \{sharding=\[null, null, "tp", null\]\}')
    # Every computed value carries a spec.
    assert all("sharding=" in l for l in lines if l.startswith("%"))
    # Row-split matmuls (o_proj, down) and the vocab-split lookup reduce; the LM head gathers.
    assert len(find(r'= matmul\(.*all_reduce="tp", sharding=\[null, null\]')) == 2 * 2
    assert len(find(r'= embedding\(.*all_reduce="tp"')) == 1
    assert len(find(r'= matmul\(.*all_gather="tp", sharding=\[null, "tp"\]')) == 1
    # Fused results are split per shard: reshape [T, tp, per_shard] -> slice -> reshape.
    assert find(r'= reshape\(%\d+\) \{shape=\["T", 2, 64\], sharding=\[null, "tp", null\]\} : f32\[T, 2, 64\]')
    assert find(r'= paged_attention\(.*num_kv_heads=2, .*sharding=\[null, "tp", null\]')
    # The text parses back to the same graph (the plan directory stores it).
    assert print_graph(verify(parse_graph(text))) == text


def test_shard_kv_heads_replicated_tp4():
    """tiny has 2 kv heads: at tp=4 each is stored twice, the pools hold 4 heads (one per device)."""
    g = compiled_graph(tiny(), 4)
    text = print_graph(g)
    assert g.meta_value("tp_kv_repeat") == 2
    assert "kv heads replicated: 2 kv heads < tp=4" in g.meta_value("tp_notes")[0]
    assert re.search(r'input %k_pool.0 : f32\[B, 16, 4, 16\] \{sharding=\[null, null, "tp", null\]\}', text)
    assert re.search(r'param %layers.0.wqkv : f32\[64, 192\] .*"repeat": \[1, 2, 2\], "shards": 4', text)
    assert re.search(r'paged_attention\(.*num_kv_heads=4, ', text)


def test_smollm2_divisibility_rules():
    """SmolLM2: 9 q / 3 kv heads. tp=3 splits attention; tp=2 and tp=4 replicate it, saying why."""
    cfg = get_preset("smollm2-135m").replace(num_layers=2)
    g3 = compiled_graph(cfg, 3)
    assert g3.meta_value("tp_attention") == "split" and not g3.meta_value("tp_notes")
    for tp in (2, 4):
        g = compiled_graph(cfg, tp)
        assert g.meta_value("tp_attention") == "replicated"
        (note,) = g.meta_value("tp_notes")
        assert f"attention replicated: 9 q heads do not divide by tp={tp}" in note
        text = print_graph(g)
        assert re.search(r'param %layers.0.wqkv : f32\[576, 960\] \{concat=.*sharding=\[null, null\]\}', text)
        assert re.search(r'param %layers.0.wo : .*sharding=\[null, null\]', text)
        assert re.search(r'param %layers.0.w_down : .*sharding=\["tp", null\]', text)
        assert re.search(r'input %k_pool.0 : f32\[B, 16, 3, 64\] \{sharding=\[null, null, null, null\]\}', text)
        # Only the MLP reduces inside a layer (plus the vocab-split embedding lookup).
        assert len(re.findall(r'= matmul\(.*all_reduce="tp"', text)) == 2


def test_intermediate_must_divide():
    with pytest.raises(ValueError, match=r"intermediate_size 100 must divide by tp to split the MLP"):
        compiled_graph(tiny(intermediate_size=100), 8)


def test_sharded_graph_same_logits_on_one_device():
    """The sharded graph means the same thing unsharded: column layouts and slices agree."""
    from models.weights import random_weights

    for cfg, tps in ((tiny(), (2, 4)), (tiny_8q4kv(), (4,)), (tiny(qkv_bias=True), (4,))):
        weights = random_weights(cfg, seed=1)
        results = {tp: one_step_logits(compiled_graph(cfg, tp), weights) for tp in (1,) + tps}
        for tp in tps:
            np.testing.assert_allclose(results[tp], results[1], **SAME_MATH_F32)


def test_memory_plan_per_device_bytes():
    """Weights / tp for split tensors, replicated ones counted fully; KV per device."""
    from passes.plan_memory import kv_bytes_per_block, weight_bytes

    cfg = tiny()
    g1, g2, g4 = (compiled_graph(cfg, tp) for tp in (1, 2, 4))
    norms = sum(4 * p.shape[0] for p in g1.params if p.name.endswith("norm"))
    total = weight_bytes(g1)
    assert weight_bytes(g2) == (total - norms) // 2 + norms
    # tp=4: q/k/v columns grow by the repeated kv heads (2 -> 4 per layer), then split 4 ways.
    extra = cfg.num_layers * 2 * 64 * 32 * 4
    assert weight_bytes(g4) == (total - norms + extra) // 4 + norms
    kv1 = kv_bytes_per_block(g1)
    assert kv_bytes_per_block(g2) == kv1 // 2
    assert kv_bytes_per_block(g4) == kv1 // 2  # one of 4 (replicated) heads per device = half of 2 heads

    smol = get_preset("smollm2-135m").replace(num_layers=2)
    s1, s2 = compiled_graph(smol, 1), compiled_graph(smol, 2)
    assert kv_bytes_per_block(s2) == kv_bytes_per_block(s1)  # attention replicated: the whole KV


def test_llama_70b_tp8_dry_run_plan():
    """The predicted per-device memory for llama-2-70b at tp=8, bf16 (no weights loaded)."""
    from runtime.core.buckets import BucketTable
    from runtime.engine.plan import Plan, build_graph
    from config.engine_config import EngineConfig

    cfg = get_preset("llama-2-70b")
    engine = EngineConfig(dtype="bfloat16", tensor_parallel_size=8, device_memory=141 << 30)
    buckets = BucketTable.build(engine.max_num_batched_tokens, engine.max_num_seqs)
    graph, memory, _ = build_graph(cfg, engine, buckets, keep_pass_texts=False)
    text = Plan(cfg, engine, graph, buckets, memory).describe()
    print(text)
    assert "per device (tensor_parallel_size=8)" in text
    # 69.0B params x 2 bytes / 8 = 17.2 GB per device, norms replicated.
    assert abs(memory.weight_bytes - cfg.num_params() * 2 / 8) < 0.01 * memory.weight_bytes
    # 8 kv heads split 8 ways: one head, 80 layers, K and V, block_size tokens, bf16.
    assert memory.kv_bytes_per_block == 80 * 2 * engine.block_size * 128 * 2
    assert memory.num_kv_blocks > 0


# ----------------------------------------------------------------------------- on 4 CPU devices

def run_child(case: str, timeout: int = 1500) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, case], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"child {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{case}: {time.perf_counter() - t0:.1f}s", result.get("log", ""))
    return result


def check_collectives(res: dict, attention_split: bool, layers_in_hlo: int) -> None:
    """All-reduces after o_proj (if attention is split), after down, and for the embedding
    lookup; one all-gather, of the logits; nothing else moves, and no weight is gathered."""
    coll = res["collectives"]
    reduces = [s for s, kind in coll if kind == "all-reduce"]
    gathers = [s for s, kind in coll if kind == "all-gather"]
    others = [c for c in coll if c[1] not in ("all-reduce", "all-gather")]
    t, s = HLO_BUCKET
    # Unrolled, each layer's collectives appear in the HLO; scanned (StepLayout), the layer body's
    # appear once.
    assert len(reduces) == 1 + layers_in_hlo * (2 if attention_split else 1), coll
    assert all(r.startswith(f"f32[{t},") for r in reduces), reduces  # [T, hidden] partial sums
    assert gathers == [f"f32[{s},{res['vocab']}]"], gathers  # the logits rows only
    assert not others, others
    weight_shapes = {f"f32[{','.join(map(str, shape))}]" for shape in res["weight_shapes"]}
    assert not weight_shapes & set(gathers)


@pytest.mark.slow
def test_tiny_tp_engines_match_tp1():
    res = run_child("tiny")
    first, second = res["restart"]["runs"]
    assert first["tokens"] == second["tokens"] == [t[0] for t in res["models"]["tiny_4q2kv"]["1"]["tokens"]]
    for name, cases in res["models"].items():
        ref = cases["1"]
        for tp, out in cases.items():
            assert out["tokens"] == ref["tokens"], (name, tp)
            np.testing.assert_allclose(out["prompt_lp"], ref["prompt_lp"], **PROMPT_LOGPROBS_TP)
            assert out["recompiles"] == 0
            if tp != "1":
                if name.endswith("w8a8"):
                    # Each row-split matmul (o, down) all-reduces its input's per-token max (the
                    # scale spans the whole row) and its int32 partial products; then the
                    # embedding's sum and the logits' gather, as in f32.
                    t, s = HLO_BUCKET
                    assert sorted(map(tuple, out["collectives"])) == sorted(
                        [(f"f32[{t}]", "all-reduce"), (f"s32[{t},64]", "all-reduce")] * 2
                        + [(f"f32[{t},64]", "all-reduce"), (f"f32[{s},256]", "all-gather")]), out["collectives"]
                else:
                    check_collectives(out, attention_split=True, layers_in_hlo=1)  # scanned
                # Each device holds only its shard of a split weight.
                sfx = ".int8" if name.endswith(("int8", "w8a8")) else ""
                # Per-layer weights are stacked [num_layers, ...] for the scan over layers.
                assert out["local_shapes"]["layers.*.w_down" + sfx] == [2, 128 // int(tp), 64]
                assert out["local_shapes"]["lm_head" + sfx] == [64, 256 // int(tp)]
                if sfx:
                    assert out["local_shapes"]["lm_head.scale"] == [256 // int(tp)]
                    assert out["local_shapes"]["layers.*.w_down.scale"] == [2, 64]


def test_smollm2_tp_engines_match_tp1(smollm2):
    """tp=2 and tp=4 (attention replicated: 9 heads) and tp=3 (everything split) reproduce
    the tp=1 greedy tokens, which are HF's golden tokens (test_engine checks tp=1 on them)."""
    from conftest import golden_arrays, golden_prompts

    res = run_child("smollm2")
    names = [p["name"] for p in golden_prompts() if p["name"] != "p2_long_para"]
    for tp, out in res["tp"].items():
        for name, (toks,) in zip(names, out["tokens"]):
            assert toks == golden_arrays(name)["gen_ids"][:len(toks)].tolist(), (tp, name)
        assert out["recompiles"] == 0
        # Scanned: the CPU default under tensor parallelism (EngineConfig.scans_layers).
        check_collectives(out, attention_split=tp == "3", layers_in_hlo=1)


# ----------------------------------------------------------------------------- child side

def _collectives(hlo: str) -> list[tuple[str, str]]:
    return [(m.group(1).split("{")[0], m.group(2)) for m in COLLECTIVE.finditer(hlo)]


def _engine_case(cfg, weights, tp: int, prompts, params, tokenizer=None, quantization=None,
                 scan_layers=None) -> dict:
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    engine = EngineConfig(**SMALL_ENGINE, tensor_parallel_size=tp, quantization=quantization,
                          scan_layers=scan_layers)
    plan = compile_plan(None, engine, weights=weights, config=cfg, tokenizer=tokenizer)
    llm = LLM.from_plan(plan, check_invariants=True)
    outs = llm.generate(prompts, params)
    runner = llm.engine.runner
    out = {"tokens": [[c.token_ids for c in o.outputs] for o in outs],
           "recompiles": llm.engine.stats().num_recompiles}
    if tp > 1:
        out["collectives"] = _collectives(runner.compile_bucket(HLO_BUCKET).as_text())
        out["vocab"] = cfg.vocab_size
        out["weight_shapes"] = [list(p.shape) for p in plan.graph.params]
        out["local_shapes"] = {k: list(v.addressable_shards[0].data.shape) for k, v in runner.params.items()}
    return out, outs


def child_tiny() -> dict:
    from conftest import CACHE_DIR
    from models.weights import random_weights
    from runtime import SamplingParams
    from runtime.worker.model_runner import enable_compilation_cache

    enable_compilation_cache(CACHE_DIR)  # the session's cache, never the user's (and so no executable store)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
    prompts = [[5, 9, 33, 100, 7], [3] * 20 + [17, 18], [200, 11, 12, 13, 99, 1, 4]]
    # n=2 shares the prompt's blocks and copies the partial one on write (copy_blocks on the mesh).
    params = [greedy, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2, n=2),
              greedy]
    models = {}
    for name, cfg, tps, quant in (("tiny_4q2kv", tiny(), (1, 2, 4), None),
                                  ("tiny_8q4kv", tiny_8q4kv(), (1, 4), None),
                                  ("tiny_4q2kv_int8", tiny(), (1, 2), "int8"),
                                  # W8A8: a row-split matmul's per-token scale spans the whole row.
                                  ("tiny_4q2kv_w8a8", tiny(), (1, 2), "w8a8")):
        w = random_weights(cfg, seed=0)
        cases = {}
        for tp in tps:
            # The tiny models run scanned over layers (the accelerator default) to cover the
            # stacked weights and the flat multi-layer pools on the mesh, n=2 copies included.
            out, outs = _engine_case(cfg, w, tp, prompts, params, quantization=quant, scan_layers=True)
            out["prompt_lp"] = [lp[t] for o in outs for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
            cases[str(tp)] = out
        models[name] = cases
    return {"models": models, "restart": _plan_restart(prompts, greedy)}


def _plan_restart(prompts, params) -> dict:
    """A saved tp=2 plan started twice: the second start loads its executables from the plan."""
    import tempfile

    from models.weights import random_weights
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    cfg = tiny()
    plan = compile_plan(None, EngineConfig(**SMALL_ENGINE, tensor_parallel_size=2),
                        weights=random_weights(cfg, seed=0), config=cfg)
    with tempfile.TemporaryDirectory() as d:
        plan.save(d)
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            llm = LLM(d, tensor_parallel_size=2)
            runs.append({"start_s": time.perf_counter() - t0,
                         "tokens": [o.outputs[0].token_ids for o in llm.generate(prompts, params)]})
    return {"runs": runs}


def child_smollm2() -> dict:
    from conftest import golden_arrays, golden_prompts
    from models.weights import load_model
    from runtime import SamplingParams
    from runtime.worker.model_runner import enable_compilation_cache
    from conftest import CACHE_DIR

    enable_compilation_cache(CACHE_DIR)
    cfg, weights, tok = load_model("smollm2-135m")
    prompts = [golden_arrays(p["name"])["prompt_ids"].tolist() for p in golden_prompts()
               if p["name"] != "p2_long_para"]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    res = {}
    for tp in (2, 4, 3):
        t0 = time.perf_counter()
        out, _ = _engine_case(cfg, weights, tp, prompts, greedy, tok)
        out["seconds"] = round(time.perf_counter() - t0, 1)
        res[str(tp)] = out
    return {"tp": res, "log": {tp: r["seconds"] for tp, r in res.items()}}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = {"tiny": child_tiny, "smollm2": child_smollm2}[sys.argv[1]]()
    print(json.dumps(result))
