"""Pallas attention kernels (FlashAttention prefill, paged attention) with jnp references.

This package imports only jax; see DESIGN.md.
"""

from pallas_kernels.flash_attention import BlockSizes as FlashAttentionBlockSizes
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.paged_attention import BlockSizes as PagedAttentionBlockSizes
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

__all__ = [
    "FlashAttentionBlockSizes",
    "PagedAttentionBlockSizes",
    "flash_attention",
    "flash_attention_reference",
    "paged_attention",
    "paged_attention_reference",
]
