"""GGUF files of a user-sized model's shape with seeded random weights, for the tests and benchmarks
that must run what users download (a 1B Q4_K_M file) where no such file can be fetched.

    python -m models.synthetic_gguf --shape llama-3.2-1b --type q4_k_m --out /tmp/llama-1b-q4_k_m.gguf

The file is a Llama GGUF of the preset's layer shapes with SmolLM2-135M's tokenizer (its vocabulary,
49,152 tokens, sets the embedding's rows), written with the `gguf` package. Random weights cost the
bytes and FLOPs of real ones. A quantized tensor's blocks are random bits with their f16 scales set
for values of about 0.02, so every block is a valid block of its type; `--type` picks the mix of
types llama.cpp's quantizer writes for that file type:

    q4_k_m  Q4_K, with Q6_K for the (tied) embedding and, as llama-quantize's Q4_K_M, for attn_v and
            ffn_down in the first and last eighth of the layers and every third layer between
    q6_k    Q6_K for every matrix
    q8_0    Q8_0 for every matrix
    f16     F16 for every matrix (the input of llama-quantize)

Norms are F32, as in every GGUF.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

FILE_TYPES = ("q4_k_m", "q6_k", "q8_0", "f16")
VALUE_SCALE = 0.02


def _use_more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, file_type: str, layers: int) -> str:
    """The GGML type a file of `file_type` stores tensor `name` in."""
    if name.endswith("norm.weight"):
        return "f32"
    if file_type != "q4_k_m":
        return file_type
    if name in ("token_embd.weight", "output.weight"):
        return "q6_k"
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and _use_more_bits(int(name.split(".")[1]), layers):
        return "q6_k"
    return "q4_k"


def random_blocks(rng, fmt: str, n: int, k: int, scale: float = VALUE_SCALE) -> np.ndarray:
    """u8 [n, k / block values x block bytes]: every bit random, the blocks' f16 scales set for values
    of about `scale` (K-quants' d and dmin, Q8_0's d)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    d = (scale * rng.uniform(0.5, 1.5, (n, k // values, 1))).astype(np.float32)
    if fmt == "q6_k":  # value = d * int8 scale * (q - 32): |scale * (q - 32)| is about 64 x 16
        rows[..., 208:210] = (d / 600).astype("<f2").view(np.uint8)
    elif fmt in ("q4_k", "q5_k"):  # d * sc * q - dmin * m, sc and m 6-bit
        rows[..., 0:2] = (d / 500).astype("<f2").view(np.uint8)
        rows[..., 2:4] = (d / 500 * 8).astype("<f2").view(np.uint8)
    elif fmt == "q8_0":  # d * int8
        rows[..., 0:2] = (d / 64).astype("<f2").view(np.uint8)
    else:
        raise ValueError(f"no random blocks for {fmt!r}")
    return rows.reshape(n, -1)


def _tokenizer_fields(reader) -> dict:
    from models.weights import decode_gguf_fields

    return {k: v for k, v in decode_gguf_fields(reader).items() if k.startswith("tokenizer.")}


def write(out: str | Path, shape="llama-3.2-1b", file_type: str = "q4_k_m", seed: int = 0) -> dict:
    """Writes the file (`shape`: a preset's name, or a ModelConfig); returns {"bytes": file size,
    "tensor_bytes": its tensors' bytes, "seconds"}."""
    import gguf

    from models.config import get_preset
    from models.weights import find_smollm2_gguf

    if file_type not in FILE_TYPES:
        raise ValueError(f"--type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    t0 = time.perf_counter()
    cfg, rng = (get_preset(shape) if isinstance(shape, str) else shape), np.random.default_rng(seed)
    tok = _tokenizer_fields(gguf.GGUFReader(str(find_smollm2_gguf())))
    vocab = len(tok["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"{cfg.name} (random weights, {file_type})")
    for key, value in {"block_count": cfg.num_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_q_heads, "attention.head_count_kv": cfg.num_kv_heads,
                       "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                       "rope.dimension_count": cfg.head_dim, "vocab_size": vocab}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    w.add_float32("llama.rope.freq_base", cfg.rope_theta)
    w.add_uint32("general.file_type", {"q4_k_m": 15, "q6_k": 18, "q8_0": 7, "f16": 1}[file_type])
    for key, value in tok.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (vocab, h)
    for i in range(cfg.num_layers):
        for name, s in {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (cfg.num_q_heads * cfg.head_dim, h),
                        "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, cfg.num_q_heads * cfg.head_dim),
                        "ffn_gate": (cfg.intermediate_size, h), "ffn_up": (cfg.intermediate_size, h),
                        "ffn_down": (h, cfg.intermediate_size)}.items():
            shapes[f"blk.{i}.{name}.weight"] = s
    tensor_bytes = 0
    for name, s in shapes.items():  # [out, in]: the file's rows are output columns
        fmt = tensor_type(name, file_type, cfg.num_layers)
        if fmt == "f32":
            data = np.ones(s, np.float32)
            w.add_tensor(name, data)
        elif fmt == "f16":
            data = (rng.standard_normal(s, np.float32) * VALUE_SCALE).astype(np.float16)
            w.add_tensor(name, data)
        else:
            data = random_blocks(rng, fmt, *s)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[fmt.upper()])
        tensor_bytes += data.nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"bytes": Path(out).stat().st_size, "tensor_bytes": tensor_bytes, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m models.synthetic_gguf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", help="a preset whose layer shapes the file takes")
    ap.add_argument("--type", default="q4_k_m", choices=FILE_TYPES, dest="file_type")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    r = write(args.out, args.shape, args.file_type, args.seed)
    print(f"{args.out}: {r['bytes'] / 2**20:.1f} MiB ({r['tensor_bytes'] / 2**20:.1f} MiB of tensors) "
          f"in {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
