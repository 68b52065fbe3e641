"""Exact laws of a round: the expected number of accepted drafts and the law of the emitted tokens."""

import numpy as np

from ddtree_jax.oracle._checks import require_int, require_shape, tree_arrays
from ddtree_jax.oracle.tree import compile_retrieve
from ddtree_jax.oracle.verify import _children, _residual


def expected_acceptance(tree, probs):
    """Float64 ``[batch]``: the sum over real non-root nodes of the target probability of
    their path, ``prod_e probs[parent(e), token(e)]`` over the edges root -> node. This is
    the exact expected number of accepted drafts when ``max_depth`` is at least the tree
    depth and siblings are distinct."""
    t = tree_arrays(tree)
    probs_BNV = np.asarray(probs, dtype=np.float64)
    require_shape("probs", probs_BNV, t.tokens.shape + probs_BNV.shape[-1:])
    expected = np.zeros(t.tokens.shape[0], dtype=np.float64)
    for b in range(t.tokens.shape[0]):
        path_prob = [1.0]
        for k in range(1, int(t.num_nodes[b])):
            parent = int(t.parents[b, k])
            path_prob.append(path_prob[parent] * probs_BNV[b, parent, t.tokens[b, k]])
        expected[b] = sum(path_prob[1:])
    return expected


def emitted_law(tree, probs, max_depth):
    """Exact law of the emitted token sequence of one request under ``tree_rejection_sample``
    with uniform coins.

    Args:
      tree: a batch-1 tree; probs: ``[1, N, V]`` target rows; max_depth: most drafts accepted.

    Returns ``{tuple(emitted tokens): probability}`` over sequences of positive probability
    (accepted drafts then the final token). Child c of the current node is accepted with the
    length of its coin interval ``(acc_before, acc_after]`` clipped to ``(0, 1]``; on rejection
    of all children the final token follows the residual row.
    """
    t = tree_arrays(tree)
    probs_NV = np.asarray(probs, dtype=np.float64)
    if t.tokens.shape[0] != 1:
        raise ValueError(f"emitted_law takes a batch-1 tree, got batch {t.tokens.shape[0]}")
    require_shape("probs", probs_NV, t.tokens.shape + probs_NV.shape[-1:])
    probs_NV = probs_NV[0]
    max_depth = require_int("max_depth", max_depth, 0)
    retrieve = compile_retrieve(t)
    first_child, next_sibling = retrieve.next_token[0], retrieve.next_sibling[0]
    tokens = t.tokens[0]
    law = {}

    def add_final(prefix, weight, row_V):
        for token in np.flatnonzero(row_V > 0):
            key = prefix + (int(token),)
            law[key] = law.get(key, 0.0) + weight * row_V[token] / row_V.sum()

    def walk(node, prefix, weight, accepted):
        if weight <= 0:
            return
        children = list(_children(first_child, next_sibling, node))
        if accepted == max_depth or not children:
            add_final(prefix, weight, probs_NV[node])
            return
        acc = 0.0
        for child in children:
            before, acc = acc, acc + probs_NV[node, tokens[child]]
            share = min(acc, 1.0) - min(before, 1.0)
            walk(child, prefix + (int(tokens[child]),), weight * share, accepted + 1)
        rejected = {int(tokens[child]) for child in children}
        add_final(prefix, weight * (1.0 - min(acc, 1.0)), _residual(probs_NV[node], rejected))

    walk(0, (), 1.0, 0)
    return {key: value for key, value in law.items() if value > 0}
