"""Pallas GPU kernels for the hot spots of a DDTree round, each beside its jnp reference.

- ``tree_attention`` (Triton lowering) and ``tree_attention_mgpu`` (Mosaic GPU, Hopper):
  tree-verify attention over a KV cache (GQA packing, split-K); reference
  ``tree_attention_reference``.
- ``tree_sample`` (the package ``tree_sampling``): fused tree verification from target logits
  (walk + final draw); ``tree_sample_reference`` is its jnp specification, same signature.
- ``matmul``: the skinny matrix products of decoding (split-K, RMSNorm prologue, SwiGLU and
  residual epilogues); reference ``matmul_reference``. ``matmul_mgpu`` (Mosaic GPU, Hopper): the
  plain product with the weights streamed by TMA into warpgroup MMAs.
- ``kv_write``: a forward's new keys and values into the stacked KV caches, in place; reference
  ``kv_write_reference``.
- ``residual_norm``: a split-K product's partials summed, its residual added and the next RMSNorm
  applied, in one launch; reference ``residual_norm_reference``.
- ``qk_norm_rope``: a layer's q/k/v split, per-head q/k RMSNorm and RoPE in one launch; reference
  ``qk_norm_rope_reference``. ``qk_norm_rope_write``: the same with the keys and values stored into
  the KV cache; reference ``qk_norm_rope_write_reference``.
- ``tree_nodes`` (``tree_build``): the DDTree beam and best-first order of each request in one
  program, from each depth's top-k; reference ``tree_nodes_reference``. ``tree_nodes_wide``
  (``tree_build_wide``): the same for large budgets, a launch of many programs a depth.
- ``top_k``: the exact top-k of long rows (the draft's vocabulary) by radix selection; reference
  ``top_k_reference`` (``lax.top_k``).

This package imports nothing from ``ddtree_jax``: the library's dispatch module
(``ddtree_jax/kernels.py``) decides which implementation runs where and wraps the results.
"""

from pallas_kernels.configs import MatmulConfig, TreeAttentionConfig, tree_attention_config
from pallas_kernels.kv_write import kv_write
from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.matmul import matmul
from pallas_kernels.matmul_mgpu import matmul_mgpu
from pallas_kernels.matmul_reference import matmul_reference
from pallas_kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_write
from pallas_kernels.qk_norm_rope_reference import qk_norm_rope_reference, qk_norm_rope_write_reference
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.residual_norm_reference import residual_norm_reference
from pallas_kernels.top_k import top_k
from pallas_kernels.top_k_reference import top_k_reference
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_build import tree_nodes
from pallas_kernels.tree_build_reference import tree_nodes_reference
from pallas_kernels.tree_build_wide import tree_nodes_wide
from pallas_kernels.tree_sampling import SamplerConfig, tree_sample, tree_sample_reference

__all__ = ["MatmulConfig", "SamplerConfig", "TreeAttentionConfig", "kv_write", "kv_write_reference", "matmul",
           "matmul_mgpu", "matmul_reference", "qk_norm_rope", "qk_norm_rope_reference", "qk_norm_rope_write",
           "qk_norm_rope_write_reference", "residual_norm", "residual_norm_reference", "top_k", "top_k_reference",
           "tree_attention", "tree_attention_config", "tree_attention_reference", "tree_nodes",
           "tree_nodes_reference", "tree_nodes_wide", "tree_sample", "tree_sample_reference"]
