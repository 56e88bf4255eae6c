"""Scan over layers: the repeated decoder layers found in the IR, run as one lax.scan with stacked
weights and flat multi-layer KV pools; outputs identical to the unrolled step."""

from __future__ import annotations

import conftest
import math
import re

import jax
import pytest

from ir import bind_shape
from ir.graph import Graph
from ir.layers import find_layers
from models.config import get_preset
from runtime import SamplingParams
from runtime.core.buckets import BucketTable
from runtime.engine.plan import build_graph
from config.engine_config import EngineConfig
from runtime.worker import cpp_kernels
from runtime.worker.executor import JNP_DTYPES, build_step, step_layout
from runtime.entrypoints.llm import LLM

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


def served_graph(name="tiny", **engine) -> Graph:
    graph, _, _ = build_graph(get_preset(name), EngineConfig(**(ENGINE | engine)), BucketTable.build(32, 4),
                              device_memory=1 << 30, keep_pass_texts=False)
    return graph


@pytest.mark.parametrize("name,quantization", [("tiny", None), ("tiny", "int8"), ("smollm2-135m", None)])
def test_find_layers(name, quantization):
    graph = served_graph(name, quantization=quantization)
    layers = find_layers(graph)
    cfg = get_preset(name)
    assert layers is not None and layers.num_layers == cfg.num_layers
    assert [n.op for n in layers.pre] == ["embedding"]
    assert layers.template[-1].op == "add" and layers.carry_out == len(layers.template) - 1
    assert {"k_pool.*", "v_pool.*", "layers.*.attn_norm"} <= set(layers.roles)
    assert layers.last_output() is graph.output("hidden")
    layout = step_layout(graph)
    assert set(layout.state_groups) == {"k_pool.*", "v_pool.*"}
    assert layout.state_groups["k_pool.*"] == tuple(f"k_pool.{i}" for i in range(cfg.num_layers))


def test_irregular_layers_are_not_scanned():
    """A layer that differs from the others (here: another rms_norm eps) keeps the graph unrolled."""
    from ir import rewrite

    graph = served_graph()
    norm_1 = next(n for n in graph.nodes() if n.op == "rms_norm"
                  and n.inputs[1].name == "layers.1.attn_norm")

    def fn(node, ins):
        if node is norm_1:
            return type(node)(node.op, ins, (("eps", 1e-3),), node.shape, node.dtype)
        return None

    assert find_layers(rewrite(graph, fn)) is None
    assert step_layout(rewrite(graph, fn)).layers is None


def tiny_llm(scan: bool, **engine) -> LLM:
    return conftest.tiny_llm(seed=1, **(ENGINE | dict(num_kv_blocks=40, scan_layers=scan) | engine))


@pytest.mark.slow
def test_scanned_engine_equals_unrolled():
    """Batching, chunked prefill, prefix hits, n=2 copy-on-write and preemption (a tight pool):
    the scanned step gives exactly the unrolled step's tokens and logprobs."""
    shared = list(range(10, 60))
    prompts = [shared + [3, 4], list(range(5, 9)), shared + [7], list(range(70, 120))]
    # Prompt 2 hits prompt 0's cached block; prompt logprobs go on prompt 3, since a request that asks
    # for them skips prefix-cache hits (as vLLM does).
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, prompt_logprobs=2)]
    got = []
    for scan in (False, True):
        llm = tiny_llm(scan)
        assert (llm.engine.runner.layout.layers is not None) == scan
        outs = llm.generate(prompts, params)
        got.append([[(c.token_ids, c.logprobs) for c in o.outputs] + [o.prompt_logprobs] for o in outs])
        assert llm.engine.stats().num_recompiles == 0
        assert llm.engine.block_manager.stats.hits > 0
    assert got[0] == got[1]


def kernel_weight_operands(hlo: str) -> list[str]:
    """The instructions that give the matmul kernels' custom calls in `hlo` their weight operand."""
    defs = dict(re.findall(r"^\s*(?:ROOT )?(%\S+) = (\S+ [\w-]+)\(", hlo, re.M))
    calls = re.findall(r"custom-call\((%[^,]+), (%[^,)]+)[^)]*\), "
                       r"custom_call_target=\"jaxserve_(?:int8|f32)", hlo)
    return [defs[w] for _, w in calls]


@pytest.mark.parametrize("kernels_off", [False, True])
@pytest.mark.parametrize("quantization", ["w8a8", "int8", None])
@pytest.mark.slow
def test_scanned_matmul_kernels_read_the_stacked_weights_in_place(quantization, kernels_off, monkeypatch):
    """Under kernel_backend="cpp" the matmul kernels (int8 and f32) of a scanned step take each
    layer's weights out of the stack where they lie: their weight operand is the whole stacked
    parameter, not a slice that XLA would copy on every step. On a CPU without the kernels' vector paths no step calls
    them, and XLA's products take the layer's slice (`kernels_off` makes this CPU such a one).
    Tokens and logprobs equal the unrolled step's."""
    if kernels_off:
        monkeypatch.setattr(cpp_kernels, "matmul_vectorized", lambda: False)
    prompts = [list(range(5, 9)), list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    got = []
    for scan in (False, True):
        llm = tiny_llm(scan, quantization=quantization, kernel_backend="cpp")
        got.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)])
        if scan:
            operands = [d for c in llm.engine.runner.compiled.values() for d in kernel_weight_operands(c.as_text())]
            layers = llm.engine.runner.layout.num_layers
            stacked = [d for d in operands if re.match(rf"{'f32' if quantization is None else 's8'}\[{layers},\d+,\d+\]", d)]
            if cpp_kernels.matmul_vectorized():
                # Every layer product reads its stack in place; the LM head's weight is a plain parameter.
                assert stacked and all(d.endswith(("get-tuple-element", "parameter")) for d in operands), operands
            else:
                assert operands == []
    assert got[0] == got[1]


def abstract_args(graph: Graph, layout, blocks: int):
    """(params, state, inputs) shapes of a scanned step: stacked weights, flat [L * B] pools."""
    env = {"T": 32, "S": 4, "R": 4, "M": math.ceil(128 / 16), "B": blocks}
    by_name = {x.name: x for x in graph.inputs}

    def spec(key, names, shape):
        return jax.ShapeDtypeStruct(shape, JNP_DTYPES[by_name[names[0]].dtype])

    params = {k: spec(k, v, ((len(v),) if k != v[0] else ()) + tuple(by_name[v[0]].shape))
              for k, v in layout.param_groups.items()}
    state = {k: spec(k, v, bind_shape(by_name[v[0]].shape, {"B": blocks * len(v)}))
             for k, v in layout.state_groups.items()}
    pools = {n for v in layout.state_groups.values() for n in v}
    inputs = {x.name: jax.ShapeDtypeStruct(bind_shape(x.shape, env), JNP_DTYPES[x.dtype])
              for x in graph.runtime_inputs if x.name not in pools}
    return params, state, inputs


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.slow
def test_scanned_step_updates_the_flat_pools_in_place(backend):
    """The flat [L * B, ...] pools are donated and aliased; temporaries don't grow with them."""
    temps = []
    for blocks in (64, 1024):
        graph = served_graph(num_kv_blocks=blocks)
        layout = step_layout(graph)
        params, state, inputs = abstract_args(graph, layout, blocks)
        step = jax.jit(build_step(graph, backend, layout=layout), donate_argnums=(1,))
        ma = step.lower(params, state, inputs).compile().memory_analysis()
        pool_bytes = sum(math.prod(s.shape) * 4 for s in state.values())
        assert ma.alias_size_in_bytes >= pool_bytes
        temps.append(ma.temp_size_in_bytes)
    assert temps[0] == temps[1], temps


def test_scanned_pallas_step_lowers_for_cuda():
    graph = served_graph()
    layout = step_layout(graph)
    text = jax.jit(build_step(graph, "pallas", layout=layout), donate_argnums=(1,)).trace(
        *abstract_args(graph, layout, 64)).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" in text
    # One layer body, so one call of the kernel for all layers.
    assert len(re.findall(r"call @paged_attention\b", text)) == 1
    assert "stablehlo.custom_call @__gpu$xla.gpu.triton" in text
