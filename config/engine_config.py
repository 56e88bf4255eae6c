"""Engine arguments, with vLLM's names (`config.engine_config` re-exports them).

They live in models, below runtime, because the command-line layer (config.flags) builds its engine
flags from them, and `ir.dump` uses that layer while the layering lets it import only models and passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, fields

log = logging.getLogger(__name__)

DTYPE_ALIASES = {"float32": "f32", "fp32": "f32", "f32": "f32", "bfloat16": "bf16", "bf16": "bf16",
                 "float16": "f16", "half": "f16", "f16": "f16"}
# `auto` (vLLM's default) takes the model's dtype where the hardware runs it well: bf16 on
# accelerators; f32 on CPU, where XLA's bf16 matmuls are emulated and slower than f32.
AUTO_DTYPE = {"gpu": "bf16", "cuda": "bf16", "rocm": "bf16", "tpu": "bf16"}


PLATFORMS = ("cpu", "gpu", "tpu")
_planned_platform: str | None = None  # set by planning_for


def target_platform() -> str:
    """The platform whose lowerings a plan is made for: this machine's JAX backend, unless a dry
    run plans for another one (`planning_for`)."""
    if _planned_platform is not None:
        return _planned_platform
    import jax

    return jax.default_backend()


@contextlib.contextmanager
def planning_for(platform: str | None):
    """Within it, plans (dtype auto, scanned layers, kernel backend, the memory model) are made as
    on `platform` (None: this machine): `jaxserve compile --dry-run --platform gpu` on a laptop."""
    global _planned_platform
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {', '.join(PLATFORMS)}, got {platform!r}")
    before, _planned_platform = _planned_platform, platform if platform is not None else _planned_platform
    try:
        yield
    finally:
        _planned_platform = before


def resolve_dtype(dtype: str, platform: str | None = None) -> str:
    """An IR dtype name (f32/bf16/f16) for a user's dtype; `auto` depends on the platform."""
    name = str(dtype).lower()
    if name == "auto":
        return AUTO_DTYPE.get(platform or target_platform(), "f32")
    if name not in DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of {['auto'] + sorted(DTYPE_ALIASES)}, got {dtype!r}")
    return DTYPE_ALIASES[name]

# auto: Pallas on GPU; on CPU, cpp (the XLA lowerings with decode attention in our C++ kernel,
# runtime.worker.cpp_kernels) where a C++ compiler can build it, else xla (XLA lowerings only).
KERNEL_BACKENDS = ("auto", "xla", "cpp", "pallas", "interpret")
MATMUL_PRECISIONS = ("float32", "bfloat16")  # of an f32 plan's matmuls (EngineConfig.matmul_precision)
# vLLM's --kv-cache-dtype names that we run: auto is the model's dtype. (vLLM's fp8 ones are not built.)
KV_CACHE_DTYPES = ("auto", "bfloat16")
GGUF_ACTIVATIONS = ("f32", "q8")  # of the products on GGUF blocks (EngineConfig.gguf_activations)
# Weight quantization (passes.quantize_int8): int8 weight-only, or W8A8 (int8 weights, and each
# step's activations quantized per row to int8 at run time: an int8 x int8 product).
QUANTIZATIONS = (None, "int8", "w8a8")

# On a CPU the budget is the host memory available at start (config.host_memory); where that
# cannot be read (not Linux), this fixed budget. `device_memory` overrides both.
CPU_DEVICE_MEMORY = 4 << 30
# On a CPU the KV pool holds what the configuration can use, as llama.cpp's `-c` sizes its cache,
# not all the memory the budget leaves: max_num_seqs sequences at max_model_len, and room for a
# quarter more (at least one) whose blocks the prefix cache keeps after their requests finish, so
# a full batch can run while recent prefixes stay cached (EngineConfig.kv_blocks_used).
PREFIX_CACHE_ROOM = 0.25


MAX_NUM_SPECULATIVE_TOKENS = 16  # every step verifies k+1 positions per row; more is rarely accepted
MAX_PROMPT_LOOKUP = 64  # the n-gram search costs O(sequence length x n) per row per step
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither bound is given
SUPPORTED_METHODS = ("ngram",)
PLANNED_METHODS = ("draft_model",)  # a small model of the same vocabulary proposes; its q_probs feed the sampler


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (`--speculative-config '{"method": "ngram", ...}'`).

    method: how drafts are proposed; "ngram" (prompt lookup) is the one supported now.
    num_speculative_tokens: k, the drafts proposed and verified per row per step (1..16).
    prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix n-gram searched for. As
    in vLLM: both unset -> 5 and 5; one unset -> it takes the other's value.

    Constructing one validates every field; `from_dict` also rejects unknown keys.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self):
        m = self.method
        if not isinstance(m, str):
            _bad("method", f"must be a string, got {m!r}")
        if m not in SUPPORTED_METHODS:
            planned = f" ({m!r} is planned)" if m in PLANNED_METHODS else ""
            _bad("method", f"{m!r} is not supported{planned}; supported: {', '.join(map(repr, SUPPORTED_METHODS))}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if value is not None:
                _check_int(name, value, 1, MAX_PROMPT_LOOKUP)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            _bad("prompt_lookup_min", f"{lo} must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, d: "dict | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """From a dict or a JSON object string (the CLI's form); None (or "") means no speculation."""
        if d is None or isinstance(d, cls):
            return d
        if isinstance(d, str):
            if not d.strip():
                return None
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config: must be a JSON object, got {type(d).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in d:
                _bad(required, "is required")
        return cls(**d)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _bad(name: str, why: str):
    raise ValueError(f"speculative_config.{name}: {why}")


def _check_int(name: str, v, lo: int, hi: int):
    if isinstance(v, bool) or not isinstance(v, int):
        _bad(name, f"must be an integer, got {v!r}")
    if not lo <= v <= hi:
        _bad(name, f"must be in [{lo}, {hi}], got {v}")


@dataclass
class EngineConfig:
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 32
    memory_utilization: float = 0.9
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    max_waiting_ms: float = 50.0
    static_batch_size: int | None = None
    tensor_parallel_size: int = 1
    # Mixture-of-experts models under tensor parallelism: split the experts among the devices (each
    # holds E / tp whole experts) rather than each expert's intermediate dim (passes/shard.py).
    enable_expert_parallel: bool = False
    quantization: str | None = None
    # The LM head under `quantization`: True puts it in int8 too (a tied head from an int8 copy of
    # the transposed embedding), False keeps it in the model's dtype. None: w8a8 quantizes it;
    # int8 quantizes an untied head and keeps a tied one (its copy would add weight memory).
    quantize_lm_head: bool | None = None
    # "bfloat16": f32 weights gain a bf16 copy, and steps of at least 4 rows multiply in bf16 with
    # f32 accumulation (2-3x XLA:CPU's f32 GEMM rate on CPUs with bf16 units); narrower steps, and
    # everything but the matmuls, stay f32. Weight memory grows by half (passes/bf16_matmuls.py).
    matmul_precision: str = "float32"
    # Decode steps (up to 64 rows) read a GGUF model's weights from the file's own quantization
    # blocks (Q4_0, Q4_1, Q8_0) in our C++ kernel, widened to f32 in registers: the same values
    # from a fifth of f32's bytes; wider steps keep the f32 weights (passes/gguf_blocks.py). Weight
    # memory grows by the blocks' bytes. None: on, where the weights have blocks and the kernel
    # its vector path, for f32 engines with f32 matmuls and no quantization or tensor parallelism.
    # With gguf_tiles (below) every step reads them, repacked into tiles.
    gguf_blocks: bool | None = None
    # "q8": the products on GGUF blocks multiply in int8, as llama.cpp does: each step's activations
    # rounded per block of 32 to 8 bits, the blocks repacked into tiles of 16 columns, for every
    # step (prefill chunks too). Against the f32 blocks' products on CPUs with AVX-512 VNNI (AMX
    # from 32 rows): 1.1x at one row, 1.4x at 8, 2.8x at 64, 4x at 512; the activations' rounding
    # moves logits by about 1e-2. "f32" (default): the activations stay f32 (passes/gguf_blocks.py).
    gguf_activations: str = "f32"
    # The GGUF blocks repacked into tiles of 16 columns (ir.blocks.pack_tiles), which every step
    # reads. None: with q8, and with f32 activations where the C++ kernels have the f32 tiles'
    # vector path: on AMX-BF16 from 16 rows (three exact bf16 parts of each activation: the f32
    # product, up to the order of its sums; against the file's rows 1.2x at one row, 2.3x at 64,
    # 3.1x at 512: 2.2x XLA's f32 GEMM), else AVX-512BW multiply-adds (x86-64-v4 without AMX:
    # 1.04x the rows at one row, 1.7x at 16, 1.46x at 64, XLA's f32 GEMM's rate at 256), or AVX2
    # with FMA (x86-64-v3; docs/cpu.md). False keeps the file's rows (decode steps only; wider
    # steps multiply by the f32 weights).
    gguf_tiles: bool | None = None
    # vLLM's --kv-cache-dtype. "bfloat16": K/V stored in bf16 (half the bytes of f32: twice the KV
    # blocks, and half the bytes a decode step's attention reads); attention still computes in f32.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    num_kv_blocks: int | None = None
    device_memory: int | None = None  # bytes of one device; measured on GPU; on CPU, the host's available memory / tensor_parallel_size
    # vLLM's kv_cache_memory_bytes: the KV pool's bytes per device, fixed (num_kv_blocks still wins).
    # None: on GPU what the budget leaves; on CPU VLLM_CPU_KVCACHE_SPACE, else what the
    # configuration can use (kv_blocks_used), capped by what the budget leaves.
    kv_cache_memory_bytes: int | None = None
    memory_limit: int | None = None  # bytes the allocator can still give; measured on GPU
    kernel_backend: str = "auto"
    # Run the repeated decoder layers as one lax.scan, so XLA compiles one layer, not all of them
    # (3x faster cold compiles, 2.5x faster warm starts). None: on accelerators; on CPU, where the
    # C++ kernels read each layer's weights in the stack where they lie for a decode step's few
    # rows: under weight-only int8 (unrolled, XLA:CPU also widened every layer's int8 weights to
    # f32 at once for a prefill's products: 410 MiB of temps for SmolLM2, which failed the memory
    # check at start-up), and for f32 weights and matmuls where the f32 kernel has its vector path
    # (see scans_layers). Elsewhere on CPU, XLA copies each layer's weight slice out of the stack
    # before every product, which costs more per step than the compile saves (f32 batch-1 decode
    # ran at half speed; docs/benchmarks/, "Scan over layers").
    scan_layers: bool | None = None
    # vLLM's multi-step decode: an all-decode batch runs this many steps in one executable, the
    # host checking stops after them (amortizes the host's share of a step; 1 = off).
    num_scheduler_steps: int = 1
    # vLLM's speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 4}: drafts are
    # verified in the decode buckets (runtime/engine/step_inputs.py). A dict or JSON string; None = off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's async scheduling: the host schedules and prepares step N+1 while step N runs, decode
    # rows taking their input token from step N's sampled output on the device, and finishes
    # step N (stops, detokenization, streaming) after N+1 is dispatched. None: on accelerators,
    # where it applies (not with multi-step decode, speculative decoding or tensor parallelism);
    # off on CPU, where the host's work shares the cores with the step's and hides nothing.
    async_scheduling: bool | None = None
    reserve_bytes: int = 64 << 20

    def __post_init__(self):
        self.dtype = resolve_dtype(self.dtype)
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        for f in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                  "tensor_parallel_size", "num_scheduler_steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be a bool or None (auto), got {self.async_scheduling!r}")
        if self.async_scheduling and self.async_blockers():
            raise ValueError(f"async_scheduling does not combine with {' or '.join(self.async_blockers())}")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory_bytes is not None and (
                isinstance(self.kv_cache_memory_bytes, bool) or not isinstance(self.kv_cache_memory_bytes, int)
                or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive int, got {self.kv_cache_memory_bytes!r}")
        if self.scheduling not in ("continuous", "dynamic", "static"):
            raise ValueError(f"scheduling must be continuous, dynamic or static, got {self.scheduling!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                             f"got {self.quantization!r}")
        if self.quantize_lm_head not in (None, True, False):
            raise ValueError(f"quantize_lm_head must be a bool or None (auto), got {self.quantize_lm_head!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization (int8 or w8a8): the head is quantized "
                             "with the other weights")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                             f"got {self.matmul_precision!r}")
        if self.gguf_blocks not in (None, True, False):
            raise ValueError(f"gguf_blocks must be a bool or None (auto), got {self.gguf_blocks!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}, "
                             f"got {self.gguf_activations!r}")
        if self.gguf_tiles not in (None, True, False):
            raise ValueError(f"gguf_tiles must be a bool or None (auto), got {self.gguf_tiles!r}")
        if self.gguf_activations == "q8" and self.gguf_tiles is False:
            raise ValueError("gguf_activations q8 multiplies by the GGUF tiles: it needs gguf_tiles on (or auto)")
        if self.gguf_tiles and self.gguf_blocks is False:
            raise ValueError("gguf_tiles repacks the GGUF blocks: it needs gguf_blocks on (or auto)")
        if self.gguf_activations == "q8" and self.gguf_blocks is False:
            raise ValueError("gguf_activations q8 multiplies by the GGUF blocks: it needs gguf_blocks on (or auto)")
        if (self.gguf_blocks or self.gguf_tiles or self.gguf_activations == "q8") and self.gguf_blocks_blockers():
            raise ValueError(f"gguf_blocks does not combine with {' or '.join(self.gguf_blocks_blockers())}: "
                             "its products take the f32 weights' blocks and f32 activations (rounded to "
                             "8 bits under gguf_activations q8)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
                             f"got {self.kernel_backend!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a whole prompt must fit one step.
            log.warning("max_num_batched_tokens %d raised to max_model_len %d: without chunked prefill "
                        "a whole prompt must fit one step", self.max_num_batched_tokens, self.max_model_len)
            self.max_num_batched_tokens = self.max_model_len
        if self.max_num_seqs > self.max_num_batched_tokens:
            log.warning("max_num_seqs %d lowered to max_num_batched_tokens %d: each sequence in a step "
                        "takes at least one token", self.max_num_seqs, self.max_num_batched_tokens)
            self.max_num_seqs = self.max_num_batched_tokens

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        if "gpu_memory_utilization" in kw:
            kw["memory_utilization"] = kw.pop("gpu_memory_utilization")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kw) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(names)}")
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def kv_blocks_used(self) -> int:
        """The most full-group KV blocks this configuration can use: max_num_seqs sequences at
        max_model_len and PREFIX_CACHE_ROOM more for the prefix cache (a window group's blocks
        follow from them: ir.kv_groups.window_blocks_for)."""
        seqs = self.max_num_seqs + max(math.ceil(self.max_num_seqs * PREFIX_CACHE_ROOM), 1)
        return seqs * -(-self.max_model_len // self.block_size)

    def kv_dtype(self) -> str:
        """The KV pools' IR dtype: the model's (`auto`) or kv_cache_dtype's."""
        return self.dtype if self.kv_cache_dtype == "auto" else resolve_dtype(self.kv_cache_dtype)

    @property
    def max_step_rows(self) -> int:
        """Sampler rows (and attention sequences) one step may hold, the bucket table's widest:
        max_num_seqs, and with speculation at least k+1, since a sequence verifying k drafts takes
        k+1 rows (runtime/engine/step_inputs.py) and a lone one must fit a whole draft. Drafts take the rows
        a step's decodes leave free: sizing the table for every sequence's drafts (max_num_seqs x
        (k+1)) added 6 buckets to compile for 16 sequences and no speed that 15 alternating rounds
        on 16 mixed prompts could tell apart
        (docs/benchmarks/2026-12-06-ngram-speculation-and-json-that-closes.md). Never more than the
        step's tokens."""
        k = self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0
        return min(max(self.max_num_seqs, 1 + k), self.max_num_batched_tokens)

    def async_blockers(self) -> list[str]:
        """The settings that rule out async scheduling: multi-step decode and speculative decoding
        already take the host off the per-token path, and tensor parallelism is not wired for it."""
        return [name for name, on in (("num_scheduler_steps > 1", self.num_scheduler_steps > 1),
                                      ("speculative_config", self.speculative_config is not None),
                                      ("tensor_parallel_size > 1", self.tensor_parallel_size > 1)) if on]

    def schedules_async(self, platform: str | None = None) -> bool:
        """Whether the engine overlaps the host with the device (`async_scheduling`, or by platform)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if platform is None:
            import jax

            platform = jax.default_backend()
        return platform != "cpu" and not self.async_blockers()

    def gguf_blocks_blockers(self) -> list[str]:
        """The settings that rule out reading GGUF blocks in decode steps."""
        return [name for name, on in (("quantization", self.quantization is not None),
                                      ("matmul_precision bfloat16", self.matmul_precision != "float32"),
                                      (f"dtype {self.dtype}", self.dtype != "f32"),
                                      ("tensor_parallel_size > 1", self.tensor_parallel_size > 1)) if on]

    def reads_gguf_blocks(self, has_blocks: bool, kernel_ready: bool) -> bool:
        """Whether decode steps read GGUF blocks (`gguf_blocks`, or by what is there): `has_blocks`,
        whether the weights came with them; `kernel_ready`, whether this machine's C++ kernel has
        its vector path (the runtime knows: runtime.worker.executor.reads_gguf_blocks)."""
        if self.gguf_blocks is False:
            return False
        wanted = bool(self.gguf_blocks) or bool(self.gguf_tiles) or self.gguf_activations == "q8"
        if wanted and not has_blocks:
            raise ValueError("gguf_blocks: the weights have no GGUF blocks to read (a .gguf model whose "
                             "matrices are Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K or Q6_K)")
        return has_blocks and (wanted or (kernel_ready and not self.gguf_blocks_blockers()))

    def gguf_tile_activations(self, f32_tiles: bool) -> str | None:
        """The activations of the products on GGUF tiles ("q8" or "f32"), or None where the blocks
        stay in the file's rows; `f32_tiles`, whether this machine's C++ kernels multiply f32
        activations by tiles in a vector path (AVX-512BW or AVX2 with FMA; AMX-BF16 where the CPU has it: the
        runtime knows, runtime.worker.executor), which the default then takes."""
        if self.gguf_activations == "q8":
            return "q8"
        return "f32" if self.gguf_tiles or (self.gguf_tiles is None and f32_tiles) else None

    def scans_layers(self, platform: str | None = None, f32_in_place: bool = False,
                     blocks_in_place: bool = False) -> bool:
        """Whether the step runs its layers as a lax.scan (`scan_layers`, or by platform).

        `f32_in_place`: whether this CPU's kernels read a few rows' f32 products from the stack in
        place (the runtime knows: runtime.worker.executor.scans_layers). Then an f32 engine with
        f32 matmuls scans on CPU too; only its wide steps' products (prefill, 16+ decode rows) copy
        a layer's slice, where the product itself takes far longer than the copy.
        `blocks_in_place`: whether every layer's weight matrices are GGUF tiles that our kernels
        read in place for every step (ir.layers.matrices_are_blocks, under the cpp backend). Then
        the f32 engine scans without any f32 kernel: AVX2 (x86-64-v3), where a batch-1 step's
        dispatch took 0.44-0.48 against 1.3-1.8 ms unrolled (one argument per layer's weight).

        Under tensor parallelism (`tensor_parallel_size > 1`) the step scans on CPU too. Unrolled,
        its XLA lowering compiles every layer's fusions (2,700 for one SmolLM2 prefill bucket), and
        XLA:CPU keeps 100-190 MiB resident per such executable: tp=3 served at 1.73x tp=1's memory
        and took 15 minutes to start. Scanned, it serves at 0.98x and starts in 4
        (docs/benchmarks/2026-12-06-memory-plan-predicted-vs-measured.md). The slices' copies cost decode speed,
        and forced host devices are for testing a sharded plan, not for speed."""
        if self.scan_layers is not None:
            return self.scan_layers
        platform = platform or target_platform()
        f32 = self.quantization is None and self.matmul_precision == "float32" and self.dtype == "f32"
        return (platform != "cpu" or self.tensor_parallel_size > 1 or self.quantization == "int8"
                or (f32 and (f32_in_place or blocks_in_place)))
