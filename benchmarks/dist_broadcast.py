"""What it costs to get a step's host inputs from rank 0 to rank 1 of a 2-process engine, against
the 64-sequence decode step itself (tp=2 over the two processes, gloo between them).

    .venv/bin/python benchmarks/dist_broadcast.py                      # SmolLM2, 64 decode rows
    .venv/bin/python benchmarks/dist_broadcast.py --model tiny --steps 50

Starts two processes (one CPU device each). Both build the model's runner at tp=2 and compile
only the 64x64 decode bucket; rank 0 then runs `--steps` decode steps through the engine's own
path (ModelRunner.execute, mirrored to rank 1 over the control channel) and times, on the same
step's inputs (token ids, positions, KV slots, block tables, the sampler's arrays: the
frame that runtime.distributed sends):

- socket (what the engine uses): rank 0's encode + send, rank 1's receive + decode, and a round
  trip (frame there, 8-byte ack back) with rank 1 doing nothing else;
- JAX's key-value store (the coordination service's gRPC): set the frame, get it on rank 1,
  ack through a second key; round trip;
- multihost_utils.broadcast_one_to_all of the inputs as a pytree (rank 1 passes zeros of the
  same shapes, which it would first have to learn: not counted).

Prints one Markdown table; the cost of a transport per step is its one-way time (half the round
trip) plus, for the socket, rank 1's decode, as a share of the mean step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_step_inputs(runner, bucket, context: int = 128):
    """A decode step of bucket[1] sequences, each `context` tokens long, in distinct KV blocks."""
    import numpy as np

    from runtime.core.sampling_params import SamplingParams
    from runtime.worker import sampler

    t, s = bucket
    bs, m = runner.block_size, runner.max_blocks_per_seq
    per_seq = -(-(context + 1) // bs)
    tables = np.zeros((s, m), np.int32)
    for i in range(s):
        tables[i, :per_seq] = np.arange(i * per_seq, (i + 1) * per_seq) % runner.num_blocks
    rng = np.random.default_rng(0)
    inputs = {"tokens": rng.integers(0, 1000, t).astype(np.int32),
              "positions": np.full(t, context, np.int32),
              "slot_mapping": (tables[:, context // bs] * bs + context % bs).astype(np.int32),
              "block_tables": tables, "context_lens": np.full(s, context + 1, np.int32),
              "cu_q_lens": np.arange(s + 1, dtype=np.int32), "logits_indices": np.arange(s, dtype=np.int32)}
    rows = [(SamplingParams(temperature=0), i, 3, [1] * (context + 1), context - 3) for i in range(s)]
    si = sampler.build_inputs(rows, s, runner.max_model_len, lambda p: [], vocab_size=runner.vocab_size)
    return inputs, si.arrays()


def rank_main(args) -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from runtime.distributed import multiprocess as distributed, wire
    from runtime.engine.build import build_runner
    from runtime.engine.plan import load_plan

    cfg = distributed.DistributedConfig(2, args.rank, args.dist_init_addr)
    group = distributed.join(cfg)
    engine = dict(tensor_parallel_size=2, max_model_len=args.max_model_len, max_num_seqs=64,
                  max_num_batched_tokens=64, num_kv_blocks=args.num_kv_blocks)
    plan = load_plan(args.model, engine)
    bucket = plan.buckets.pick(64, 64)
    runner = build_runner(plan, args.cache_dir)
    t0 = time.perf_counter()
    runner.compile_bucket(bucket)
    compile_s = time.perf_counter() - t0
    ident = distributed.plan_identity(plan, args.model)
    if group.is_leader:
        group.check_peers(ident)
        group.start(runner)
    else:
        group.introduce(ident)
        group.ready(runner)
        group.serve(runner)  # the engine path, until rank 0 says stop
    client = jax._src.distributed.global_state.client
    inputs, sampling = decode_step_inputs(runner, bucket) if group.is_leader else (None, None)
    ch = group.peers[1] if group.is_leader else group.sock
    result = {"compile_s": compile_s}
    if group.is_leader:
        for _ in range(3):  # first runs
            jax.block_until_ready(runner.execute(bucket, inputs, sampling))
        frame_first = len(wire.Encoder(refs=True).frame("call", seq=1, method="execute",
                                                               args=(bucket, inputs, sampling), kwargs={}))
        send0, n0 = group.send_seconds, group.num_calls
        t0 = time.perf_counter()
        for _ in range(args.steps):
            jax.block_until_ready(runner.execute(bucket, inputs, sampling))
        step_s = (time.perf_counter() - t0) / args.steps
        send_s = (group.send_seconds - send0) / (group.num_calls - n0)
        frame = group._encoder.frame("call", seq=0, method="execute", args=(bucket, inputs, sampling), kwargs={})
        group.stop()
        result.update(step_s=step_s, send_s=send_s, frame_bytes=len(frame), frame_first_bytes=frame_first)
        ch.settimeout(60)
    else:
        result.update(recv_s=group.recv_seconds / max(group.num_calls, 1))
        frame = None
    # Round trips on the bare channel: frame -> rank 1 (decode) -> 8 bytes back.
    dec = None if group.is_leader else group._decoder  # it holds the constants sent once
    n = args.steps
    t0 = time.perf_counter()
    for i in range(n):
        if group.is_leader:
            ch.sendall(frame)
            wire._recv_exact(ch, 8)
        else:
            wire.recv_frame(ch, dec)
            ch.sendall(b"ack-" + i.to_bytes(4, "big"))
    result["socket_rtt_s"] = (time.perf_counter() - t0) / n
    # JAX's key-value store, the same frame.
    t0 = time.perf_counter()
    for i in range(n):
        if group.is_leader:
            client.key_value_set_bytes(f"bench/step/{i}", frame)
            client.blocking_key_value_get_bytes(f"bench/ack/{i}", 60_000)
        else:
            raw = client.blocking_key_value_get_bytes(f"bench/step/{i}", 60_000)
            nh, npl = wire._LENGTHS.unpack(raw[:8])
            dec.decode(raw[8:8 + nh], bytearray(raw[8 + nh:]))
            client.key_value_set_bytes(f"bench/ack/{i}", b"1")
    result["kv_rtt_s"] = (time.perf_counter() - t0) / n
    # broadcast_one_to_all of the pytree (rank 1's zeros: the shapes it would have to know first).
    if not group.is_leader:
        inputs, sampling = decode_step_inputs(runner, bucket)
        inputs = {k: np.zeros_like(v) for k, v in inputs.items()}
        sampling = {k: np.zeros_like(np.asarray(v)) for k, v in sampling.items()}
    tree = (inputs, {k: np.asarray(v) for k, v in sampling.items()})
    multihost_utils.broadcast_one_to_all(tree)  # compiles
    t0 = time.perf_counter()
    for _ in range(n):
        multihost_utils.broadcast_one_to_all(tree)
    result["broadcast_one_to_all_s"] = (time.perf_counter() - t0) / n
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--cache-dir", default=None, help="JAX's compilation cache (default: the usual)")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dist-init-addr", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    from runtime.distributed.multiprocess import free_port_pair

    addr = f"127.0.0.1:{free_port_pair()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    base = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps), "--max-model-len",
            str(args.max_model_len), "--num-kv-blocks", str(args.num_kv_blocks), "--dist-init-addr", addr]
    if args.cache_dir:
        base += ["--cache-dir", args.cache_dir]
    procs = [subprocess.Popen(base + ["--rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=3600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = [json.loads(next(line[7:] for line in o.splitlines() if line.startswith("RESULT "))) for o in outs]
    r0, r1 = res
    step = r0["step_s"]
    ms = lambda s: f"{s * 1e3:.3f}"  # noqa: E731
    print(f"model {args.model}, tp=2 over 2 processes (1 CPU device each), decode bucket 64x64, "
          f"max_model_len {args.max_model_len}; load {os.getloadavg()[0]:.1f}")
    print(f"frame: {r0['frame_first_bytes']} bytes the first time, {r0['frame_bytes']} after (constants sent once)")
    print(f"mean 64-sequence decode step (engine path, mirrored): {ms(step)} ms\n")
    print("| transport | per step (ms) | share of the step |")
    print("|---|---|---|")
    sock = r0["send_s"] + r0["socket_rtt_s"] / 2 + r1["recv_s"]
    rows = [("socket frame, engine path: rank 0 encode+send", r0["send_s"]),
            ("socket frame, engine path: rank 1 decode", r1["recv_s"]),
            ("socket frame: round trip / 2", r0["socket_rtt_s"] / 2),
            ("socket, per step: send + one way + decode", sock),
            ("JAX key-value store: round trip / 2", r0["kv_rtt_s"] / 2),
            ("multihost_utils.broadcast_one_to_all", r0["broadcast_one_to_all_s"])]
    for name, s in rows:
        print(f"| {name} | {ms(s)} | {100 * s / step:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
