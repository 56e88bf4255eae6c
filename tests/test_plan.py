"""Executable plans: save, load without lowering, CLI dry-run, and a served start from a plan."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from runtime import SamplingParams
from runtime.engine.plan import Plan, compile_plan
from config.engine_config import EngineConfig
from runtime.entrypoints.llm import LLM

ARGS = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64)


def tiny_plan():
    from models.config import get_preset
    from models.weights import random_weights

    cfg = get_preset("tiny")
    return compile_plan(None, EngineConfig(**ARGS), weights=random_weights(cfg, seed=3), config=cfg)


@pytest.mark.slow
def test_plan_roundtrip_and_llm_from_directory(tmp_path, monkeypatch):
    plan = tiny_plan()
    out = plan.save(tmp_path / "plan")
    meta = json.loads((out / "plan.json").read_text())
    assert {"config", "engine", "buckets", "memory", "content_hash"} <= set(meta)
    names = sorted(p.name for p in (out / "ir").iterdir())
    assert names[0] == "00-lower.txt" and any("insert_paged_kv" in n for n in names)
    assert "paged_attention" in (out / "graph.txt").read_text()

    # Starting from the plan must not lower or run passes again.
    import models.llama
    import passes.pipeline

    def boom(*a, **k):
        raise AssertionError("a plan start must not lower or run passes")

    monkeypatch.setattr(models.llama, "lower", boom)
    monkeypatch.setattr(passes.pipeline, "run_pipeline", boom)
    loaded = Plan.load(out)
    assert loaded.content_hash() == meta["content_hash"]
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    from_dir = LLM(str(out)).generate(prompts, params)
    in_mem = LLM.from_plan(plan).generate(prompts, params)
    assert [r.outputs[0].token_ids for r in from_dir] == [r.outputs[0].token_ids for r in in_mem]


@pytest.mark.slow
def test_plan_rejects_graph_changing_overrides(tmp_path):
    out = tiny_plan().save(tmp_path / "plan")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(out), max_model_len=64)
    assert LLM(str(out), scheduling="static").engine.scheduler.config.scheduling == "static"


def test_compile_cli_dry_run_shows_memory_plan_and_reacts_to_args():
    def dry(*extra):
        r = subprocess.run([sys.executable, "-m", "runtime.tools.compile", "--model", "llama-2-7b", "--dry-run",
                            "--dtype", "bfloat16", "--device-memory", "80", *extra],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    a = dry("--max-model-len", "4096")
    b = dry("--max-model-len", "2048", "--memory-utilization", "0.5")
    for text in (a, b):
        assert "KV cache" in text and "buckets" in text and "weights" in text
    blocks = lambda t: int(t.split("KV cache")[1].split("(")[1].split()[0])
    assert blocks(b) < blocks(a)  # half the memory budget leaves fewer KV blocks
    seqs = lambda t: int(t.split("max concurrent seqs at max_model_len=")[1].split(":")[1].split()[0])
    assert seqs(b) != seqs(a)
