"""Tree construction by best-first search with a real heap, and the tree encodings (first-child /
next-sibling links, attention mask, positions)."""

import heapq

import numpy as np

from ddtree_jax.oracle._checks import per_request, require_int, require_rank, require_shape, tree_arrays
from ddtree_jax.oracle.types import Retrieve, Tree


def draft_log_probs(logits_row, draft_temperature):
    """Float32 log-softmax of one ``[V]`` logits row at ``draft_temperature``, in the exact
    operation order the tree construction uses, at most 0 (an edge never adds mass)."""
    z = np.asarray(logits_row).astype(np.float32) / np.float32(draft_temperature)
    s = z - z.max()
    return np.minimum(s - np.log(np.sum(np.exp(s))), np.float32(0))


def _build_one(logits_LV, root_token, budget, width, draft_temperature):
    """Best-first search for one request; returns the ``Tree`` fields without the batch axis."""
    depth_limit = logits_LV.shape[0]
    lp_LV = [draft_log_probs(row, draft_temperature) for row in logits_LV]
    ranked_LK = [np.argsort(-lp, kind="stable")[:width] for lp in lp_LV]

    def edge_logw(parent_logw, depth, rank):
        return np.float32(parent_logw + lp_LV[depth - 1][ranked_LK[depth - 1][rank]])

    tokens, parents, depths, logws = [int(root_token)], [-1], [0], [np.float32(0.0)]
    # Heap entries: (-logw, rank tuple, parent node id). Rank tuples are unique, so the
    # comparison never reaches the parent id.
    heap = [(-float(edge_logw(np.float32(0.0), 1, 0)), (0,), 0)]
    while heap and len(tokens) <= budget:
        neg_logw, ranks, parent = heapq.heappop(heap)
        node, depth, rank = len(tokens), len(ranks), ranks[-1]
        logw = np.float32(-neg_logw)
        tokens.append(int(ranked_LK[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        logws.append(logw)
        if rank + 1 < width:
            sibling_logw = edge_logw(logws[parent], depth, rank + 1)
            heapq.heappush(heap, (-float(sibling_logw), ranks[:-1] + (rank + 1,), parent))
        if depth < depth_limit:
            child_logw = edge_logw(logw, depth + 1, 0)
            heapq.heappush(heap, (-float(child_logw), ranks + (0,), node))

    pad = budget + 1 - len(tokens)
    return (
        tokens + [0] * pad,
        parents + [-1] * pad,
        depths + [0] * pad,
        logws + [np.float32(-np.inf)] * pad,
        len(tokens),
    )


def build_tree(draft_logits, root_tokens, *, budget, topk_cap=None, draft_temperature=1.0):
    """Builds the DDTree of each request by best-first search over draft prefixes.

    Args:
      draft_logits: ``[batch, L, V]``; row ``d`` is the drafter's distribution at tree depth
        ``d + 1`` (independent of the prefix).
      root_tokens: int ``[batch]``, the token of node 0.
      budget: number of non-root nodes ``B >= 1``; trees have ``N = B + 1`` slots.
      topk_cap: optional cap on the tokens kept per depth; ``K = min(topk_cap, B, V)``
        (``min(B, V)`` without it). ``1`` gives a chain of ``min(B, L)`` drafts.
      draft_temperature: ``> 0``; depth log-probabilities are
        ``log_softmax(logits / draft_temperature)`` in float32.

    Returns:
      ``Tree`` whose nodes are the top-``B`` prefixes by draft probability (ranks ``< K`` at
      every depth) in pop order: non-increasing ``logw``, ties towards the lexicographically
      smaller rank tuple. ``logw`` adds one float32 edge log-probability per depth to the
      parent's value.
    """
    logits_BLV = np.asarray(draft_logits)
    roots_B = np.asarray(root_tokens)
    require_rank("draft_logits", logits_BLV, 3)
    batch, depth_limit, vocab = logits_BLV.shape
    if depth_limit < 1 or vocab < 1:
        raise ValueError(f"draft_logits needs L >= 1 and V >= 1, got shape {logits_BLV.shape}")
    require_shape("root_tokens", roots_B, (batch,))
    budget = require_int("budget", budget, 1)
    width = min(budget, vocab)
    if topk_cap is not None:
        width = min(require_int("topk_cap", topk_cap, 1), width)
    if not (np.isfinite(draft_temperature) and draft_temperature > 0):
        raise ValueError(f"draft_temperature must be finite and > 0, got {draft_temperature!r}")

    rows = [
        _build_one(logits_BLV[b], roots_B[b], budget, width, draft_temperature)
        for b in range(batch)
    ]
    tokens, parents, depths, logws, num_nodes = zip(*rows, strict=True)
    return Tree(
        tokens=np.array(tokens, dtype=np.int32).reshape(batch, budget + 1),
        parents=np.array(parents, dtype=np.int32).reshape(batch, budget + 1),
        depths=np.array(depths, dtype=np.int32).reshape(batch, budget + 1),
        logw=np.array(logws, dtype=np.float32).reshape(batch, budget + 1),
        num_nodes=np.array(num_nodes, dtype=np.int32),
    )



def compile_retrieve(tree):
    """First-child / next-sibling arrays of a tree batch.

    Returns ``Retrieve(index, next_token, next_sibling)``, int32 ``[batch, N]``:
    ``next_token[k]`` is k's smallest-index child, ``next_sibling[k]`` the next larger-index
    child of k's parent, ``-1`` for none (always for padding; the root has no sibling);
    ``index[b, k] = b * N + k``.
    """
    t = tree_arrays(tree)
    batch, slots = t.parents.shape
    next_token = np.full((batch, slots), -1, dtype=np.int32)
    next_sibling = np.full((batch, slots), -1, dtype=np.int32)
    for b in range(batch):
        last_child = {}
        for k in range(1, int(t.num_nodes[b])):
            parent = int(t.parents[b, k])
            if parent in last_child:
                next_sibling[b, last_child[parent]] = k
            else:
                next_token[b, parent] = k
            last_child[parent] = k
    index = np.arange(batch * slots, dtype=np.int32).reshape(batch, slots)
    return Retrieve(index=index, next_token=next_token, next_sibling=next_sibling)


def tree_attention_mask(tree):
    """Bool ``[batch, N, N]``: ``mask[b, i, j]`` iff j is i or an ancestor of i.

    Padding nodes attend only to themselves; real nodes never attend to padding.
    """
    t = tree_arrays(tree)
    batch, slots = t.parents.shape
    mask = np.zeros((batch, slots, slots), dtype=bool)
    for b in range(batch):
        for i in range(slots):
            mask[b, i, i] = True
            if i >= int(t.num_nodes[b]):
                continue
            j = int(t.parents[b, i])
            while j >= 0:
                mask[b, i, j] = True
                j = int(t.parents[b, j])
    return mask


def tree_positions(tree, prefix_len):
    """Int32 ``[batch, N]`` positions ``prefix_len[b] + depth`` (padding sits at
    ``prefix_len[b]``). ``prefix_len`` is ``[batch]`` or a scalar."""
    t = tree_arrays(tree)
    batch = t.depths.shape[0]
    prefix_B = per_request("prefix_len", prefix_len, batch, np.int64)
    return (prefix_B[:, None] + t.depths).astype(np.int32)
