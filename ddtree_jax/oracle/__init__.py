"""NumPy reference of the DDTree core: tree construction, encoding, target law, verification, the
budget policies' node selection (and the routed-experts MLP of a Qwen3-MoE target).

Plain loops and a real heap, written for clarity rather than speed. This is the test reference:
the JAX implementation is tested against these functions, and nothing uses them at run time.
Conventions (docs/design.md, "Conventions"):

* A tree has ``N = budget + 1`` slots per request. Node 0 is the root (the round's input token,
  depth 0, ``logw = 0``); nodes ``1..num_nodes-1`` are the drafts in pop order of the best-first
  search; the remaining slots are padding (``token 0, parent -1, depth 0, logw -inf``).
* Depth ``d >= 1`` of the tree uses row ``d - 1`` of the draft logits.
* Children of a node are listed in ascending node index (= descending draft probability).
  The verification functions take any valid first-child / next-sibling encoding instead (links
  to any node in any order; ``verify._check_walk_inputs``) and follow its sibling lists.

All functions take anything ``np.asarray`` accepts and return NumPy arrays. Functions taking a
tree accept any object with the ``Tree`` attributes (so a JAX ``DraftTree`` can be passed).

Modules: ``types`` (the containers), ``tree`` (construction and encodings), ``law`` (the target
law), ``verify`` (the walks), ``exact`` (expected acceptance and the law of the emitted tokens),
``budget`` (the node selection of the budget policies), ``moe`` (routed experts).
"""

from ddtree_jax.oracle.budget import adaptive_keep, batch_keep, keep_prefix
from ddtree_jax.oracle.exact import emitted_law, expected_acceptance
from ddtree_jax.oracle.law import target_probs
from ddtree_jax.oracle.moe import routed_experts
from ddtree_jax.oracle.tree import build_tree, compile_retrieve, draft_log_probs, tree_attention_mask, tree_positions
from ddtree_jax.oracle.types import Retrieve, Tree, VerifyResult
from ddtree_jax.oracle.verify import tree_greedy_verify, tree_rejection_sample, verify

__all__ = [
    "Retrieve",
    "Tree",
    "VerifyResult",
    "adaptive_keep",
    "batch_keep",
    "build_tree",
    "compile_retrieve",
    "draft_log_probs",
    "emitted_law",
    "expected_acceptance",
    "keep_prefix",
    "routed_experts",
    "target_probs",
    "tree_attention_mask",
    "tree_greedy_verify",
    "tree_positions",
    "tree_rejection_sample",
    "verify",
]
