"""Every numeric tolerance the tests compare with, in one table. A looser value says why.

Kernel-vs-reference tolerances by dtype are pallas_kernels.testing.TOLERANCES (the self-check and
the kernel benchmark use them too); KERNEL re-exports them here.
"""

from pallas_kernels.testing import TOLERANCES as KERNEL  # noqa: F401 (one table: the kernel rows)

# The same math in another order (fused softmax, concatenated matmuls, paged gathers, a tp
# all-reduce): f32 results move by a few ulps.
SAME_MATH_F32 = dict(rtol=1e-5, atol=1e-5)
# The same executable inputs and program: bit for bit.
BITWISE = dict(rtol=0, atol=0)
# Our f32 lowering against HF transformers' f32 forward on SmolLM2: 30 layers summed in another
# order; 10x SAME_MATH_F32 because the error compounds over the depth.
HF_LOGITS = dict(rtol=0, atol=1e-4)
# Golden logits (HF's f32, stored unrounded in tests/data/golden) against full-engine runs (paged KV,
# chunked prefill, buckets): the golden data's own bar (its README) for an f32 engine over 30 layers.
GOLDEN_LOGITS = dict(rtol=0, atol=1e-3)
# HF's f32 run remade (tests/data/make_golden.py) against the committed golden logits: torch's CPU
# kernels sum in another order on another CPU or release; 5.25 against 5.24 moved them by 6e-5.
GOLDEN_REMAKE = dict(rtol=0, atol=1e-4)
# Logits closer than this may legitimately swap order between two f32 engines.
ORDER_GAP = 2e-3
# XLA against the Pallas interpreter over several engine steps: the online softmax's chunk
# boundaries differ (128 vs the kernel's tile), and the error compounds through the layers.
BACKENDS_F32 = dict(rtol=2e-4, atol=2e-4)
# Prompt logprobs under tp: a log-softmax over a vocab split across devices sums in another order.
PROMPT_LOGPROBS_TP = dict(rtol=0, atol=1e-4)
# Int8 scales recomputed in numpy from the source weights.
QUANT_SCALE = dict(rtol=1e-6)
# Sampling frequencies over a few thousand draws: about 4 sigma of a binomial at these counts.
SAMPLING_FREQUENCY = dict(atol=0.06)
# A permutation of float64 values computed two ways (numpy, f64): only rounding of the last bits.
SAME_MATH_F64 = dict(rtol=1e-12, atol=1e-12)
# matmul_bf16 against the f32 product (x and w rounded to bf16, 8 mantissa bits, f32 accumulated):
# each product term moves by up to 2^-8 relative; unit-scale outputs stay well inside 2e-2.
BF16_MATMUL = dict(rtol=2e-2, atol=2e-2)
