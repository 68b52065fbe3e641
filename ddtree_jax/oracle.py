"""NumPy reference of the DDTree core: tree construction, encoding, target law, verification (and
the routed-experts MLP of a Qwen3-MoE target).

Plain loops and a real heap, written for clarity rather than speed. This is the test reference:
the JAX implementation is tested against these functions, and nothing uses them at run time.
Conventions (docs/design.md, "Conventions"):

* A tree has ``N = budget + 1`` slots per request. Node 0 is the root (the round's input token,
  depth 0, ``logw = 0``); nodes ``1..num_nodes-1`` are the drafts in pop order of the best-first
  search; the remaining slots are padding (``token 0, parent -1, depth 0, logw -inf``).
* Depth ``d >= 1`` of the tree uses row ``d - 1`` of the draft logits.
* Children of a node are listed in ascending node index (= descending draft probability).
  The verification functions take any valid first-child / next-sibling encoding instead (links
  to any node in any order; ``_check_walk_inputs``) and follow its sibling lists.

All functions take anything ``np.asarray`` accepts and return NumPy arrays. Functions taking a
tree accept any object with the ``Tree`` attributes (so a JAX ``DraftTree`` can be passed).
"""

import heapq
from typing import NamedTuple

import numpy as np


class Tree(NamedTuple):
    """A batch of draft trees; every array has ``N = budget + 1`` slots per request."""

    tokens: np.ndarray  # int32 [batch, N]
    parents: np.ndarray  # int32 [batch, N], -1 for the root and padding
    depths: np.ndarray  # int32 [batch, N], 0 for the root and padding
    logw: np.ndarray  # float32 [batch, N], cumulative draft log-probability, -inf for padding
    num_nodes: np.ndarray  # int32 [batch], real nodes including the root


class Retrieve(NamedTuple):
    """First-child / next-sibling encoding of a tree batch, int32 ``[batch, N]``, -1 = none."""

    index: np.ndarray
    next_token: np.ndarray
    next_sibling: np.ndarray


class VerifyResult(NamedTuple):
    """Outcome of one verification step (local node ids, ``-1`` padded)."""

    accept_index: np.ndarray  # int32 [batch, max_depth + 1], root first
    num_accepted: np.ndarray  # int32 [batch], drafts accepted (root excluded)
    predicts: np.ndarray  # int32 [batch, N], token emitted after each accepted-path node
    emitted: np.ndarray  # int32 [batch, max_depth + 1], accepted drafts then the final token
    bonus: np.ndarray  # int32 [batch], the final token


# ----------------------------------------------------------------------------- validation


def _require_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _require_rank(name, array, rank):
    if array.ndim != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got shape {array.shape}")


def _require_shape(name, array, shape):
    if array.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {array.shape}")


def _per_request(name, value, batch, dtype):
    """A scalar or ``[batch]`` parameter as a ``[batch]`` array."""
    array = np.asarray(value, dtype=dtype)
    if array.ndim == 0:
        return np.full((batch,), array, dtype=dtype)
    _require_shape(name, array, (batch,))
    return array


def _tree_arrays(tree):
    """The tree's arrays as NumPy (accepts the oracle ``Tree`` or any object with its fields)."""
    return Tree(
        tokens=np.asarray(tree.tokens),
        parents=np.asarray(tree.parents),
        depths=np.asarray(tree.depths),
        logw=np.asarray(tree.logw),
        num_nodes=np.asarray(tree.num_nodes),
    )


# ----------------------------------------------------------------------------- construction


def draft_log_probs(logits_row, draft_temperature):
    """Float32 log-softmax of one ``[V]`` logits row at ``draft_temperature``, in the exact
    operation order the tree construction uses."""
    z = np.asarray(logits_row).astype(np.float32) / np.float32(draft_temperature)
    s = z - z.max()
    return s - np.log(np.sum(np.exp(s)))


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
    _require_rank("draft_logits", logits_BLV, 3)
    batch, depth_limit, vocab = logits_BLV.shape
    if depth_limit < 1 or vocab < 1:
        raise ValueError(f"draft_logits needs L >= 1 and V >= 1, got shape {logits_BLV.shape}")
    _require_shape("root_tokens", roots_B, (batch,))
    budget = _require_int("budget", budget, 1)
    width = min(budget, vocab)
    if topk_cap is not None:
        width = min(_require_int("topk_cap", topk_cap, 1), width)
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


# ----------------------------------------------------------------------------- encoding


def compile_retrieve(tree):
    """First-child / next-sibling arrays of a tree batch.

    Returns ``Retrieve(index, next_token, next_sibling)``, int32 ``[batch, N]``:
    ``next_token[k]`` is k's smallest-index child, ``next_sibling[k]`` the next larger-index
    child of k's parent, ``-1`` for none (always for padding; the root has no sibling);
    ``index[b, k] = b * N + k``.
    """
    t = _tree_arrays(tree)
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
    t = _tree_arrays(tree)
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
    t = _tree_arrays(tree)
    batch = t.depths.shape[0]
    prefix_B = _per_request("prefix_len", prefix_len, batch, np.int64)
    return (prefix_B[:, None] + t.depths).astype(np.int32)


# ----------------------------------------------------------------------------- target law


def _descending_order(probs_V, top_k):
    """Token ids by descending probability, ties to the smaller id; only the first ``top_k``
    when ``top_k > 0`` (found without sorting the whole row)."""
    if 0 < top_k < probs_V.size:
        threshold = np.partition(probs_V, probs_V.size - top_k)[probs_V.size - top_k]
        candidates = np.flatnonzero(probs_V >= threshold)
        return candidates[np.argsort(-probs_V[candidates], kind="stable")][:top_k]
    return np.argsort(-probs_V, kind="stable")


def _filtered_row(logits_V, temperature, top_k, top_p):
    """Float64 target distribution of one logits row (see ``target_probs``)."""
    logits_V = np.asarray(logits_V, dtype=np.float64)
    if temperature == 0:
        probs_V = np.zeros_like(logits_V)
        probs_V[np.argmax(logits_V)] = 1.0
        return probs_V
    z = logits_V / temperature
    e = np.exp(z - z.max())
    probs_V = e / e.sum()
    if top_k == 0 and top_p >= 1:
        return probs_V
    order = _descending_order(probs_V, top_k)
    if top_k > 0:
        kept_V = np.zeros_like(probs_V)
        kept_V[order] = probs_V[order]
        probs_V = kept_V / kept_V.sum()
    if top_p < 1:
        sorted_probs = probs_V[order]
        mass_before = np.concatenate([[0.0], np.cumsum(sorted_probs)[:-1]])
        probs_V[order[mass_before >= top_p]] = 0.0
        probs_V /= probs_V.sum()
    return probs_V


def target_probs(logits, temperature, top_k, top_p):
    """Target distributions after temperature, top-k and top-p, per request.

    Args:
      logits: ``[batch, N, V]`` or ``[batch, V]``.
      temperature: ``[batch]`` or scalar, ``>= 0``; ``0`` is greedy (one-hot at the argmax,
        ties to the smallest token id).
      top_k: ``[batch]`` or scalar int ``>= 0``; ``0`` = off.
      top_p: ``[batch]`` or scalar in ``(0, 1]``; ``1`` = off.

    For ``T > 0``: ``p = softmax(logits / T)``; tokens are ordered by descending ``p`` (ties to
    the smaller token id); top-k keeps the first ``top_k`` and renormalises; top-p then keeps
    the tokens whose preceding mass in that order is ``< top_p`` and renormalises. Computed in
    float64, returned as float32 with the shape of ``logits``.
    """
    logits_array = np.asarray(logits)
    if logits_array.ndim not in (2, 3):
        raise ValueError(f"logits must be [batch, N, V] or [batch, V], got {logits_array.shape}")
    batch = logits_array.shape[0]
    logits_BNV = logits_array.reshape(batch, -1, logits_array.shape[-1])
    temperature_B = _per_request("temperature", temperature, batch, np.float64)
    top_k_B = _per_request("top_k", top_k, batch, np.int64)
    top_p_B = _per_request("top_p", top_p, batch, np.float64)
    if not np.all(np.isfinite(temperature_B) & (temperature_B >= 0)):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if np.any(top_k_B < 0):
        raise ValueError(f"top_k must be >= 0, got {top_k!r}")
    if not np.all((top_p_B > 0) & (top_p_B <= 1)):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")

    probs_BNV = np.empty(logits_BNV.shape, dtype=np.float32)
    for b in range(batch):
        for n in range(logits_BNV.shape[1]):
            probs_BNV[b, n] = _filtered_row(
                logits_BNV[b, n], temperature_B[b], top_k_B[b], top_p_B[b]
            )
    return probs_BNV.reshape(logits_array.shape)


# ----------------------------------------------------------------------------- verification


def _children(first_child, next_sibling, node):
    child = int(first_child[node])
    while child >= 0:
        yield child
        child = int(next_sibling[child])


def _verify_result(paths, finals, slots, max_depth, candidates_BN):
    """Packs accepted paths (node ids, root first) and final tokens into a ``VerifyResult``."""
    batch = len(paths)
    accept_index = np.full((batch, max_depth + 1), -1, dtype=np.int32)
    predicts = np.full((batch, slots), -1, dtype=np.int32)
    emitted = np.full((batch, max_depth + 1), -1, dtype=np.int32)
    for b, (path, final) in enumerate(zip(paths, finals, strict=True)):
        following = [int(candidates_BN[b, node]) for node in path[1:]] + [final]
        accept_index[b, : len(path)] = path
        predicts[b, path] = following
        emitted[b, : len(following)] = following
    return VerifyResult(
        accept_index=accept_index,
        num_accepted=np.array([len(path) - 1 for path in paths], dtype=np.int32),
        predicts=predicts,
        emitted=emitted,
        bonus=np.array(finals, dtype=np.int32),
    )


def _descendants(first_child, next_sibling, node):
    """Every node reached from ``node`` by one or more links (first-child or next-sibling)."""
    seen, todo = set(), [node]
    while todo:
        k = todo.pop()
        for target in (int(first_child[k]), int(next_sibling[k])):
            if target >= 0 and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _check_request_links(b, first_child, next_sibling):
    """No cycle of links, and the walk from node 0 over first-child then next-sibling links meets
    no node twice. Nodes it never meets are not part of the tree (their links may point anywhere
    else)."""
    for node in range(len(first_child)):
        if node in _descendants(first_child, next_sibling, node):
            raise ValueError(f"next_token/next_sibling links of request {b} form a cycle "
                             f"through node {node}")
    met = [0]
    for parent in met:  # grows while iterating: breadth first over the tree
        for child in _children(first_child, next_sibling, parent):
            if child in met:
                raise ValueError(f"next_token/next_sibling links of request {b} reach node "
                                 f"{child} twice from node 0")
            met.append(child)


def _check_walk_inputs(candidates_BN, next_token_BN, next_sibling_BN, max_depth):
    _require_rank("candidates", candidates_BN, 2)
    _require_shape("next_token", next_token_BN, candidates_BN.shape)
    _require_shape("next_sibling", next_sibling_BN, candidates_BN.shape)
    slots = candidates_BN.shape[1]
    for name, links in (("next_token", next_token_BN), ("next_sibling", next_sibling_BN)):
        for b, k in zip(*np.nonzero((links < -1) | (links >= slots)), strict=True):
            raise ValueError(f"{name} links must be -1 or a node index < {slots}: "
                             f"{name}[{b}, {k}] = {links[b, k]} (request {b}, node {k})")
    # Requests with the same links share one check (sampling tests repeat one tree many times).
    _, first = np.unique(np.concatenate([next_token_BN, next_sibling_BN], axis=1), axis=0,
                         return_index=True)
    for b in np.sort(first):
        _check_request_links(int(b), next_token_BN[b], next_sibling_BN[b])
    return _require_int("max_depth", max_depth, 0)


def _residual(probs_V, rejected_tokens):
    """``relu(probs - rejected mass)`` in float64, or ``probs`` itself if that is all zero."""
    probs_V = np.asarray(probs_V, dtype=np.float64)
    residual_V = probs_V.copy()
    residual_V[list(rejected_tokens)] = 0.0
    return residual_V if residual_V.sum() > 0 else probs_V


def tree_rejection_sample(
    candidates, next_token, next_sibling, coins, final_coins, probs, *, max_depth
):
    """Exact tree rejection sampling (sgl-kernel ``tree_speculative_sampling_target_only``
    with thresholds 1), on local node ids.

    Args:
      candidates: int ``[batch, N]``, node tokens.
      next_token, next_sibling: int ``[batch, N]``, first-child / next-sibling links: each -1
        or a node id, no cycle, no node reached twice from node 0 (else ``ValueError`` naming
        the request and node); nodes not reached are ignored.
      coins: float ``[batch, N]`` in ``(0, 1]``; ``coins[k]`` chooses among k's children.
      final_coins: float ``[batch]`` in ``(0, 1]``, for the final token.
      probs: float ``[batch, N, V]``; row k is the target distribution after node k.
      max_depth: most drafts accepted.

    From the root, the children of the current node are walked in sibling-list order with
    ``acc += probs[cur, token(child)]`` (float64); the first child with ``coin <= acc`` is
    accepted and the walk continues from it with its own coin. When no child is accepted (or
    at a leaf, or after ``max_depth`` acceptances) the final token is the first ``t`` with
    ``cumsum(residual)[t] >= final_coin * sum(residual)``, where ``residual`` is the current
    row with the tokens of the children rejected in that last step zeroed (the row itself if
    nothing is left).
    """
    candidates_BN = np.asarray(candidates)
    next_token_BN = np.asarray(next_token)
    next_sibling_BN = np.asarray(next_sibling)
    coins_BN = np.asarray(coins, dtype=np.float64)
    final_coins_B = np.asarray(final_coins, dtype=np.float64)
    probs_BNV = np.asarray(probs)
    max_depth = _check_walk_inputs(candidates_BN, next_token_BN, next_sibling_BN, max_depth)
    batch, slots = candidates_BN.shape
    _require_shape("coins", coins_BN, (batch, slots))
    _require_shape("final_coins", final_coins_B, (batch,))
    _require_rank("probs", probs_BNV, 3)
    _require_shape("probs", probs_BNV, (batch, slots, probs_BNV.shape[-1]))
    for name, values in (("coins", coins_BN), ("final_coins", final_coins_B)):
        if not np.all((values > 0) & (values <= 1)):
            raise ValueError(f"{name} must lie in (0, 1], got values in "
                             f"[{values.min()}, {values.max()}]")

    paths, finals = [], []
    for b in range(batch):
        path, rejected = [0], set()
        while len(path) <= max_depth:
            cur, coin = path[-1], coins_BN[b, path[-1]]
            acc, accepted, rejected = 0.0, None, set()
            for child in _children(next_token_BN[b], next_sibling_BN[b], cur):
                token = int(candidates_BN[b, child])
                acc += float(probs_BNV[b, cur, token])
                if coin <= acc:
                    accepted = child
                    break
                rejected.add(token)
            if accepted is None:
                break
            path.append(accepted)
            rejected = set()
        cdf_V = np.cumsum(_residual(probs_BNV[b, path[-1]], rejected))
        finals.append(int(np.argmax(cdf_V >= final_coins_B[b] * cdf_V[-1])))
        paths.append(path)
    return _verify_result(paths, finals, slots, max_depth, candidates_BN)


def tree_greedy_verify(candidates, next_token, next_sibling, target_argmax, *, max_depth):
    """Greedy verification: from the root, accept the child whose token equals
    ``target_argmax[cur]`` (at most ``max_depth`` drafts); the bonus is ``target_argmax`` at
    the last accepted node. Inputs are int ``[batch, N]``, links as in
    ``tree_rejection_sample``; returns a ``VerifyResult``."""
    candidates_BN = np.asarray(candidates)
    next_token_BN = np.asarray(next_token)
    next_sibling_BN = np.asarray(next_sibling)
    argmax_BN = np.asarray(target_argmax)
    max_depth = _check_walk_inputs(candidates_BN, next_token_BN, next_sibling_BN, max_depth)
    _require_shape("target_argmax", argmax_BN, candidates_BN.shape)

    paths, finals = [], []
    for b in range(candidates_BN.shape[0]):
        path = [0]
        while len(path) <= max_depth:
            wanted = int(argmax_BN[b, path[-1]])
            match = next(
                (c for c in _children(next_token_BN[b], next_sibling_BN[b], path[-1])
                 if int(candidates_BN[b, c]) == wanted),
                None,
            )
            if match is None:
                break
            path.append(match)
        paths.append(path)
        finals.append(int(argmax_BN[b, path[-1]]))
    return _verify_result(paths, finals, candidates_BN.shape[1], max_depth, candidates_BN)


def verify(tree, target_logits, *, coins, final_coins, temperature, top_k, top_p, max_depth):
    """Verification step for a mixed greedy/sampled batch.

    ``target_logits`` ``[batch, N, V]`` (row k = target logits after node k) become
    ``target_probs`` (greedy requests, ``T = 0``, become one-hot rows, so the walk accepts
    exactly the argmax child and the final token is the argmax), then
    ``tree_rejection_sample`` on the tree's first-child / next-sibling links.
    """
    t = _tree_arrays(tree)
    retrieve = compile_retrieve(t)
    probs_BNV = target_probs(target_logits, temperature, top_k, top_p)
    return tree_rejection_sample(
        t.tokens, retrieve.next_token, retrieve.next_sibling, coins, final_coins, probs_BNV,
        max_depth=max_depth,
    )


# ----------------------------------------------------------------------------- exact laws


def expected_acceptance(tree, probs):
    """Float64 ``[batch]``: the sum over real non-root nodes of the target probability of
    their path, ``prod_e probs[parent(e), token(e)]`` over the edges root -> node. This is
    the exact expected number of accepted drafts when ``max_depth`` is at least the tree
    depth and siblings are distinct."""
    t = _tree_arrays(tree)
    probs_BNV = np.asarray(probs, dtype=np.float64)
    _require_shape("probs", probs_BNV, t.tokens.shape + probs_BNV.shape[-1:])
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
    t = _tree_arrays(tree)
    probs_NV = np.asarray(probs, dtype=np.float64)
    if t.tokens.shape[0] != 1:
        raise ValueError(f"emitted_law takes a batch-1 tree, got batch {t.tokens.shape[0]}")
    _require_shape("probs", probs_NV, t.tokens.shape + probs_NV.shape[-1:])
    probs_NV = probs_NV[0]
    max_depth = _require_int("max_depth", max_depth, 0)
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


def routed_experts(h_MD, router_DE, gate_up_EDJ, down_EID, *, top_k, normalize):
    """Float64 ``[M, D]``: the routed-experts MLP of a Qwen3-MoE layer, token by token (no
    residual). Router softmax over ``h @ router``; the ``top_k`` most probable experts, ties to
    the smaller id; their probabilities, renormalised to sum 1 when ``normalize``; the output is
    ``sum_e p_e * (silu(g) * u) @ down[e]`` with ``[g | u] = h @ gate_up[e]``."""
    h_MD, router_DE = np.asarray(h_MD, np.float64), np.asarray(router_DE, np.float64)
    gate_up_EDJ, down_EID = np.asarray(gate_up_EDJ, np.float64), np.asarray(down_EID, np.float64)
    out_MD = np.zeros_like(h_MD)
    for m, h_D in enumerate(h_MD):
        logits_E = h_D @ router_DE
        probs_E = np.exp(logits_E - logits_E.max())
        probs_E /= probs_E.sum()
        chosen = sorted(range(len(probs_E)), key=lambda e: (-probs_E[e], e))[:top_k]
        weights = probs_E[chosen] / (probs_E[chosen].sum() if normalize else 1.0)
        for e, weight in zip(chosen, weights):
            gate, up = np.split(h_D @ gate_up_EDJ[e], 2)
            out_MD[m] += weight * ((gate / (1.0 + np.exp(-gate)) * up) @ down_EID[e])
    return out_MD
