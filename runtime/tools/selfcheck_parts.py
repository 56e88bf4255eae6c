"""The five parts of `python -m runtime.selfcheck` (see runtime/tools/selfcheck.py, which runs each in its own
subprocess): devices, kernels, tiny, throughput and bench. Each returns (ok, summary, data)."""

from __future__ import annotations
import collections
import dataclasses
import subprocess
import time

# Inside the bench part's timeout (runtime/tools/selfcheck.py TIMEOUTS), with room for start-up, the ceilings and
# one row's overrun. The quick run's four cases take 16 s on an idle 2-core CPU and over 28 s on a loaded one.
BENCH_MAX_SECONDS = {False: 85.0, True: 40.0}


# ----------------------------------------------------------------------------- helpers


def _print_rows(rows: list[tuple], out=print) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        out("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            out("  ".join("-" * w for w in widths))


def _short(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:160] if lines else ''}"


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


# ----------------------------------------------------------------------------- part: devices


def part_devices(args) -> tuple[bool, str, dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    print(jax.print_environment_info(return_string=True).strip())
    backend = jax.default_backend()
    devices = jax.devices()
    rows = [("id", "platform", "kind", "memory GiB")]
    for d in devices:
        try:
            limit = (d.memory_stats() or {}).get("bytes_limit")
        except Exception:  # noqa: BLE001 (CPU devices have no memory stats)
            limit = None
        rows.append((d.id, d.platform, d.device_kind, "-" if limit is None else f"{limit / 2**30:.1f}"))
    _print_rows(rows)
    problems = []
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 128, 128)).astype(np.float32)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    for d in devices:
        got = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))(
            jax.device_put(a, d), jax.device_put(b, d))
        err = float(np.max(np.abs(np.asarray(got, np.float64) - expected)))
        print(f"device {d.id}: 128x128 f32 matmul, max|diff| vs numpy {err:.2e}")
        if not err < 1e-3:
            problems.append(f"device {d.id} matmul off by {err:.2e}")
    if args.expect_backend and backend != args.expect_backend:
        problems.append(f"backend is {backend}, expected {args.expect_backend}")
    elif not args.expect_backend and backend == "cpu" and _nvidia_smi_sees_gpus():
        problems.append("nvidia-smi lists GPUs but JAX runs on cpu (is the CUDA plugin installed? "
                        "pass --expect-backend cpu if this is meant)")
    kind = devices[0].device_kind
    summary = f"{backend}: {len(devices)} x {kind}, jax {jax.__version__}"
    if problems:
        summary += "; " + "; ".join(problems)
    return not problems, summary, {"backend": backend, "device_kind": kind,
                                   "num_devices": len(devices), "jax": jax.__version__}


def _nvidia_smi_sees_gpus() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


# ----------------------------------------------------------------------------- part: kernels


def _flash_case(lens, pad, num_q_heads, num_kv_heads, head_dim):
    def run(dtype, interpret):
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels import flash_attention, flash_attention_reference
        from pallas_kernels.testing import cu_from_lens

        rng = np.random.default_rng(0)
        n = sum(lens) + pad
        q = jnp.asarray(rng.standard_normal((n, num_q_heads, head_dim)), dtype)
        k, v = (jnp.asarray(rng.standard_normal((n, num_kv_heads, head_dim)), dtype) for _ in "kv")
        cu = jnp.asarray(cu_from_lens(lens))
        out = flash_attention(q, k, v, cu, interpret=interpret)
        return out, flash_attention_reference(q, k, v, cu), sum(lens)

    name = f"flash_attention lens={list(lens)}+{pad} pad, H={num_q_heads}/{num_kv_heads} D={head_dim}"
    return name, run


def _paged_case(context_lens, q_lens, pad, num_q_heads, num_kv_heads, head_dim):
    """q_lens None: decode (one query per sequence); else chunked prefill over cached context."""
    def run(dtype, interpret):
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels import paged_attention, paged_attention_reference
        from pallas_kernels.testing import cu_from_lens, random_paged_cache

        rng = np.random.default_rng(1)
        # Poisoned: unused blocks and slots hold nan / 1e30, so a stray read shows.
        k_cache, v_cache, tables, ctx = random_paged_cache(
            rng, context_lens, block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=dtype)
        cu = None if q_lens is None else jnp.asarray(cu_from_lens(q_lens))
        n = len(context_lens) if q_lens is None else sum(q_lens) + pad
        q = jnp.asarray(rng.standard_normal((n, num_q_heads, head_dim)), dtype)
        args = (q, k_cache, v_cache, tables, ctx, cu)
        out = paged_attention(*args, interpret=interpret)
        return out, paged_attention_reference(*args), n - (0 if q_lens is None else pad)

    what = "decode" if q_lens is None else f"chunks q={list(q_lens)}+{pad} pad"
    name = (f"paged_attention {what}, ctx={_brief(context_lens)}, H={num_q_heads}/{num_kv_heads} "
            f"D={head_dim}")
    return name, run


def _gmm_case(group_sizes, pad, k, n):
    """The grouped matmul of a mixture-of-experts layer: rows sorted by expert, `pad` rows past
    the groups (a bucket's padding), which must come out as zeros."""
    def run(dtype, interpret):
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels import grouped_matmul, grouped_matmul_reference

        rng = np.random.default_rng(3)
        rows = sum(group_sizes) + pad
        # Unit-scale outputs, as the attention cases have: the tolerances are set for those.
        lhs = jnp.asarray(rng.standard_normal((rows, k)) / np.sqrt(k), dtype)
        rhs = jnp.asarray(rng.standard_normal((len(group_sizes), k, n)), dtype)
        sizes = jnp.asarray(group_sizes, jnp.int32)
        out = grouped_matmul(lhs, rhs, sizes, interpret=interpret)
        return out, grouped_matmul_reference(lhs, rhs, sizes), sum(group_sizes)

    empty = sum(1 for g in group_sizes if g == 0)
    name = (f"grouped_matmul {len(group_sizes)} groups of {min(group_sizes)}..{max(group_sizes)} rows "
            f"({empty} empty)+{pad} pad, K={k} N={n}")
    return name, run


def _brief(values) -> str:
    values = list(values)
    return str(values) if len(values) <= 5 else f"{len(values)} seqs {min(values)}..{max(values)}"


def kernel_cases(large: bool):
    """SmolLM2's heads (9/3, D=64) always; on a GPU also Llama-8B's (32/8, D=128) at length. The
    grouped matmul: a few small ragged groups; on a GPU Qwen3-MoE's expert products (64 experts,
    hidden 2048, intermediate 768) at a 64-token top-4 decode step and a 512-token prefill."""
    if not large:
        return [_flash_case([1, 17, 64, 129], 7, 9, 3, 64),
                _paged_case([1, 16, 100, 257], None, 0, 9, 3, 64),
                _paged_case([21, 40, 100], [1, 7, 33], 5, 9, 3, 64),
                _gmm_case([0, 5, 17, 0, 9, 3], 6, 64, 96)]
    import numpy as np

    rng = np.random.default_rng(2)
    ctx = rng.integers(1, 4097, 64).tolist()
    decode = np.bincount(rng.integers(0, 64, 64 * 4), minlength=64).tolist()
    prefill = np.bincount(rng.integers(0, 64, 512 * 4), minlength=64).tolist()
    return [_flash_case([1, 100, 513, 1023, 2048], 13, 9, 3, 64),
            _flash_case([3, 700, 2048], 5, 32, 8, 128),
            _paged_case(ctx, None, 0, 9, 3, 64),
            _paged_case(ctx[:16], None, 0, 32, 8, 128),  # 16 seqs: host draws of the cache add up
            # The reference gathers [tokens, context, heads, dim] in f32: keep tokens x context small.
            _paged_case([21, 40, 600, 1000], [1, 7, 100, 300], 11, 32, 8, 128),
            _gmm_case(decode, 0, 2048, 1536),  # gate/up
            _gmm_case(prefill, 5, 768, 2048)]  # down


def part_kernels(args) -> tuple[bool, str, dict]:
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.testing import tolerance

    interpret = not _on_gpu()
    large = not interpret and not args.quick
    print(f"mode: {'interpret (CPU)' if interpret else 'compiled'}; tolerances by dtype from "
          "pallas_kernels.testing; f32 at matmul precision 'highest'")
    rows = [("kernel case", "dtype", "status", "max|diff|", "s (compile+run)")]
    results = []
    for name, run in kernel_cases(large):
        for dtype in (jnp.float32, jnp.bfloat16):
            t0 = time.perf_counter()
            problem, diff = None, float("nan")
            # On a GPU, f32 dots default to TF32 (Triton's and XLA's alike), ~1e-3 off the f32
            # reference; the f32 tolerance is for the algorithm, so f32 rows run at full precision.
            precision = (jax.default_matmul_precision("highest") if dtype == jnp.float32
                         else contextlib.nullcontext())
            try:
                with precision:
                    out, ref, num_valid = run(dtype, interpret)
                out = np.asarray(out.astype(jnp.float32))
                ref = np.asarray(ref.astype(jnp.float32))
                diff = float(np.max(np.abs(out[:num_valid] - ref[:num_valid])))
                if out.shape != ref.shape:
                    problem = f"shape {out.shape} != {ref.shape}"
                elif not np.isfinite(out).all():
                    problem = "non-finite output"
                elif not np.allclose(out[:num_valid], ref[:num_valid], **tolerance(dtype)):
                    problem = f"outside tolerance {tolerance(dtype)}"
                elif np.any(out[num_valid:] != 0.0):
                    problem = "padding rows are not zero"
            except Exception as err:  # noqa: BLE001 (report the row, check the rest)
                problem = _short(err)
            seconds = time.perf_counter() - t0
            dname = jnp.dtype(dtype).name
            rows.append((name, dname, "PASS" if problem is None else f"FAIL {problem}",
                         f"{diff:.2e}", f"{seconds:.1f}"))
            results.append({"case": name, "dtype": dname, "ok": problem is None,
                            "max_abs_diff": diff, "problem": problem, "seconds": seconds})
            print(f"  {name} {dname}: {'PASS' if problem is None else 'FAIL ' + problem}", flush=True)
    _print_rows(rows)
    failed = [r for r in results if not r["ok"]]
    worst = max(results, key=lambda r: r["max_abs_diff"] if r["ok"] else -1.0)
    summary = f"{len(results) - len(failed)}/{len(results)} within tolerance"
    if failed:
        summary += "; failed: " + ", ".join(f"{r['case'].split(',')[0]} {r['dtype']}" for r in failed)
    else:
        summary += f" (largest diff {worst['max_abs_diff']:.1e}, {worst['dtype']})"
    return not failed, summary, {"interpret": interpret, "rows": results}


# ----------------------------------------------------------------------------- parts: tiny, throughput


def build_llm(cfg, weights, *, backend: str, dtype: str, buckets=None, warm_execute: bool = False,
              **engine_args):
    """A compiled LLM over in-memory random weights (no GGUF, no tokenizer).

    warm_execute: also run every bucket once at start, as the server does, so that no bucket's
    slow first execution lands inside a timed run.
    """
    from runtime.engine.plan import compile_plan
    from config.engine_config import EngineConfig
    from runtime.entrypoints.llm import LLM

    engine = EngineConfig(kernel_backend=backend, dtype=dtype, **engine_args)
    plan = compile_plan(None, engine, weights=weights, config=cfg)
    if buckets is not None:
        # A subset of the default table: the memory plan, made for the superset, still holds.
        plan = dataclasses.replace(plan, buckets=buckets)
    return LLM.from_plan(plan, warm_execute=warm_execute)


def _greedy(max_tokens: int):
    from runtime.core.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def _random_prompts(num: int, lengths, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(lengths[i % len(lengths)])).tolist() for i in range(num)]


# Greedy runs of two correct backends may split where two tokens tie to within rounding; a split
# counts as a near tie only if each run's token is in the other's top logprobs and the two differ
# by at most this much in both runs. TF32 (GPU f32 matmuls) keeps 10 mantissa bits, bf16 8.
NEAR_TIE_LOGPROB = {"f32": 1e-2, "bf16": 1e-1}
TINY_LOGPROBS = 5


def compare_greedy(a, b, tol: float) -> tuple[str, str]:
    """('equal' | 'near tie' | 'differ', where) for two greedy outputs with top logprobs."""
    if a.token_ids == b.token_ids:
        return "equal", "-"
    j = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
             min(len(a.token_ids), len(b.token_ids)))
    where = f"token {j}"
    if j >= min(len(a.token_ids), len(b.token_ids)):
        return "differ", where + " (lengths differ)"
    ta, tb, la, lb = a.token_ids[j], b.token_ids[j], a.logprobs[j], b.logprobs[j]
    if tb not in la or ta not in lb:
        return "differ", f"{where}: {ta} vs {tb}, not in each other's top {TINY_LOGPROBS}"
    gap = max(la[ta] - la[tb], lb[tb] - lb[ta])
    return ("near tie" if gap <= tol else "differ"), f"{where}: {ta} vs {tb}, logprob gap {gap:.1e}"


def part_tiny(args) -> tuple[bool, str, dict]:
    from models.config import get_preset
    from models.weights import random_weights
    from runtime.core.buckets import BucketTable
    from runtime.core.sampling_params import SamplingParams

    pallas = "pallas" if _on_gpu() else "interpret"
    cfg = get_preset("tiny")
    weights = random_weights(cfg, seed=0)
    # Lengths cover a fresh prefill (FlashAttention), chunked prefill over cached blocks (the
    # ragged paged kernel, 32-token steps) and decode (the decode kernel); 5 prompts > 4 seqs.
    prompts = _random_prompts(5, [1, 5, 17, 40, 90], cfg.vocab_size, seed=0)
    # Two buckets: decode-sized and a full 32-token step (each bucket is a compile per run).
    buckets = BucketTable.build(32, 4, token_sizes=(8, 32), seq_sizes=(4,))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False,
                            logprobs=TINY_LOGPROBS)
    rows = [("dtype", "status", "sequences equal", "near ties", "first split")]
    results = {}
    for dtype in ("f32", "bf16"):
        try:
            outs = {}
            for backend in ("xla", pallas):
                t0 = time.perf_counter()
                llm = build_llm(cfg, weights, backend=backend, dtype=dtype, buckets=buckets,
                                max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                                num_kv_blocks=64)
                t1 = time.perf_counter()
                outs[backend] = [o.outputs[0] for o in llm.generate(prompts, params)]
                print(f"  {dtype} {backend}: built in {t1 - t0:.1f} s, generated in "
                      f"{time.perf_counter() - t1:.1f} s", flush=True)
                del llm
            verdicts = [compare_greedy(x, y, NEAR_TIE_LOGPROB[dtype])
                        for x, y in zip(outs["xla"], outs[pallas])]
            counts = collections.Counter(v for v, _ in verdicts)
            split = next((f"prompt {i} {w}" for i, (v, w) in enumerate(verdicts) if v != "equal"), "-")
            full = all(len(o.token_ids) == params.max_tokens for o in outs["xla"] + outs[pallas])
            ok = counts["differ"] == 0 and full
            results[dtype] = {"ok": ok, "equal": counts["equal"], "near_ties": counts["near tie"],
                              "num_prompts": len(prompts), "first_split": split}
            rows.append((dtype, "PASS" if ok else "FAIL", f"{counts['equal']}/{len(prompts)}",
                         counts["near tie"], split if full else "a run stopped early"))
        except Exception as err:  # noqa: BLE001 (report this dtype, try the next)
            results[dtype] = {"ok": False, "error": _short(err)}
            rows.append((dtype, "FAIL", "-", "-", _short(err)))
        print(f"  {dtype}: {rows[-1][1]}", flush=True)
    print(f"tiny model ({cfg.num_layers} layers, H={cfg.num_q_heads}/{cfg.num_kv_heads} "
          f"D={cfg.head_dim}), greedy, {params.max_tokens} tokens each: xla vs {pallas}")
    _print_rows(rows)
    ok = all(r["ok"] for r in results.values())

    def brief(r):
        if "error" in r:
            return r["error"]
        ties = f", {r['near_ties']} split at a near tie" if r["near_ties"] else ""
        return f"{r['equal']}/{r['num_prompts']} equal{ties}"

    summary = "; ".join(f"{d} {brief(r)}" for d, r in results.items())
    return ok, f"xla vs {pallas}: {summary}", {"pallas_backend": pallas, "dtypes": results}


def throughput_setup(quick: bool, on_gpu: bool) -> dict:
    """The probe's shapes; --quick keeps SmolLM2's attention and widths but cuts depth and vocab."""
    import dataclasses as dc

    from models.config import get_preset

    cfg = get_preset("smollm2-135m")
    setup = dict(prompt_len=128, max_tokens=64, batch=64, dtype="bf16" if on_gpu else "f32",
                 token_sizes=(4, 64, 512), seq_sizes=(4, 64), shape="SmolLM2-135M")
    if quick:
        cfg = dc.replace(cfg, name="smollm2-135m-2layer", num_layers=2, vocab_size=8192)
        setup.update(prompt_len=24, max_tokens=16, token_sizes=(4, 64),
                     shape="SmolLM2-135M heads and widths, 2 layers, vocab 8192 (--quick)")
    setup["config"] = cfg
    return setup


def throughput_rival(on_gpu: bool) -> tuple[str | None, str]:
    """(the kernel backend timed against XLA's lowerings, why) on this machine: Pallas on a GPU; on
    a CPU our C++ kernels, what a CPU engine runs (Pallas's interpreter would time nothing a CPU
    runs); None where the C++ kernels do not build either."""
    if on_gpu:
        return "pallas", "Pallas against XLA"
    from runtime.worker import cpp_kernels

    if cpp_kernels.available():
        return "cpp", "our C++ kernels against XLA (pallas/xla: n.a., needs a GPU)"
    return None, "n.a. (pallas/xla needs a GPU, and the C++ kernels do not build here: the engine runs XLA only)"


def part_throughput(args) -> tuple[bool, str, dict]:
    import gc

    from models.weights import random_weights
    from runtime.core.buckets import BucketTable

    on_gpu = _on_gpu()
    rival, why = throughput_rival(on_gpu)
    print(f"timing {why}", flush=True)
    if rival is None:
        return True, why, {"applies": False}
    s = throughput_setup(args.quick, on_gpu)
    cfg = s["config"]
    buckets = BucketTable.build(s["token_sizes"][-1], s["seq_sizes"][-1],
                                token_sizes=s["token_sizes"], seq_sizes=s["seq_sizes"])
    max_model_len = 16 * -(-(s["prompt_len"] + s["max_tokens"]) // 16)
    print(f"shape: {s['shape']}; dtype {s['dtype']}; prompts of {s['prompt_len']} tokens, "
          f"{s['max_tokens']} output tokens each; buckets {' '.join(f'{t}x{q}' for t, q in buckets.pairs())}",
          flush=True)
    weights = random_weights(cfg, seed=0)
    warm = _random_prompts(s["batch"], [s["prompt_len"]], cfg.vocab_size, seed=1)
    timed = _random_prompts(s["batch"], [s["prompt_len"]], cfg.vocab_size, seed=2)
    params = _greedy(s["max_tokens"])
    results: dict[str, dict] = {}
    big = f"batch{s['batch']}"
    for backend in ("xla", rival):
        t0 = time.perf_counter()
        llm = build_llm(cfg, weights, backend=backend, dtype=s["dtype"], buckets=buckets,
                        warm_execute=True, max_model_len=max_model_len, max_num_seqs=s["batch"],
                        max_num_batched_tokens=s["token_sizes"][-1], enable_prefix_caching=False,
                        num_kv_blocks=s["batch"] * max_model_len // 16 + 1)
        start_s = time.perf_counter() - t0  # compile and run every bucket
        # And the sampler's first calls, at both batch sizes, before the clock starts.
        llm.generate(warm[:1], _greedy(2), use_tqdm=False)
        llm.generate(warm, _greedy(2), use_tqdm=False)
        r = {"start_s": start_s}
        first = None
        for label, prompts in (("batch1", timed[:1]), (big, timed)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            first = first or outs[0].outputs[0].token_ids
            num_out = sum(len(o.outputs[0].token_ids) for o in outs)
            if num_out != len(prompts) * s["max_tokens"]:
                raise RuntimeError(f"{backend} {label}: {num_out} tokens, expected "
                                   f"{len(prompts) * s['max_tokens']}")
            r[label] = num_out / dt
        # Batch 1 again with async scheduling flipped (issue 13: how much of a GPU step the host
        # was; auto turns it on for accelerators), the same executables.
        engine = llm.engine
        r["async"] = engine.async_scheduling
        engine.async_scheduling = not r["async"]
        t0 = time.perf_counter()
        outs = llm.generate(timed[:1], params, use_tqdm=False)
        r["batch1_async_flipped"] = len(outs[0].outputs[0].token_ids) / (time.perf_counter() - t0)
        engine.async_scheduling = r["async"]
        if outs[0].outputs[0].token_ids != first:
            raise RuntimeError(f"{backend}: greedy batch-1 tokens differ with async scheduling on and off")
        r["recompiles"] = llm.engine.stats().num_recompiles
        results[backend] = r
        print(f"  {backend}: start {start_s:.1f} s, batch 1 {r['batch1']:.1f} tok/s "
              f"(async scheduling {'on' if r['async'] else 'off'}; {'off' if r['async'] else 'on'}: "
              f"{r['batch1_async_flipped']:.1f}), batch {s['batch']} {r[big]:.1f} tok/s, "
              f"recompiles {r['recompiles']}", flush=True)
        del llm
        gc.collect()
    rows = [("backend", "start s", "batch 1 tok/s", f"{s['batch']} seqs tok/s", "recompiles")]
    for backend, r in results.items():
        rows.append((backend, f"{r['start_s']:.1f}", f"{r['batch1']:.1f}", f"{r[big]:.1f}",
                     r["recompiles"]))
    ratio1 = results[rival]["batch1"] / results["xla"]["batch1"]
    ratio = results[rival][big] / results["xla"][big]
    rows.append((f"{rival}/xla", "", f"{ratio1:.2f}x", f"{ratio:.2f}x", ""))
    print("output tokens per second (greedy, prefix caching off):")
    _print_rows(rows)
    recompiles = sum(r["recompiles"] for r in results.values())
    summary = (f"{rival}/xla {ratio1:.2f}x at 1 seq, {ratio:.2f}x at {s['batch']} seqs "
               f"({s['shape']}, {s['dtype']})" + ("" if on_gpu else "; pallas/xla n.a. (needs a GPU)"))
    if recompiles:
        summary += f"; {recompiles} recompiles while serving"
    data = {"shape": s["shape"], "full_shape": s["shape"] == "SmolLM2-135M", "dtype": s["dtype"],
            "batch": s["batch"], "against_xla": rival, "results": results,
            "ratio_batch1": ratio1, "ratio_batch": ratio}
    return recompiles == 0, summary, data


# ----------------------------------------------------------------------------- part: bench


def bench_cases(large: bool):
    from pallas_kernels import bench

    if not large:
        return bench.prefill_cases(True), bench.decode_cases(True)
    # The cases the targets name: L = 512 and L >= 2048, and 64 sequences x 4k context.
    # Few enough that every row fits BENCH_MAX_SECONDS even if each one compiles for seconds.
    prefill = [bench.PrefillCase(4, 512, 32, 8, 128), bench.PrefillCase(1, 2048, 32, 8, 128),
               bench.PrefillCase(1, 8192, 32, 8, 128)]
    decode = [bench.DecodeCase(64, 4096, 32, 8, 128), bench.DecodeCase(1, 4096, 32, 8, 128)]
    return prefill, decode


def part_bench(args) -> tuple[bool, str, dict]:
    from pallas_kernels import bench

    on_gpu = _on_gpu()
    prefill, decode = bench_cases(on_gpu and not args.quick)
    report = bench.run(prefill=prefill, decode=decode, interpret=not on_gpu,
                       repeats=10 if on_gpu else 1, case_timeout_s=10.0 if on_gpu else 8.0,
                       max_seconds=BENCH_MAX_SECONDS[args.quick])
    ours = [r for r in report.rows if r.impl in (bench.OURS_PREFILL, bench.OURS_DECODE)]
    # A budget skip is a note, not a failure; an error or a wrong result is.
    bad = [r for r in ours if r.matches_reference is False
           or (r.first_s is None and not r.note.startswith("skip"))]
    rows = []
    for r in report.rows:
        if r.spec is None:
            continue
        rows.append({"table": r.table, "impl": r.impl, "spec": dataclasses.asdict(r.spec),
                     "seconds": r.seconds, "rate": r.rate, "fraction": r.fraction,
                     "note": r.note, "first_s": r.first_s})
    timed = sum(r.seconds is not None for r in ours)
    summary = (f"ceilings {report.ceilings['copy_gbps']:.0f} GB/s copy, "
               f"{report.ceilings['matmul_tflops']:.1f} TFLOP/s bf16; ours timed on "
               f"{timed}/{len(ours)} cases")
    if bad:
        summary += "; failed: " + ", ".join(f"{r.case} ({r.note})" for r in bad)
    return not bad, summary, {"interpret": not on_gpu, "ceilings": report.ceilings, "rows": rows}


# ----------------------------------------------------------------------------- targets
