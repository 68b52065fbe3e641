"""DDTree speculative decoding with exact temperature sampling, in JAX."""

from ddtree_jax.sampling import target_probs
from ddtree_jax.tree import (
    DraftTree,
    Retrieve,
    build_tree,
    compile_retrieve,
    tree_attention_mask,
    tree_positions,
)
from ddtree_jax.verify import (
    VerifyResult,
    expected_acceptance,
    tree_greedy_verify,
    tree_rejection_sample,
    verify,
)

__all__ = [
    "DraftTree",
    "Retrieve",
    "VerifyResult",
    "build_tree",
    "compile_retrieve",
    "expected_acceptance",
    "target_probs",
    "tree_attention_mask",
    "tree_greedy_verify",
    "tree_positions",
    "tree_rejection_sample",
    "verify",
]
