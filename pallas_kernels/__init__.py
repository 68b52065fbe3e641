"""Pallas GPU kernels for the two hot spots of a DDTree round, each behind a jnp reference.

- ``tree_attention``: tree-verify attention over a KV cache (GQA packing, split-K).
- ``tree_sample``: fused tree verification from target logits (walk + final draw).

Both take ``backend="auto" | "triton" | "interpret" | "xla"``; ``auto`` uses the Triton kernel
on a CUDA GPU and the XLA path elsewhere. ``tree_attention`` also has ``"mosaic"``, a Mosaic GPU
(Hopper wgmma) kernel (``tree_attention_mgpu``), and ``"mosaic_interpret"``, that kernel in the
Mosaic GPU interpreter; ``auto`` does not pick it (on an H200 it equals the reference but is
slower than the Triton kernel at most shapes, BENCHMARKS.md).
"""

from pallas_kernels.configs import TreeAttentionConfig, tree_attention_config
from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_sampling import tree_sample

__all__ = ["TreeAttentionConfig", "tree_attention", "tree_attention_config",
           "tree_attention_reference", "tree_sample"]
