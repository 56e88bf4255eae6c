"""Pallas kernels (FlashAttention prefill, paged attention, the grouped matmul of mixture-of-experts
layers) with jnp references.

This package imports only jax (docs/ARCHITECTURE.md, "Rules for contributors").
"""

from pallas_kernels.flash_attention import BlockSizes as FlashAttentionBlockSizes
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.grouped_matmul import BlockSizes as GroupedMatmulBlockSizes
from pallas_kernels.grouped_matmul import check_inputs as grouped_matmul_check_inputs
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.paged_attention import BlockSizes as PagedAttentionBlockSizes
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

__all__ = [
    "FlashAttentionBlockSizes",
    "GroupedMatmulBlockSizes",
    "PagedAttentionBlockSizes",
    "flash_attention",
    "flash_attention_reference",
    "grouped_matmul",
    "grouped_matmul_check_inputs",
    "grouped_matmul_reference",
    "paged_attention",
    "paged_attention_reference",
]
