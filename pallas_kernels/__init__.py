"""Pallas GPU kernels for the two hot spots of a DDTree round, each behind a jnp reference.

- ``tree_attention``: tree-verify attention over a KV cache (GQA packing, split-K).
- ``tree_sample``: fused tree verification from target logits (walk + final draw), the package
  ``tree_sampling``; ``tree_sample_reference`` is its jnp specification, with the same signature.

``tree_attention`` takes ``backend="auto" | "triton" | "interpret" | "xla"``; ``auto`` uses the
Triton kernel on a CUDA GPU and the XLA path elsewhere. It also has ``"mosaic"``, a Mosaic GPU
(Hopper wgmma) kernel (``tree_attention_mgpu``), and ``"mosaic_interpret"``, that kernel in the
Mosaic GPU interpreter; ``auto`` does not pick it (on an H200 it equals the reference but is
slower than the Triton kernel at most shapes, BENCHMARKS.md). ``tree_sample`` runs its Triton
kernels, or with ``interpret=True`` the same kernels interpreted; choosing between it and the
reference is the library's.
"""

from pallas_kernels.configs import TreeAttentionConfig, tree_attention_config
from pallas_kernels.reference import tree_attention_reference
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_sampling import SamplerConfig, tree_sample, tree_sample_reference

__all__ = ["SamplerConfig", "TreeAttentionConfig", "tree_attention", "tree_attention_config",
           "tree_attention_reference", "tree_sample", "tree_sample_reference"]
