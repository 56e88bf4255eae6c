"""EngineConfig's checks (config.engine_config) and the engine flags that build it (runtime.entrypoints.args).

Pure Python: nothing here compiles or touches a device.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest

from runtime.entrypoints.args import ArgumentParser, add_engine_args, engine_config_from_args, engine_kwargs_from_args
from config.engine_config import KERNEL_BACKENDS, EngineConfig, resolve_dtype

GiB, MiB = 1 << 30, 1 << 20
CONFIG_LOGGER = EngineConfig.__module__  # where EngineConfig logs the values it changes


# ------------------------------------------------------------------------------ EngineConfig checks

def test_defaults_are_valid_and_round_trip():
    e = EngineConfig()
    assert e.dtype in ("f32", "bf16")  # `auto`, resolved for this platform
    assert EngineConfig.from_kwargs(**e.to_dict()) == e


@pytest.mark.parametrize("field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                   "tensor_parallel_size", "num_scheduler_steps"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "8", None])
def test_counts_must_be_positive_ints(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive int"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("block_size", [3, 12, 24])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig(block_size=block_size)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, 2])
def test_memory_utilization_must_be_a_share(value):
    with pytest.raises(ValueError, match=r"memory_utilization must be in \(0, 1\]"):
        EngineConfig(memory_utilization=value)


def test_memory_utilization_one_is_allowed():
    assert EngineConfig(memory_utilization=1.0).memory_utilization == 1.0


@pytest.mark.parametrize("field, bad, good", [
    ("scheduling", "fifo", ("continuous", "dynamic", "static")),
    ("quantization", "int4", (None, "int8")),
    ("kernel_backend", "cuda", KERNEL_BACKENDS),
])
def test_choices(field, bad, good):
    for value in good:
        assert getattr(EngineConfig(**{field: value}), field) == value
    with pytest.raises(ValueError, match=f"{field} must be"):
        EngineConfig(**{field: bad})


def test_kernel_backends_are_the_flag_choices():
    assert KERNEL_BACKENDS == ("auto", "xla", "cpp", "pallas", "interpret")
    assert _parser().parse_args(["--kernel-backend", "cpp"]).kernel_backend == "cpp"
    with pytest.raises(SystemExit):
        _parser().parse_args(["--kernel-backend", "cuda"])


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int4")


def test_max_num_seqs_is_clamped_to_the_token_budget_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        e = EngineConfig(max_num_seqs=64, max_num_batched_tokens=32)
    assert e.max_num_seqs == 32
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "max_num_seqs 64 lowered to max_num_batched_tokens 32" in caplog.text


def test_without_chunked_prefill_the_token_budget_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        e = EngineConfig(enable_chunked_prefill=False, max_model_len=1024, max_num_batched_tokens=256)
    assert e.max_num_batched_tokens == 1024
    assert "max_num_batched_tokens 256 raised to max_model_len 1024" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        chunked = EngineConfig(max_model_len=1024, max_num_batched_tokens=256)
    assert chunked.max_num_batched_tokens == 256 and not caplog.records


def test_no_warning_when_nothing_changes_and_none_again_on_replace(caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        e = EngineConfig(max_num_seqs=16, max_num_batched_tokens=128)
        dataclasses.replace(e, seed=1)
    assert not caplog.records


def test_gpu_memory_utilization_is_an_alias():
    assert EngineConfig.from_kwargs(gpu_memory_utilization=0.5).memory_utilization == 0.5
    with pytest.raises(ValueError, match="memory_utilization"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)


def test_unknown_engine_args_are_named():
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['max_seqs'\]"):
        EngineConfig.from_kwargs(max_seqs=4)


# ------------------------------------------------------------------------------ dtypes

@pytest.mark.parametrize("names, ir_dtype", [
    (("float32", "fp32", "f32", "FLOAT32"), "f32"),
    (("bfloat16", "bf16", "BFloat16"), "bf16"),
    (("float16", "half", "f16"), "f16"),
])
def test_dtype_aliases(names, ir_dtype):
    for name in names:
        assert resolve_dtype(name) == ir_dtype
        assert EngineConfig(dtype=name).dtype == ir_dtype


@pytest.mark.parametrize("platform, ir_dtype", [("cpu", "f32"), ("gpu", "bf16"), ("cuda", "bf16"),
                                                 ("rocm", "bf16"), ("tpu", "bf16"), ("metal", "f32")])
def test_auto_dtype_by_platform(platform, ir_dtype):
    assert resolve_dtype("auto", platform) == ir_dtype


def test_auto_dtype_on_this_machine_follows_jax():
    import jax

    assert EngineConfig(dtype="auto").dtype == resolve_dtype("auto", jax.default_backend())


def test_unknown_dtype():
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8")


# ------------------------------------------------------------------------------ scans_layers

@pytest.mark.parametrize("scan_layers, platform, expected", [
    (None, "cpu", False), (None, "gpu", True), (None, "tpu", True),
    (True, "cpu", True), (False, "gpu", False),
])
def test_scans_layers(scan_layers, platform, expected):
    assert EngineConfig(scan_layers=scan_layers).scans_layers(platform) is expected


@pytest.mark.parametrize("engine", [{}, {"dtype": "bfloat16"}, {"quantization": "w8a8"}])
def test_cpu_scans_layers_by_default_under_tensor_parallelism(engine):
    """Under tensor parallelism the step scans on CPU whatever the kernels: unrolled, XLA:CPU kept
    every layer's compiled fusions resident per bucket (tp=3 served at 1.73x tp=1's memory). An
    explicit scan_layers wins."""
    assert EngineConfig(**engine).scans_layers("cpu") is False
    assert EngineConfig(tensor_parallel_size=2, **engine).scans_layers("cpu") is True
    assert EngineConfig(tensor_parallel_size=2, scan_layers=False, **engine).scans_layers("cpu") is False


@pytest.mark.parametrize("quantization, expected", [("int8", True), ("w8a8", False), (None, False)])
def test_cpu_scans_layers_by_default_under_weight_only_int8(quantization, expected):
    """On CPU, weight-only int8 scans by default (its kernels read the stack in place; unrolled,
    XLA widened every layer's weights at once); W8A8's wide products (XLA's dot) and f32 without
    the f32 kernel would copy each layer's slice, and stay unrolled. An explicit scan_layers wins
    either way."""
    assert EngineConfig(quantization=quantization).scans_layers("cpu") is expected
    assert EngineConfig(quantization=quantization, scan_layers=False).scans_layers("cpu") is False


@pytest.mark.parametrize("engine, expected", [
    ({}, True), ({"dtype": "bfloat16"}, False), ({"matmul_precision": "bfloat16"}, False),
    ({"quantization": "w8a8"}, False), ({"quantization": "int8"}, True), ({"scan_layers": False}, False),
])
def test_cpu_scans_f32_layers_where_the_f32_kernel_reads_them_in_place(engine, expected):
    """Where the f32 kernel reads a layer's weights in the stack (f32_in_place), an f32 engine with
    f32 matmuls scans on CPU by default; a bf16 plan and bf16 matmuls (whose products XLA takes on a
    slice) stay unrolled; an explicit scan_layers wins. Without the kernel, f32 stays unrolled."""
    assert EngineConfig(**engine).scans_layers("cpu", f32_in_place=True) is expected
    assert EngineConfig(**engine).scans_layers("cpu", f32_in_place=False) is (engine.get("quantization") == "int8")
    # GGUF tiles read in place by every build (blocks_in_place) scan the f32 engine as the f32 kernel does.
    assert EngineConfig(**engine).scans_layers("cpu", blocks_in_place=True) is expected


# ------------------------------------------------------------------------------ flags (runtime.entrypoints.args)

def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="t")
    add_engine_args(ap)
    return ap


def test_flag_defaults_are_engine_config_defaults():
    args = _parser().parse_args([])
    kw = engine_kwargs_from_args(args)
    defaults = EngineConfig.__dataclass_fields__
    assert kw and all(v == defaults[k].default for k, v in kw.items())
    assert "device_memory" not in kw  # measured on GPU unless given
    assert engine_config_from_args(args) == EngineConfig()


@pytest.mark.parametrize("text, num_bytes", [
    ("80", 80 * GiB), ("80G", 80 * GiB), ("80GiB", 80 * GiB), ("80gib", 80 * GiB), ("512MiB", 512 * MiB),
    ("80GB", 80 * 10**9), ("1.5GiB", 3 * GiB // 2),
])
def test_device_memory_flag_units(text, num_bytes):
    args = _parser().parse_args(["--device-memory", text])
    assert engine_kwargs_from_args(args)["device_memory"] == num_bytes
    assert engine_config_from_args(args).device_memory == num_bytes


@pytest.mark.parametrize("text", ["80X", "0", "-1", "GiB", "4GB0"])
def test_bad_device_memory_is_one_line(capsys, text):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--device-memory", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"bad memory size {text!r}" in err and "(see t --help)" in err


@pytest.mark.parametrize("flag, ir_dtype", [("auto", None), ("float32", "f32"), ("fp32", "f32"), ("f32", "f32"),
                                            ("bfloat16", "bf16"), ("BF16", "bf16"), ("float16", "f16"),
                                            ("half", "f16")])
def test_dtype_flag_aliases(flag, ir_dtype):
    e = engine_config_from_args(_parser().parse_args(["--dtype", flag]))
    assert e.dtype == (ir_dtype or resolve_dtype("auto"))


def test_bad_dtype_flag_is_one_line(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--dtype", "int4"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown dtype 'int4'" in err


def test_flags_reach_the_config():
    args = _parser().parse_args(["--gpu-memory-utilization", "0.5", "-tp", "2", "--enable-prefix-caching",
                                 "false", "--enable-chunked-prefill", "yes", "--max-num-seqs", "8",
                                 "--scheduling", "static", "--quantization", "int8", "--kernel-backend", "xla"])
    e = engine_config_from_args(args)
    assert (e.memory_utilization, e.tensor_parallel_size, e.enable_prefix_caching, e.enable_chunked_prefill,
            e.max_num_seqs, e.scheduling, e.quantization, e.kernel_backend) == \
        (0.5, 2, False, True, 8, "static", "int8", "xla")


def test_flag_values_get_the_config_checks():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        engine_config_from_args(_parser().parse_args(["--block-size", "12"]))


def test_every_engine_field_has_a_flag_or_says_why_not():
    """One path for engine settings: the flag table covers EngineConfig, so a new field can't be
    forgotten on the command line."""
    import dataclasses

    from config.flags import _ENGINE_FLAGS, NO_FLAG_FIELDS
    from config.engine_config import EngineConfig

    flagged = {name for name, *_ in _ENGINE_FLAGS}
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert flagged | set(NO_FLAG_FIELDS) == fields
    assert not flagged & set(NO_FLAG_FIELDS)
