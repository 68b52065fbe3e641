"""The node selection of the budget policies: how many nodes of each request's tree a round keeps.

Each rule returns ``keep [batch]``, the kept nodes per request counting the root; a request keeps
nodes ``0 .. keep - 1`` of its pop order (`keep_prefix`). Computed in float64 with plain loops.
"""

import math

import numpy as np

from ddtree_jax.oracle._checks import require_int, require_rank, require_shape, tree_arrays
from ddtree_jax.oracle.types import Tree


def keep_prefix(tree, keep):
    """``tree`` with every node ``k >= keep[b]`` of request ``b`` made padding (token 0, parent -1,
    depth 0, logw -inf); ``num_nodes`` becomes ``min(keep, num_nodes)``."""
    t = tree_arrays(tree)
    keep_B = np.asarray(keep)
    require_shape("keep", keep_B, t.num_nodes.shape)
    tokens, parents, depths, logw = (np.array(x) for x in (t.tokens, t.parents, t.depths, t.logw))
    num_nodes = np.array(t.num_nodes, dtype=np.int32)
    for b in range(tokens.shape[0]):
        kept = min(int(keep_B[b]), int(num_nodes[b]))
        for k in range(kept, tokens.shape[1]):
            tokens[b, k], parents[b, k], depths[b, k], logw[b, k] = 0, -1, 0, -np.inf
        num_nodes[b] = kept
    return Tree(tokens=tokens, parents=parents, depths=depths, logw=logw, num_nodes=num_nodes)


def adaptive_keep(logw, num_nodes, cost):
    """``"adaptive"``: per request, ``1 + n`` for the ``n`` in ``0 .. num_nodes - 1`` that maximises
    ``(1 + sum_{k=1..n} exp(logw[k])) / cost[n]``, the largest such ``n`` on ties.

    Args: ``logw [batch, N]`` (pop order), ``num_nodes [batch]``, ``cost [N]`` (``> 0``, the round
    time with ``n`` drafts per request).
    """
    logw_BN, num_nodes_B, cost_N = np.asarray(logw), np.asarray(num_nodes), np.asarray(cost, np.float64)
    require_rank("logw", logw_BN, 2)
    require_shape("num_nodes", num_nodes_B, logw_BN.shape[:1])
    require_shape("cost", cost_N, logw_BN.shape[1:])
    if not np.all(cost_N > 0):
        raise ValueError(f"cost must be > 0, got {cost_N.tolist()}")
    keep = np.ones(logw_BN.shape[0], np.int32)
    for b in range(logw_BN.shape[0]):
        mass, best = 0.0, 1.0 / cost_N[0]
        for n in range(1, int(num_nodes_B[b])):
            mass += math.exp(float(logw_BN[b, n]))
            score = (1.0 + mass) / cost_N[n]
            if score >= best:
                best, keep[b] = score, n + 1
    return keep


def batch_keep(logw, num_nodes, live, budget):
    """``"batch"``: the ``budget x (number of live requests)`` most probable drafts over all live
    requests (descending ``logw``, ties to the smaller node index, then the smaller request row) are
    kept; ``1 +`` the count of each request's (finished requests keep the root only).

    Args: ``logw [batch, N]`` (pop order), ``num_nodes [batch]``, ``live`` bool ``[batch]``,
    ``budget >= 1``.
    """
    logw_BN, num_nodes_B, live_B = np.asarray(logw), np.asarray(num_nodes), np.asarray(live, bool)
    require_rank("logw", logw_BN, 2)
    require_shape("num_nodes", num_nodes_B, logw_BN.shape[:1])
    require_shape("live", live_B, logw_BN.shape[:1])
    budget = require_int("budget", budget, 1)
    candidates = sorted((-float(logw_BN[b, k]), k, b) for b in np.flatnonzero(live_B)
                        for k in range(1, int(num_nodes_B[b])))
    keep = np.ones(logw_BN.shape[0], np.int32)
    for _, _, b in candidates[: budget * int(live_B.sum())]:
        keep[b] += 1
    return keep
