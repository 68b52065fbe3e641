"""DDTree speculative decoding with exact temperature sampling, in JAX."""

from ddtree_jax.checkpoint import load_drafter, load_target, save_drafter, save_target
from ddtree_jax.engine import GenerateResult, generate
from ddtree_jax.models import drafter_logits, target_logits
from ddtree_jax.sampling import target_probs
from ddtree_jax.sharding import make_mesh
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
    "GenerateResult",
    "Retrieve",
    "VerifyResult",
    "build_tree",
    "compile_retrieve",
    "drafter_logits",
    "expected_acceptance",
    "generate",
    "load_drafter",
    "load_target",
    "make_mesh",
    "save_drafter",
    "save_target",
    "target_logits",
    "target_probs",
    "tree_attention_mask",
    "tree_greedy_verify",
    "tree_positions",
    "tree_rejection_sample",
    "verify",
]
