"""The memory plan the engine keeps: the KV pool sized from XLA's measured peak, every mode starting
at its defaults, refusals only for what the user fixed, per-device budgets under tensor
parallelism, and the GPU arithmetic with injected allocator numbers.

Fast tests run on the tiny random model (a 256 MiB budget: the property is the same, the pools
small); the real SmolLM2 checks bf16 and tp=3 at the engine's own defaults (slow). The multi-device
cases run in a subprocess, as in test_shard.py: `python tests/test_memory_fit.py <case>` prints
one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # the child: forced host devices, before anything imports jax
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                               + os.environ.get("CHILD_DEVICES", "2")).strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402

from conftest import tiny_bpe_tokenizer, tiny_llm  # noqa: E402
from config.flags import DoesNotFit  # noqa: E402

MiB = 1 << 20
# The tiny model's engine: its 512 positions, a 256 MiB budget and a bucket table of 9 (every mode
# compiles all of them twice over: the steps and the engine's other executables).
TINY_BUDGET = dict(device_memory=256 * MiB, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = [[5, 9, 33, 100, 7], [3] * 40 + [17, 18], [200, 11, 12]]


def greedy(max_tokens=8, **kw):
    from runtime import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_fits(llm) -> dict:
    """The engine's memory after start-up: measured, within budget, and the pool the block manager
    hands out is the one on the device."""
    memory = llm.plan.memory
    runner = llm.engine.runner
    assert memory.measured_peak_bytes is not None and memory.measured_peak_bytes > 0
    assert memory.weight_bytes + memory.kv_cache_bytes + memory.measured_peak_bytes <= memory.budget_bytes
    assert llm.engine.block_manager.num_blocks == memory.num_kv_blocks == runner.num_blocks
    pools = next(iter(runner.state.values()))
    assert pools.shape[0] == runner.num_blocks * runner.layout.num_layers
    return {"predicted": memory.peak_activation_bytes, "measured": memory.measured_peak_bytes,
            "blocks": memory.num_kv_blocks, "planned": memory.planned_kv_blocks}


# ------------------------------------------------------------------------ sizing from the measurement

@pytest.fixture
def uncapped(monkeypatch):
    """The pool as large as the budget allows: these tests are about the budget binding, which on a
    CPU the configuration's own need (EngineConfig.kv_blocks_used: 160 blocks here) would preempt."""
    from config.engine_config import EngineConfig

    monkeypatch.setattr(EngineConfig, "kv_blocks_used", lambda self: 1 << 40)


@pytest.mark.slow
def test_the_pool_is_sized_from_the_measured_peak_when_the_prediction_is_wrong(monkeypatch, uncapped):
    """A prediction far below what XLA measures (here: the model told it there are no
    activations) must not make the engine refuse its own plan: the pool shrinks to what fits."""
    import passes.plan_memory as pm

    monkeypatch.setattr(pm, "activation_peak_bytes", lambda *a, **k: 0)
    monkeypatch.setattr(pm, "sampler_workspace_bytes", lambda *a, **k: 0)
    llm = tiny_llm(**TINY_BUDGET, reserve_bytes=0)  # no reserve to absorb the miss
    got = assert_fits(llm)
    memory = llm.plan.memory
    assert got["predicted"] < got["measured"]
    assert got["planned"] > got["blocks"] == memory.blocks_that_fit(got["measured"])
    assert "the prediction gave" in memory.table()
    outs = llm.generate(PROMPTS, greedy())
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


@pytest.mark.slow
def test_a_prediction_that_fits_closely_keeps_its_pool(monkeypatch, uncapped):
    """A measurement a little above the prediction (within the reserve), or a little below it,
    keeps the planned pool: no second compile for a few blocks."""
    from runtime.worker.model_runner import ModelRunner

    real = ModelRunner._measure
    for extra in (0, 12 * MiB):  # the tiny model's prediction is about 8 MiB above XLA's peak
        monkeypatch.setattr(ModelRunner, "_measure", lambda self, c: (real(self, c)[0] + extra, real(self, c)[1]))
        llm = tiny_llm(**(TINY_BUDGET | dict(device_memory=1 << 30)))
        got = assert_fits(llm)
        assert got["blocks"] == got["planned"], (extra, got)
        assert (got["measured"] > got["predicted"]) == (extra > 0), got


@pytest.mark.slow
def test_a_prediction_far_above_the_measurement_grows_the_pool(monkeypatch, uncapped):
    import passes.plan_memory as pm

    real = pm.activation_peak_bytes
    monkeypatch.setattr(pm, "activation_peak_bytes", lambda *a, **k: real(*a, **k) + 64 * MiB)
    llm = tiny_llm(**TINY_BUDGET)
    got = assert_fits(llm)
    assert got["blocks"] > got["planned"] * 1.05
    assert got["blocks"] == llm.plan.memory.blocks_that_fit(got["measured"])


@pytest.mark.slow
def test_a_block_count_the_user_fixed_is_refused_with_one_that_fits(uncapped):
    llm = tiny_llm(**TINY_BUDGET)
    fits = llm.plan.memory.num_kv_blocks
    with pytest.raises(DoesNotFit, match=r"--num-kv-blocks \d+ or fewer fits") as e:
        tiny_llm(**TINY_BUDGET, num_kv_blocks=fits + 10_000)  # 156 MiB past the reserve
    assert isinstance(e.value, MemoryError)
    kept = tiny_llm(**TINY_BUDGET, num_kv_blocks=fits // 2)
    assert assert_fits(kept)["blocks"] == fits // 2


def test_a_max_model_len_the_measurement_leaves_no_room_for_is_refused(monkeypatch):
    """The prediction said one max_model_len sequence fits; XLA's peak leaves less: one line with
    the numbers and a max_model_len that fits, not a MemoryError traceback after serving starts."""
    from runtime.worker.model_runner import ModelRunner

    real = ModelRunner._measure

    def inflated(self, compiled):
        temp, io = real(self, compiled)
        return temp + 230 * MiB, io  # leaves a few blocks of the 256 MiB

    monkeypatch.setattr(ModelRunner, "_measure", inflated)
    with pytest.raises(DoesNotFit, match=r"lower --max-model-len to \d+ or less"):
        tiny_llm(**TINY_BUDGET)


# ------------------------------------------------------------------------ what XLA was asked to hold

def _tiny_runner(num_kv_blocks, preset="tiny", max_model_len=256, **engine):
    from models.config import get_preset
    from models.weights import random_weights
    from config.engine_config import EngineConfig
    from runtime.engine.plan import compile_plan
    from runtime.worker.model_runner import ModelRunner

    cfg = get_preset(preset)
    if preset != "tiny":  # its shapes, two layers
        cfg = replace(cfg, num_layers=2)
    plan = compile_plan(None, EngineConfig(max_model_len=max_model_len, max_num_seqs=8, max_num_batched_tokens=64,
                                           num_kv_blocks=num_kv_blocks, **engine),
                        weights=random_weights(cfg), config=cfg)
    return ModelRunner(plan)


def test_a_one_token_write_does_not_copy_the_pool():
    """XLA turned a one-index scatter into a dynamic-update-slice and copied the whole pool of
    every layer around the attention loop: a one-row step's temporaries grew with the pool."""
    temps = []
    for blocks in (64, 1024):
        runner = _tiny_runner(blocks, kernel_backend="xla")
        temps.append(runner.compile_bucket((1, 1)).memory_analysis().temp_size_in_bytes)
    pool_bytes = 1024 * 32 * 2 * 16 * 4  # one layer's K pool at 1024 blocks
    assert temps[1] - temps[0] < pool_bytes // 8, temps


def test_half_precision_weights_are_widened_one_at_a_time():
    """XLA:CPU widens bf16 weights to f32 for its products; it had moved every widening of a
    one-row step to the top of the program (all the weights in f32 at once)."""
    runner = _tiny_runner(64, dtype="bfloat16")
    temp = runner.compile_bucket((1, 1)).memory_analysis().temp_size_in_bytes
    f32_weights = sum(p.size * 4 for p in runner.params.values())
    largest = max(p.size * 4 for p in runner.params.values())
    assert temp < f32_weights / 2, (temp, f32_weights)
    assert temp < 2 * largest + 64 * 1024, (temp, largest)


# ------------------------------------------------------------------------ every mode at its defaults

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MODES = {
    "bf16": dict(dtype="bfloat16"),
    "fp16": dict(dtype="float16"),
    "int8": dict(quantization="int8"),
    "w8a8": dict(quantization="w8a8"),
    "bf16 KV cache": dict(kv_cache_dtype="bfloat16"),
    "scan on": dict(scan_layers=True),
    "scan off": dict(scan_layers=False),
    "ngram speculation": dict(speculative_config=NGRAM),
    "multi-step decode": dict(num_scheduler_steps=4),
}


# bf16 stays in the fast loop (the mode the issue found refused); the others compile as many
# executables each (50-150 s on two loaded cores), so they run with the slow tests, in CI.
@pytest.mark.parametrize("mode", [m if m == "bf16" else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_every_mode_starts_at_its_defaults_and_fits(mode):
    llm = tiny_llm(**TINY_BUDGET, **MODES[mode])
    assert_fits(llm)
    outs = llm.generate(PROMPTS, greedy())
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_fits(llm)


def test_structured_outputs_start_at_defaults_and_fit():
    from models.config import get_preset
    from runtime.core.sampling_params import StructuredOutputsParams

    tok = tiny_bpe_tokenizer()
    cfg = replace(get_preset("tiny"), name="tiny-bpe", vocab_size=300, eos_token_id=tok.eos_token_id)
    llm = tiny_llm(config=cfg, tokenizer=tok, **TINY_BUDGET)
    assert_fits(llm)
    params = greedy(max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"(ab|12){1,3}x"))
    params.ignore_eos = False
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0].text
    assert out and set(out) <= set("ab12x"), out


# ------------------------------------------------------------------------ per device, and on a GPU

def test_cpu_budget_is_the_hosts_split_across_tensor_parallel_devices(monkeypatch):
    import runtime.engine.plan as plan_module
    from config.engine_config import CPU_DEVICE_MEMORY, EngineConfig
    from config.host_memory import read_host_memory
    from runtime.engine.plan import measure_device_memory

    assert measure_device_memory(EngineConfig())[0] == read_host_memory() is not None  # this Linux host
    monkeypatch.setattr(plan_module, "read_host_memory", lambda: 12 << 30)
    assert measure_device_memory(EngineConfig())[0] == 12 << 30
    assert measure_device_memory(EngineConfig(tensor_parallel_size=4))[0] == 3 << 30
    assert measure_device_memory(EngineConfig(tensor_parallel_size=4, device_memory=8 << 30))[0] == 8 << 30
    monkeypatch.setattr(plan_module, "read_host_memory", lambda: None)  # not Linux: the fixed budget
    assert measure_device_memory(EngineConfig(tensor_parallel_size=4))[0] == CPU_DEVICE_MEMORY // 4


# ------------------------------------------------------------------------ the KV pool's size on CPU

TINY_4GIB = dict(TINY_BUDGET, device_memory=4 << 30)


def tiny_plan(**engine):
    """The tiny model's memory plan, as a dry run makes it (no weights, nothing compiled)."""
    from config.engine_config import EngineConfig
    from models.config import get_preset
    from runtime.entrypoints.args import plan_without_weights

    return plan_without_weights(get_preset("tiny"), EngineConfig(**engine))[1]


def test_the_cpu_pool_holds_what_the_configuration_can_use():
    """max_num_seqs x max_model_len in blocks and a quarter more for the prefix cache: 8 sequences
    of 16 blocks and 2 more, where the 4 GiB budget used to give the tiny model ~230,000 blocks."""
    from config.engine_config import EngineConfig

    memory = tiny_plan(**TINY_4GIB)
    assert EngineConfig(**TINY_4GIB).kv_blocks_used() == (8 + 2) * (512 // 32) == memory.num_kv_blocks
    left = memory.budget_bytes - memory.weight_bytes - memory.peak_activation_bytes - memory.reserve_bytes
    assert memory.num_kv_blocks < left // memory.kv_bytes_per_block / 1000  # what the budget alone gave
    assert memory.max_concurrent_seqs == 10
    assert tiny_plan(**TINY_4GIB | dict(max_num_seqs=1)).num_kv_blocks == 2 * 16  # at least one more sequence
    # Where the budget allows less than the configuration can use, the budget binds.
    small = tiny_plan(**TINY_BUDGET | dict(max_num_seqs=64, device_memory=80 << 20))
    assert small.num_kv_blocks == small.blocks_that_fit(small.peak_activation_bytes) < 80 * 16


def test_kv_cache_memory_and_vllm_cpu_kvcache_space_fix_the_pools_bytes(monkeypatch):
    per_block = tiny_plan(**TINY_4GIB).kv_bytes_per_block
    assert tiny_plan(**TINY_4GIB, kv_cache_memory_bytes=64 << 20).num_kv_blocks == (64 << 20) // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert tiny_plan(**TINY_4GIB).num_kv_blocks == (1 << 30) // per_block
    # The process's space, shared by its tensor-parallel devices (each holds half of each block).
    assert tiny_plan(**TINY_4GIB, tensor_parallel_size=2).num_kv_blocks == (1 << 29) // (per_block // 2)
    # The flag (per device) wins over the variable, and a block count over both.
    assert tiny_plan(**TINY_4GIB, kv_cache_memory_bytes=64 << 20).num_kv_blocks == (64 << 20) // per_block
    assert tiny_plan(**TINY_4GIB, num_kv_blocks=40).num_kv_blocks == 40
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's "default"
    assert tiny_plan(**TINY_4GIB).num_kv_blocks == 160


def test_the_gpu_pool_still_takes_what_the_budget_leaves():
    from config.engine_config import planning_for

    with planning_for("gpu"):
        memory = tiny_plan(**TINY_4GIB, dtype="float32")
    assert memory.max_kv_blocks is None
    assert memory.num_kv_blocks == memory.blocks_that_fit(memory.peak_activation_bytes) > 100_000


def test_fixed_kv_bytes_over_the_budget_are_refused_with_a_size_that_fits():
    from runtime.worker.model_runner import check_fit

    memory = tiny_plan(**TINY_BUDGET, kv_cache_memory_bytes=1 << 30)
    with pytest.raises(DoesNotFit, match=r"--kv-cache-memory \d+MiB or less fits"):
        check_fit(memory)


class FakeGpu:
    platform = "gpu"

    def __init__(self, total, in_use=0, fraction=0.75):
        self.stats = {"bytes_limit": int(total * fraction), "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


GB = 10**9


@pytest.mark.parametrize("gpu,total", [("H100", 80 * GB), ("H200", 141 * GB)])
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-2-70b"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpu_plans_from_the_allocators_numbers(monkeypatch, gpu, total, model, tp):
    """What a GPU's allocator reports (JAX preallocates XLA_PYTHON_CLIENT_MEM_FRACTION = 75% of the
    device by default) becomes the plan's budget, per device: the device is bytes_limit / 0.75, the
    budget min(0.9 x device, bytes_limit - bytes_in_use), the weights split tp ways."""
    import jax

    from models.config import get_preset
    from runtime.entrypoints.args import kv_fits, plan_without_weights
    from config.engine_config import EngineConfig
    from runtime.engine.plan import measure_device_memory

    in_use = 512 << 20
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [FakeGpu(total, in_use)])
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    engine = EngineConfig(dtype="bfloat16", tensor_parallel_size=tp)
    device, limit = measure_device_memory(engine)
    assert device == pytest.approx(total, rel=1e-6)
    assert limit == int(total * 0.75) - in_use
    config = get_preset(model)
    _, memory, _ = plan_without_weights(config, engine)
    assert memory.budget_bytes == min(int(device * 0.9), limit) == limit  # the preallocation binds
    full = config.num_params() * 2
    assert memory.weight_bytes == pytest.approx(full / tp, rel=0.05 if tp > 1 else 1e-3)
    left = memory.budget_bytes - memory.weight_bytes - memory.peak_activation_bytes - memory.reserve_bytes
    if left >= memory.kv_bytes_per_block * -(-engine.max_model_len // engine.block_size):
        assert memory.num_kv_blocks == left // memory.kv_bytes_per_block
        assert kv_fits(memory, engine)
    else:  # 70B in bf16 (138 GB) on one H100's 60 GB, or one H200's 105 GB
        assert model == "llama-2-70b" and (tp == 1 or (tp == 2 and gpu == "H100"))
        assert not kv_fits(memory, engine)
    # The model never assumes CPU's widened half-precision weights on a GPU.
    assert memory.peak_activation_bytes < memory.weight_bytes / 2


# ------------------------------------------------------------------------ the multi-device children

def run_child(case: str, devices: int, timeout: int = 900, tp: int | None = None) -> dict:
    env = {**os.environ, "CHILD_DEVICES": str(devices), "CHILD_TP": str(tp or devices)}
    proc = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_tiny_tp() -> dict:
    """tp=2 and tp=2 with bf16 at the (tiny) defaults, tp=1 beside them: fit, greedy tokens, RSS."""
    import resource

    from conftest import CACHE_DIR
    from runtime.worker.model_runner import enable_compilation_cache

    enable_compilation_cache(CACHE_DIR)
    out = {}
    for name, kw in (("tp2", dict(tensor_parallel_size=2)),
                     ("tp2 bf16", dict(tensor_parallel_size=2, dtype="bfloat16")),
                     ("tp1", {})):
        llm = tiny_llm(**TINY_BUDGET, **kw)
        got = assert_fits(llm)
        got["tokens"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
        out[name] = got
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def child_scanned_pool_temps() -> dict:
    """A tp=3 scanned step's temporaries at a small and a large pool, at SmolLM2's shapes with two
    layers (one kv head per device) and its 2048 positions (at 256 XLA kept the pool's layout)."""
    temps = []
    for blocks in (64, 1024):
        runner = _tiny_runner(blocks, "smollm2-135m", max_model_len=2048, tensor_parallel_size=3,
                              scan_layers=True)
        assert runner.layout.layers is not None
        temps.append(int(runner.compile_bucket((8, 4)).memory_analysis().temp_size_in_bytes))
    return {"temps": temps, "pool_bytes": runner.kv_cache_bytes() // 3}


def child_rss() -> dict:
    """Max RSS of one process serving the tiny model at the given tp, on the default CPU budget."""
    import resource

    from conftest import CACHE_DIR
    from runtime.worker.model_runner import enable_compilation_cache

    enable_compilation_cache(CACHE_DIR)
    import runtime.engine.plan as plan_module
    from config.engine_config import EngineConfig

    # A budget that binds, split between the devices: the old fixed 4 GiB, the pool as large as it allows.
    plan_module.read_host_memory = lambda: 4 << 30
    EngineConfig.kv_blocks_used = lambda self: 1 << 40
    tp = int(os.environ["CHILD_TP"])
    llm = tiny_llm(**(TINY_BUDGET | dict(tensor_parallel_size=tp, device_memory=None)))
    llm.generate(PROMPTS, greedy())
    return {"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "kv_bytes": llm.plan.memory.kv_cache_bytes * tp}


def child_smollm2() -> dict:
    """SmolLM2 at its defaults at CHILD_TP: fit, a greedy answer, max RSS, the plan's table."""
    import resource

    from conftest import CACHE_DIR
    from runtime import LLM
    from runtime.worker.model_runner import enable_compilation_cache

    enable_compilation_cache(CACHE_DIR)
    llm = LLM("smollm2-135m", tensor_parallel_size=int(os.environ["CHILD_TP"]))
    got = assert_fits(llm)
    got["text"] = llm.generate(["The capital of France is"], greedy(max_tokens=6))[0].outputs[0].text
    got["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got["table"] = llm.plan.memory.table()
    return got


@pytest.mark.slow  # two processes of forced host devices, each compiling three engines
def test_tensor_parallel_modes_start_at_their_defaults_and_fit():
    res = run_child("tiny_tp", 2)
    assert res["tp2"]["tokens"] == res["tp1"]["tokens"]
    assert len(res["tp2 bf16"]["tokens"][0]) == 8


@pytest.mark.slow
def test_a_scanned_sharded_step_writes_the_pool_in_place():
    """The KV write went through a flat view of the pool ([blocks * block_size, heads, dim]); in a
    step scanned over layers under tensor parallelism, XLA then gave the loop's pool a layout of its
    own and copied the whole pool (every layer's) in and out of the loop: 426 MiB of temporaries for
    SmolLM2 at tp=3. The write now indexes (block, offset) in the pool's own shape."""
    res = run_child("scanned_pool_temps", 3)
    assert res["temps"][1] - res["temps"][0] < res["pool_bytes"] // 8, res


@pytest.mark.slow
def test_rss_under_tensor_parallelism_stays_within_the_one_budget():
    """Forced host devices share one process's memory: tp=2 must not take two budgets."""
    rss = {tp: run_child("rss", 2, tp=tp) for tp in (1, 2)}
    assert rss[2]["kv_bytes"] <= rss[1]["kv_bytes"] * 1.02
    assert rss[2]["maxrss_kib"] <= 1.3 * rss[1]["maxrss_kib"], rss


@pytest.mark.slow
def test_smollm2_bf16_starts_at_its_defaults(smollm2):
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM
    from runtime.engine.plan import compile_plan

    config, weights, tok = smollm2
    plan = compile_plan(None, EngineConfig(dtype="bfloat16"), weights=weights, config=config, tokenizer=tok)
    llm = LLM.from_plan(plan)
    got = assert_fits(llm)
    assert abs(got["predicted"] - got["measured"]) <= 0.15 * got["measured"], llm.plan.memory.table()
    text = llm.generate(["The capital of France is"], greedy(max_tokens=6))[0].outputs[0].text
    assert "Paris" in text, text


@pytest.mark.slow
def test_smollm2_tp3_starts_at_its_defaults_within_1_3x_tp1s_memory():
    """SmolLM2 at tp=3 on forced host devices: its defaults fit, it answers, and the process's
    peak RSS is at most 1.3x that of tp=1 on the same budget (issue 47's target: before the step
    scanned under tensor parallelism it was 1.73x, the unrolled executables' compiled code)."""
    res = {tp: run_child("smollm2", tp, timeout=1200) for tp in (3, 1)}
    assert abs(res[3]["predicted"] - res[3]["measured"]) <= 0.15 * res[3]["measured"], res[3]["table"]
    assert "Paris" in res[3]["text"] and "Paris" in res[1]["text"], res
    assert res[3]["maxrss_kib"] <= 1.3 * res[1]["maxrss_kib"], {tp: r["maxrss_kib"] for tp, r in res.items()}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = {"tiny_tp": child_tiny_tp, "rss": child_rss, "smollm2": child_smollm2,
              "scanned_pool_temps": child_scanned_pool_temps}[sys.argv[1]]()
    print(json.dumps(result))
