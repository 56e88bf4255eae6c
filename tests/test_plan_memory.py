"""The memory plan: KV block budget math, weight bytes by dtype, the activation liveness model,
and its check against XLA's own `memory_analysis()` on SmolLM2."""

from __future__ import annotations

import math

import pytest

from conftest import SMOL_ARGS
from ir import parse_graph, verify
from models.config import get_preset
from models.llama import lower
from passes.pipeline import PipelineOptions, run_pipeline
from passes.plan_memory import (MemoryPlan, activation_peak_bytes,
                                kv_bytes_per_block, plan_memory_report, step_io_bytes, weight_bytes)

MiB = 1 << 20


def final_graph(name="tiny", dtype="f32", **opts):
    opts.setdefault("max_model_len", 64)
    opts.setdefault("buckets", ((8, 4),))
    return run_pipeline(lower(get_preset(name), dtype), PipelineOptions(**opts))


def report(graph, **kw):
    args = dict(buckets=[(8, 4), (32, 4)], device_memory_bytes=64 * MiB, memory_utilization=0.9,
                block_size=16, max_model_len=64, reserve_bytes=1 * MiB)
    args.update(kw)
    return plan_memory_report(graph, **args)


# ------------------------------------------------------------------------------ budget math

def test_kv_block_count_formula():
    g = final_graph()
    plan = report(g)
    c = get_preset("tiny")
    # GQA-exact KV bytes: k and v, every layer, only the kv heads.
    assert plan.kv_bytes_per_block == kv_bytes_per_block(g) == 16 * c.kv_bytes_per_token(4) == 16 * 2 * 2 * 2 * 16 * 4
    assert plan.weight_bytes == weight_bytes(g) == c.num_params() * 4
    peak = max(b.activation_bytes + b.io_bytes for b in plan.buckets)
    assert plan.peak_activation_bytes == peak
    assert [(b.num_tokens, b.num_seqs) for b in plan.buckets] == [(8, 4), (32, 4)]
    assert plan.buckets[1].activation_bytes > plan.buckets[0].activation_bytes
    expected = math.floor((0.9 * 64 * MiB - plan.weight_bytes - peak - 1 * MiB) / plan.kv_bytes_per_block)
    assert plan.num_kv_blocks == expected > 0
    # Concurrent sequences at max_model_len: each needs ceil(64 / 16) = 4 blocks.
    assert plan.max_concurrent_seqs == expected // 4
    # The pass records the same count in the graph (binding the B dim at runtime).
    g2 = run_pipeline(lower(get_preset("tiny")), PipelineOptions(
        buckets=((8, 4), (32, 4)), device_memory_bytes=64 * MiB, memory_utilization=0.9, block_size=16,
        max_model_len=64, reserve_bytes=1 * MiB))
    assert g2.meta_value("num_kv_blocks") == expected


def test_kv_block_count_by_hand():
    # Two layers of [B, 4, 2, 8] f32 pools: 4 tokens x 2 heads x 8 x 4 B x (k, v) x 2 = 1024 B/block.
    # One weight f32[8, 8] = 256 B. Bucket T=4: k and v [T, 2, 8] and slots [T] in, nothing out
    # but the pools (in place): 4*64 + 4*64 + 4*4 = 528 B of step I/O, no temporaries.
    g = verify(parse_graph("""\
input %k : f32[T, 2, 8]
input %v : f32[T, 2, 8]
input %slot_mapping : i32[T]
input %k_pool.0 : f32[B, 4, 2, 8]
input %v_pool.0 : f32[B, 4, 2, 8]
input %k_pool.1 : f32[B, 4, 2, 8]
input %v_pool.1 : f32[B, 4, 2, 8]
param %w : f32[8, 8]
%0 = kv_write(%k_pool.0, %k, %slot_mapping) : f32[B, 4, 2, 8]
%1 = kv_write(%v_pool.0, %v, %slot_mapping) : f32[B, 4, 2, 8]
%2 = matmul(%k, %w) : f32[T, 2, 8]
%3 = kv_write(%k_pool.1, %2, %slot_mapping) : f32[B, 4, 2, 8]
%4 = kv_write(%v_pool.1, %v, %slot_mapping) : f32[B, 4, 2, 8]
output k_pool.0 = %0
output v_pool.0 = %1
output k_pool.1 = %3
output v_pool.1 = %4
"""))
    plan = plan_memory_report(g, buckets=[(4, 2)], device_memory_bytes=100_000, memory_utilization=0.5,
                              block_size=4, max_model_len=16, reserve_bytes=1000)
    assert plan.kv_bytes_per_block == 1024
    assert plan.weight_bytes == 256
    # The matmul's result [4, 2, 8] f32 is the only temporary: 256 B.
    assert plan.buckets[0].activation_bytes == 256 and plan.buckets[0].io_bytes == 528
    # The copy-on-write executable gathers up to 2 pairs' source blocks (both layers, k and v):
    # 2 x 1024 B, more than the step's 784.
    assert plan.peak_activation_bytes == 2048
    assert plan.num_kv_blocks == (50_000 - 256 - 2048 - 1000) // 1024 == 45
    assert plan.max_concurrent_seqs == 45 // 4 == 11


def test_sampler_workspace_gains_the_gathered_logits_under_tensor_parallelism():
    from passes.plan_memory import SAMPLER_WORKSPACE_ARRAYS, sampler_workspace_bytes

    g = final_graph()
    one = sampler_workspace_bytes(g, {"S": 4, "R": 4, "tp": 1})
    assert one == SAMPLER_WORKSPACE_ARRAYS * 4 * 256 * 4
    assert sampler_workspace_bytes(g, {"S": 4, "R": 4, "tp": 2}) == one // SAMPLER_WORKSPACE_ARRAYS * (SAMPLER_WORKSPACE_ARRAYS + 1)


def test_sampler_io_matches_the_samplers_own_buffers():
    """plan_memory mirrors runtime.worker.sampler's per-row arguments (it may not import it)."""
    from passes.plan_memory import SAMPLER_TOP_LOGPROBS, sampler_io_bytes
    from runtime.worker import sampler

    rows, vocab, max_model_len = 16, 49152, 2048
    ins = sum(math.prod(v.shape) * v.dtype.itemsize for v in sampler.input_specs(rows, max_model_len, vocab).values()
              if v.shape)  # the bucket-wide flags are a few bytes
    outs = rows * 4 * (2 + 2 * sampler.NUM_TOP_LOGPROBS)
    assert SAMPLER_TOP_LOGPROBS == sampler.NUM_TOP_LOGPROBS
    assert sampler_io_bytes(rows, vocab, max_model_len) == ins + outs


def test_budget_edges():
    g = final_graph()
    assert report(g, device_memory_bytes=1 * MiB).num_kv_blocks == 0  # weights don't even fit
    assert report(g, num_kv_blocks=123).num_kv_blocks == 123          # an explicit count wins
    assert report(g, memory_utilization=0.5).num_kv_blocks < report(g, memory_utilization=0.9).num_kv_blocks
    more_len = report(g, max_model_len=512)
    assert more_len.max_concurrent_seqs == more_len.num_kv_blocks // 32
    with pytest.raises(ValueError, match="memory_utilization"):
        report(g, memory_utilization=1.5)
    with pytest.raises(ValueError, match="lowering"):
        activation_peak_bytes(g, {"T": 8, "S": 4, "R": 4, "M": 4}, "magic")


def test_plan_round_trips_and_prints_both_numbers():
    plan = report(final_graph())
    back = MemoryPlan.from_dict(plan.to_dict())
    assert back == plan
    from dataclasses import replace

    with_xla = replace(plan, buckets=tuple(replace(b, xla_temp_bytes=b.activation_bytes // 2)
                                           for b in plan.buckets))
    text = with_xla.table()
    assert "predicted temp" in text and "XLA temp" in text and "2.00" in text
    assert f"{plan.num_kv_blocks} blocks x 16 tokens" in text


# ------------------------------------------------------------------------------ weights by dtype

def _quantized_matmul_bytes(g_f32, g_int8):
    sources = {p.attr("quantize_int8") for p in g_int8.params if p.attr("quantize_int8")}
    f32 = sum(math.prod(p.shape) * 4 for p in g_f32.params if p.name in sources)
    scales = sum(math.prod(p.shape) * 4 for p in g_int8.params if p.attr("int8_scale"))
    return f32, scales


@pytest.mark.parametrize("name", ["tiny", "smollm2-135m", "llama-2-7b", "llama-2-13b"])
def test_int8_quarters_matmul_weight_bytes(name):
    f32 = final_graph(name)
    int8 = final_graph(name, quantization="int8")
    quantized_f32, scales = _quantized_matmul_bytes(f32, int8)
    assert quantized_f32 > 0
    # Every quantized matrix goes from 4 bytes to 1 per weight, plus one f32 scale per column;
    # the embedding table (a gather, or the tied LM head) stays f32.
    assert weight_bytes(int8) == weight_bytes(f32) - quantized_f32 + quantized_f32 // 4 + scales
    if name.startswith("llama"):
        # Big models: the embedding is a sliver, so the whole weight footprint is about a quarter.
        assert 0.25 < weight_bytes(int8) / weight_bytes(f32) < 0.28
    assert weight_bytes(final_graph(name, "bf16")) * 2 == weight_bytes(f32)


def test_int8_frees_memory_for_kv():
    kw = dict(device_memory_bytes=4 << 30, max_model_len=512, buckets=[(128, 16)])
    f32 = report(final_graph("smollm2-135m"), **kw)
    int8 = report(final_graph("smollm2-135m", quantization="int8"), **kw)
    assert int8.num_kv_blocks > f32.num_kv_blocks
    assert (int8.num_kv_blocks - f32.num_kv_blocks) * f32.kv_bytes_per_block == pytest.approx(
        f32.weight_bytes - int8.weight_bytes, abs=2 * f32.kv_bytes_per_block)


# ------------------------------------------------------------------------------ liveness model

def test_liveness_rules_by_hand():
    g = verify(parse_graph("""\
input %x : f32[T, 8]
param %w1 : f32[8, 16]
param %w2 : f32[16, 8]
param %n : f32[16]
%0 = matmul(%x, %w1) : f32[T, 16]
%1 = silu(%0) : f32[T, 16]
%2 = reshape(%1) {shape=["T", 2, 8]} : f32[T, 2, 8]
%3 = reshape(%2) {shape=["T", 16]} : f32[T, 16]
%4 = rms_norm(%3, %n) {eps=1e-05} : f32[T, 16]
%5 = matmul(%4, %w2) : f32[T, 8]
output y = %5
"""))
    t = 4
    # %0, a matmul result (64 B/token), feeds silu -> reshape -> reshape -> rms_norm: one fused
    # elementwise chain (each link has a single fusible user) with no buffers of its own, whose
    # root rms_norm materializes (its user, a matmul, cannot absorb it). The fused kernel reads
    # %0 while it writes %4, so both are live then. The last matmul writes the step's output
    # buffer, which is not a temporary.
    assert activation_peak_bytes(g, {"T": t}) == 64 * t + 64 * t
    # Step I/O: x in, y out.
    assert step_io_bytes(g, {"T": t}) == 32 * t + 32 * t


def test_liveness_counts_values_with_several_users():
    g = verify(parse_graph("""\
input %x : f32[T, 8]
param %w : f32[8, 8]
%0 = matmul(%x, %w) : f32[T, 8]
%1 = silu(%0) : f32[T, 8]
%2 = add(%1, %0) : f32[T, 8]
%3 = mul(%1, %2) : f32[T, 8]
output y = %3
"""))
    # %0 (two users) and %1 (two users) are materialized; %2 fuses into %3 (the output).
    assert activation_peak_bytes(g, {"T": 2}) == 2 * (32 * 2)


def test_attention_workspace_scales_with_chunk_not_context():
    g = final_graph("smollm2-135m", max_model_len=4096)
    small = {"T": 128, "S": 16, "R": 16, "M": 32}
    big = dict(small, M=256)
    chunked = activation_peak_bytes(g, small), activation_peak_bytes(g, big)
    gather = activation_peak_bytes(g, small, "gather"), activation_peak_bytes(g, big, "gather")
    assert chunked[0] == chunked[1]           # the loop walks 8 blocks at a time
    assert gather[1] > 6 * gather[0]          # the reference gathers the whole context
    assert chunked[0] < gather[0]


# ------------------------------------------------------------------------------ against XLA

def executor_paged_lowering() -> str:
    """Which paged_attention lowering the executor uses on this backend (plan_memory models both)."""
    from runtime.worker import executor, kernels

    impl = executor._kernel_impls(executor.resolve_backend("auto")).get("paged_attention")
    if impl is None:
        return "gather"  # ir.ops.paged_attention_reference
    assert getattr(impl, "func", impl) is kernels.paged_attention_xla, impl  # cpp: a partial of it
    return "chunked"


XLA_BUCKETS = [(32, 4), (64, 16), (128, 16)]


@pytest.fixture(scope="module")
def smol_plan(smollm2):
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig

    config, weights, tok = smollm2
    # The plan the XLA backend runs: a cpp plan's GGUF tiles stand in for their weights, which
    # only the C++ kernel multiplies by in place (XLA would widen them in every step).
    engine = EngineConfig(**SMOL_ARGS, kernel_backend="xla")
    return compile_plan(None, engine, weights=weights, config=config, tokenizer=tok)


@pytest.mark.parametrize("lowering,scan", [("chunked", False), ("gather", False), ("chunked", True)])
def test_predicted_activation_peak_matches_xla(smol_plan, lowering, scan, monkeypatch, capsys):
    """Our liveness prediction vs XLA's temp_size_in_bytes, on three real SmolLM2 buckets, for
    each way the executor can lower paged_attention on the XLA backend, unrolled and scanned."""
    from dataclasses import replace

    from runtime.worker import executor, kernels
    from runtime.worker.model_runner import ModelRunner

    forced = {"chunked": {"paged_attention": kernels.paged_attention_xla}, "gather": {}}[lowering]
    monkeypatch.setattr(executor, "_kernel_impls", lambda backend: forced)
    plan = replace(smol_plan, engine=replace(smol_plan.engine, scan_layers=scan))
    assert set(XLA_BUCKETS) <= set(plan.buckets.pairs())
    runner = ModelRunner(plan, backend="xla")
    assert (runner.layout.layers is not None) == scan
    xla = {}
    for bucket in XLA_BUCKETS:
        xla[bucket] = int(runner.compile_bucket(bucket).memory_analysis().temp_size_in_bytes)
    memory = plan_memory_report(
        plan.graph, buckets=XLA_BUCKETS, device_memory_bytes=plan.memory.device_memory_bytes,
        memory_utilization=plan.memory.memory_utilization, block_size=plan.engine.block_size,
        max_model_len=SMOL_ARGS["max_model_len"], reserve_bytes=plan.memory.reserve_bytes,
        paged_attention_lowering=lowering, scan_layers=scan)
    memory = replace(memory, buckets=tuple(replace(b, xla_temp_bytes=xla[(b.num_tokens, b.num_seqs)])
                                           for b in memory.buckets))
    with capsys.disabled():
        print(f"\npaged_attention lowered as {lowering!r}, scan_layers={scan}:\n{memory.table()}")
    for b in memory.buckets:
        assert b.xla_temp_bytes > 0
        assert abs(b.activation_bytes - b.xla_temp_bytes) <= 0.25 * b.xla_temp_bytes, (
            f"bucket {b.num_tokens}x{b.num_seqs}: predicted {b.activation_bytes / MiB:.2f} MiB "
            f"vs XLA {b.xla_temp_bytes / MiB:.2f} MiB")
    if lowering == PipelineOptions().paged_attention_lowering and scan == executor.scans_layers(smol_plan.engine):
        # The plan compile_plan made (which sized the KV pool, scanned or not as the engine runs
        # by default here) carries these predictions.
        planned = {(b.num_tokens, b.num_seqs): b.activation_bytes for b in plan.memory.buckets}
        assert all(planned[(b.num_tokens, b.num_seqs)] == b.activation_bytes for b in memory.buckets)


def test_plan_models_the_executors_lowering():
    assert executor_paged_lowering() == PipelineOptions().paged_attention_lowering


# ------------------------------------------------------------------------------ KV cache groups

def test_window_group_gets_its_share_of_the_kv_budget():
    """gemma-3-1b (22 sliding layers of window 512, 4 global): the sliding layers' pools form the
    window group (ir.kv_groups). The budget left for KV is split so that each sequence at
    max_model_len has its full-length blocks in the full group and its window's blocks in the
    window group (plus a chunk's blocks and the null block there); 2.6x the sequences a cache
    keeping every layer's blocks holds."""
    from ir.kv_groups import window_blocks_for, window_blocks_per_seq

    c = get_preset("gemma-3-1b")
    g = final_graph("gemma-3-1b", max_model_len=2048, block_size=16, buckets=((8, 4), (32, 4)))
    plan = report(g, device_memory_bytes=16 << 30, block_size=16, max_model_len=2048)
    layer_block = 2 * c.num_kv_heads * c.head_dim * 4 * 16
    assert plan.kv_window == 512
    assert plan.kv_bytes_per_block == kv_bytes_per_block(g) == 4 * layer_block
    assert plan.window_kv_bytes_per_block == kv_bytes_per_block(g, window=True) == 22 * layer_block
    free = plan.budget_bytes - plan.weight_bytes - plan.peak_activation_bytes - plan.reserve_bytes
    assert 0 <= free - plan.kv_cache_bytes < plan.window_kv_bytes_per_block
    per_seq_window = window_blocks_per_seq(512, 16, 2048)
    assert per_seq_window == 33
    seqs = plan.num_kv_blocks / 128
    extra = 32 // 16 + 1  # the largest step's 32 tokens, and the null block
    assert abs((plan.num_window_kv_blocks - extra) / per_seq_window - seqs) < 1
    assert plan.max_concurrent_seqs == int(seqs) > 0
    every_layer = free // (26 * layer_block * 128)
    assert plan.max_concurrent_seqs >= 2.6 * every_layer
    assert g.meta_value("num_window_kv_blocks") is not None  # the pass records both counts
    # A full-group count the user fixed: the window group holds as many sequences' windows.
    fixed = report(g, device_memory_bytes=16 << 30, block_size=16, max_model_len=2048, num_kv_blocks=300)
    assert fixed.num_kv_blocks == 300
    assert fixed.num_window_kv_blocks == window_blocks_for(300, window=512, block_size=16, max_model_len=2048,
                                                           max_num_batched_tokens=32) == 3 * 33 + extra
    assert "window-512 layers" in fixed.table()
    # A model without sliding layers: one group, as before.
    llama = report(final_graph())
    assert llama.kv_window is None and llama.num_window_kv_blocks == 0 and llama.window_kv_bytes_per_block == 0


# ------------------------------------------------------------------------------ what the configuration uses

def test_the_pool_takes_no_more_than_the_configuration_can_use():
    """max_kv_blocks (on CPU, max_num_seqs x max_model_len and the prefix cache's room) caps the
    pool where the budget leaves more, and is no floor where it leaves less."""
    g = final_graph()
    free = report(g)
    capped = report(g, max_kv_blocks=20)
    assert free.num_kv_blocks > 20 == capped.num_kv_blocks
    assert capped.max_concurrent_seqs == 20 // 4
    assert "what max_num_seqs x max_model_len use" in capped.table()
    assert report(g, max_kv_blocks=10**9).num_kv_blocks == free.num_kv_blocks
    assert report(g, max_kv_blocks=20, num_kv_blocks=100).num_kv_blocks == 100  # a fixed count wins
    assert MemoryPlan.from_dict(capped.to_dict()) == capped


def test_kv_cache_bytes_the_user_fixed():
    g = final_graph()
    plan = report(g, kv_cache_memory_bytes=1 * MiB, max_kv_blocks=20)  # the fixed size wins over the cap
    assert plan.num_kv_blocks == MiB // plan.kv_bytes_per_block > 20
    assert "fixed at 1.0 MiB" in plan.table()
    assert report(g, kv_cache_memory_bytes=1 * MiB, num_kv_blocks=7).num_kv_blocks == 7


def test_the_cap_gives_the_window_group_its_sequences():
    from ir.kv_groups import window_blocks_for

    g = final_graph("gemma-3-1b", max_model_len=2048, block_size=16, buckets=((8, 4), (32, 4)))
    plan = report(g, device_memory_bytes=16 << 30, block_size=16, max_model_len=2048, max_kv_blocks=5 * 128)
    assert plan.num_kv_blocks == 5 * 128 and plan.max_concurrent_seqs == 5
    assert plan.num_window_kv_blocks == window_blocks_for(5 * 128, window=512, block_size=16, max_model_len=2048,
                                                          max_num_batched_tokens=32)
