"""Graph -> jitted JAX step function: each IR op lowered to its jnp reference or a Pallas kernel."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ir import OPS, Graph
from ir.layers import Layers, find_layers, matrices_are_blocks
from config.engine_config import target_platform
from config.engine_config import KERNEL_BACKENDS
from ir.attrs import ALL_REDUCE, ANNOTATION_ATTRS, NEW_KV_WRITTEN

JNP_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "i32": jnp.int32,
              "i8": jnp.int8, "u8": jnp.uint8, "bool": jnp.bool_}



def resolve_backend(backend: str, sharded: bool = False) -> str:
    """`auto` means Pallas kernels on GPU; on CPU, our C++ decode kernel if it builds here, else XLA.

    `sharded` (tensor parallelism): the C++ kernel's FFI call has no partitioning rule, so XLA would
    gather whole KV pools onto every device to run it; `auto` takes XLA there and `cpp` is refused."""
    from runtime.worker import cpp_kernels

    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "auto":
        if target_platform() == "gpu":
            return "pallas"
        if target_platform() != "cpu":
            return "xla"
        return "cpp" if not sharded and cpp_kernels.available() else "xla"
    if backend == "cpp":
        if jax.default_backend() != "cpu":
            raise ValueError(f"kernel backend 'cpp' runs on CPU only, not on {jax.default_backend()}")
        if sharded:
            raise ValueError("kernel backend 'cpp' runs without tensor parallelism (its FFI call would "
                             "gather every KV pool onto each device); use 'xla' or 'auto' with "
                             "tensor_parallel_size > 1")
        cpp_kernels.ensure()
    return backend


def scans_layers(engine, sharded: bool = False, graph: Graph | None = None) -> bool:
    """EngineConfig.scans_layers, told whether this CPU's C++ kernels read an f32 layer's weights in
    place in the stack (kernel backend cpp, with the matmul kernels' vector path), and, given the
    step's `graph` as the passes left it, whether its layers' matrices are all GGUF blocks or tiles
    (ir.layers.matrices_are_blocks), which the kernels read in place on any build."""
    from runtime.worker import cpp_kernels

    cpp = resolve_backend(engine.kernel_backend, sharded) == "cpp"
    return engine.scans_layers(f32_in_place=cpp and cpp_kernels.matmul_vectorized(),
                               blocks_in_place=cpp and graph is not None and matrices_are_blocks(graph))


def widens_half_weights(engine) -> bool:
    """Whether the lowerings for `engine` on this machine widen bf16/f16 weights to f32 for their
    products, one weight at a time (XLA:CPU has no half-precision dot: kernels.matmul_xla), which
    the memory plan counts."""
    backend = resolve_backend(engine.kernel_backend, sharded=engine.tensor_parallel_size > 1)
    return target_platform() == "cpu" and backend in ("xla", "cpp")


def reads_gguf_blocks(engine, has_blocks: bool) -> bool:
    """EngineConfig.reads_gguf_blocks, told whether this CPU's C++ kernels have the GGUF blocks'
    vector path (kernel backend cpp; AVX-512BW or AVX2)."""
    from runtime.worker import cpp_kernels

    sharded = engine.tensor_parallel_size > 1
    ready = (has_blocks and not sharded and resolve_backend(engine.kernel_backend) == "cpp"
             and cpp_kernels.blocks_vectorized())
    return engine.reads_gguf_blocks(has_blocks, ready)


def tiles_in_kernel(engine) -> bool:
    """Whether this machine's backend for `engine` multiplies by GGUF tiles in our C++ kernel (cpp,
    with the tiles' vector path for its activations), so that the tiles can stand in for their f32
    weight."""
    from runtime.worker import cpp_kernels

    activations = "q8" if engine.gguf_activations == "q8" else "f32"
    # Every step's product, prefill chunks too (tiles_max_rows: every vector path takes them).
    return (resolve_backend(engine.kernel_backend) == "cpp"
            and cpp_kernels.tiles_max_rows(activations) >= cpp_kernels.EVERY_STEP)


def tile_activations(engine) -> str | None:
    """EngineConfig.gguf_tile_activations, told whether this CPU's C++ kernels have the f32 tiles'
    vector path (kernel backend cpp): AVX-512BW multiply-adds, AMX-BF16 from 16 rows where the CPU
    has it. Both beat the file's rows from one row to 256 (x86-64-v4 without AMX: 1.7x at 16 rows,
    1.46x at 64; docs/cpu.md)."""
    from runtime.worker import cpp_kernels

    f32_tiles = (resolve_backend(engine.kernel_backend) == "cpp" and engine.tensor_parallel_size == 1
                 and cpp_kernels.tiles_vectorized("f32"))
    return engine.gguf_tile_activations(f32_tiles)


def _kernel_impls(backend: str) -> dict[str, Callable]:
    """Overrides of the jnp references for the attention ops, by backend."""
    from runtime.worker import kernels, moe

    return kernels.lowerings(backend) | moe.lowerings(backend)


def _layer_indexed_inputs(backend: str) -> dict[str, tuple[int, ...]]:
    from runtime.worker import kernels

    return kernels.layer_indexed_inputs(backend)


def state_names(graph: Graph) -> tuple[str, ...]:
    """Runtime inputs that the step also returns under the same name (KV caches / pools)."""
    outs = {name for name, _ in graph.outputs}
    return tuple(n.name for n in graph.runtime_inputs if n.name in outs)


@dataclass(frozen=True)
class StepLayout:
    """How a step's weights and KV state are laid out on the device.

    Unrolled (`layers` None): one array per param and per state input, by IR name.
    Scanned: the graph's repeated layers (ir.layers) run as one `lax.scan` over the layer axis,
    so XLA compiles one layer instead of num_layers. Each per-layer weight role is stacked
    [L, ...] under its role name (`layers.*.wqkv`); each per-layer KV pool role is one flat
    array [L * B, block_size, kv_heads, head_dim] (`k_pool.*`): layer i owns blocks
    [i*B, (i+1)*B), and the layer's kv_write / paged_attention see the same pool with their
    block indices offset by i*B, so every write lands in place in the one donated buffer.
    The scan slices each weight stack per layer (XLA copies the slice), except the roles that a
    backend's kernels read in place from the whole stack (kernels.layer_indexed_inputs).
    """

    param_groups: dict[str, tuple[str, ...]]  # device key -> IR param names (stacked if several)
    state_groups: dict[str, tuple[str, ...]]  # device key -> IR state input names (flattened)
    layers: Layers | None = None

    @property
    def num_layers(self) -> int:
        return self.layers.num_layers if self.layers is not None else 1


def step_layout(graph: Graph, scan_layers: bool = True) -> StepLayout:
    """The device layout of `graph`'s step: scanned over layers when the graph allows it."""
    state = set(state_names(graph))
    layers = find_layers(graph) if scan_layers else None
    if layers is not None and not _scannable(graph, layers, state):
        layers = None
    if layers is None:
        return StepLayout({p.name: (p.name,) for p in graph.params},
                          {n: (n,) for n in state_names(graph)})
    per_layer = {id(x) for d in layers.leaves for x in d.values()}
    params = {p.name: (p.name,) for p in graph.params if id(p) not in per_layer}
    states = {}
    for role in layers.roles:
        names = tuple(d[role].name for d in layers.leaves)
        (states if layers.leaves[0][role].op == "input" else params)[role] = names
    return StepLayout(params, states, layers)


def _scannable(graph: Graph, layers: Layers, state: set[str]) -> bool:
    """Per-layer inputs must be KV pools written only by kv_write and read only by
    paged_attention (their indices are what the scan offsets), and updated in place."""
    users = graph.users()
    outputs = {name: node for name, node in graph.outputs}
    for i, leaves in enumerate(layers.leaves):
        for role, leaf in leaves.items():
            if leaf.op != "input":
                continue
            if leaf.name not in state or [u.op for u in users.get(id(leaf), [])] != ["kv_write"]:
                return False
            out = outputs[leaf.name]
            if any(u.op not in ("paged_attention",) for u in users.get(id(out), [])):
                return False
            if out not in layers.layer_nodes[i]:
                return False
    layer_ids = {id(n) for g in layers.layer_nodes for n in g}
    last = id(layers.last_output())
    for name, node in graph.outputs:
        if id(node) in layer_ids and name not in state and id(node) != last:
            return False
    return True


def _index_offset_impls(fns: dict[str, Callable], offset) -> dict[str, Callable]:
    """kv_write / paged_attention over a flat multi-layer pool: this layer's blocks start at `offset`."""
    kv_write, paged = fns["kv_write"], fns["paged_attention"]

    def kv_write_at(pool, new, slots):
        return kv_write(pool, new, jnp.where(slots >= 0, slots + offset * pool.shape[1], slots))

    def paged_at(q, k_pool, v_pool, block_tables, *rest, **attrs):
        return paged(q, k_pool, v_pool, block_tables + offset, *rest, **attrs)

    return {"kv_write": kv_write_at, "paged_attention": paged_at}


def _in_place_roles(graph: Graph, layers: Layers, roles: list[str], indexed: dict[str, tuple[int, ...]]) -> set[str]:
    """The weight roles of a scanned step that every reader takes at one input `indexed` names (op
    name -> input positions), and nowhere else: those readers get the role's whole stack [L, ...]
    and a `layer` attr instead of the scan's slice."""
    users = graph.users()
    out = set()
    for role in roles:
        leaf = layers.leaves[0][role]
        readers = users.get(id(leaf), [])
        if readers and all(n.op in indexed and len(at := [j for j, i in enumerate(n.inputs) if i is leaf]) == 1
                           and at[0] in indexed[n.op] for n in readers):
            out.add(role)
    return out


def build_step(graph: Graph, backend: str = "xla", mesh_constraints: Callable | None = None,
               layout: StepLayout | None = None, per_device: Callable | None = None):
    """Returns `step(params, state, inputs) -> (outputs, new_state)`, not yet jitted.

    params: weights by `layout` key; state: the donated KV buffers by layout key; inputs: the
    other runtime inputs (tokens, positions, block tables...). `mesh_constraints(node, value)`
    may attach sharding constraints (tensor parallelism); `per_device(node, fn)` wraps an op that
    all-reduces its result (the shard pass's `all_reduce`) and has a per-device lowering
    (worker.moe.per_device_lowerings) to run on each device's shards. Default layout: unrolled.
    """
    backend = resolve_backend(backend)
    overrides = _kernel_impls(backend)
    # Whether paged_attention's implementation takes the step's new K/V (kernels.paged_attention_xla).
    new_kv = "k_new" in inspect.signature(overrides.get("paged_attention", OPS["paged_attention"].impl)).parameters
    layout = layout or step_layout(graph, scan_layers=False)
    layers = layout.layers
    state = set(state_names(graph))
    impls = {}
    for node in graph.nodes():
        fn = overrides.get(node.op) or OPS[node.op].impl
        if fn is None:
            raise ValueError(f"op {node.op!r} has no implementation")
        impls[node.op] = fn
    local_impls = {}  # node id -> its per-device implementation
    if per_device is not None:
        from runtime.worker import moe

        on_device = moe.per_device_lowerings(backend)
        local_impls = {id(n): per_device(n, on_device[n.op](n)) for n in graph.nodes()
                       if n.op in on_device and n.attr(ALL_REDUCE) is not None}

    def run(nodes, env, fns, extra_attrs=None):
        for node in nodes:
            # Annotations (sharding, which steers mesh_constraints; paged_attention's new_kv_written)
            # are not op semantics: the op's implementation never sees them.
            attrs = {k: v for k, v in node.attrs if k not in ANNOTATION_ATTRS}
            if extra_attrs and id(node) in extra_attrs:
                attrs.update(extra_attrs[id(node)])
            if new_kv and node.op == "paged_attention" and node.attr(NEW_KV_WRITTEN):
                # The pools arrive written by this step's kv_write nodes; their new K/V go to the
                # lowering too, so a prefill attends over its own tokens without reading them back.
                attrs["k_new"], attrs["v_new"] = (env[id(w.inputs[1])] for w in node.inputs[1:3])
            fn = local_impls.get(id(node)) or fns[node.op]
            val = fn(*(env[id(i)] for i in node.inputs), **attrs)
            if mesh_constraints is not None:
                val = mesh_constraints(node, val)
            env[id(node)] = val

    def outputs(env):
        # Logits and hidden states leave the step in f32 whatever the model's dtype: the sampler,
        # logprobs and prompt logprobs work in f32 (a bf16 softmax over 49k entries loses digits).
        return {name: _f32(env[id(node)]) for name, node in graph.outputs if name not in state}

    if layers is None:
        def step(params: dict[str, Any], kv_state: dict[str, Any], inputs: dict[str, Any]):
            env: dict[int, Any] = {}
            for leaf in graph.inputs:
                src = params if leaf.op == "param" else (kv_state if leaf.name in state else inputs)
                env[id(leaf)] = src[leaf.name]
            run(graph.nodes(), env, impls)
            new_state = {name: env[id(node)] for name, node in graph.outputs if name in state}
            return outputs(env), new_state

        return step

    template_leaves = layers.leaves[0]
    state_out = {}  # state role -> position in the template of its updated value
    out_by_name = dict(graph.outputs)
    template_pos = {id(n): j for j, n in enumerate(layers.template)}
    for role in layout.state_groups:
        state_out[role] = template_pos[id(out_by_name[template_leaves[role].name])]
    param_roles = [r for r in layout.param_groups if r in template_leaves]
    # Weight roles whose every reader takes the whole stack and a layer index (a kernel reading the
    # layer where it lies); the scan slices the others, and XLA copies each slice out of its stack.
    in_place = _in_place_roles(graph, layers, param_roles, _layer_indexed_inputs(backend))
    in_place_ids = {id(template_leaves[r]) for r in in_place}
    in_place_readers = [n for n in layers.template if any(id(i) in in_place_ids for i in n.inputs)]

    def step(params: dict[str, Any], kv_state: dict[str, Any], inputs: dict[str, Any]):
        env: dict[int, Any] = {}
        for leaf in graph.inputs:
            if leaf.op == "param" and leaf.name in params:
                env[id(leaf)] = params[leaf.name]
            elif leaf.op == "input" and leaf.name in inputs:
                env[id(leaf)] = inputs[leaf.name]
        run(layers.pre, env, impls)
        blocks_per_layer = next(iter(kv_state.values())).shape[0] // layers.num_layers

        def body(carry, weights):
            h, i, pools = carry
            local = dict(env)
            local[id(layers.carry_in)] = h
            for role in param_roles:
                local[id(template_leaves[role])] = params[role] if role in in_place else weights[role]
            for role, pool in pools.items():
                local[id(template_leaves[role])] = pool
            run(layers.template, local, impls | _index_offset_impls(impls, i * blocks_per_layer),
                {id(n): {"layer": i} for n in in_place_readers})
            new_pools = {role: local[id(layers.template[j])] for role, j in state_out.items()}
            return (local[id(layers.template[layers.carry_out])], i + 1, new_pools), None

        init = (env[id(layers.carry_in)], jnp.int32(0), dict(kv_state))
        (h, _, new_state), _ = jax.lax.scan(body, init, {r: params[r] for r in param_roles if r not in in_place},
                                            length=layers.num_layers)
        env[id(layers.last_output())] = h
        run(layers.post, env, impls)
        return outputs(env), new_state

    return step


def _f32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def jit_step(graph: Graph, backend: str = "xla", **jit_kwargs):
    """Jitted step; the KV state argument is donated so cache updates happen in place."""
    return jax.jit(build_step(graph, backend), donate_argnums=(1,), **jit_kwargs)


def to_device_params(graph: Graph, weights: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Puts the weights a graph's params name on device, in each param's declared dtype."""
    out = {}
    for p in graph.params:
        if p.name not in weights:
            raise KeyError(f"weights have no tensor for param %{p.name}")
        w = weights[p.name]
        if tuple(w.shape) != tuple(p.shape):
            raise ValueError(f"weight {p.name}: shape {tuple(w.shape)} != param shape {tuple(p.shape)}")
        out[p.name] = jnp.asarray(w, dtype=JNP_DTYPES[p.dtype])
    return out
