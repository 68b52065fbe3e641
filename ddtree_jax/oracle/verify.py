"""Greedy verification and exact tree rejection sampling over first-child / next-sibling links."""

import numpy as np

from ddtree_jax.oracle._checks import require_int, require_rank, require_shape, tree_arrays
from ddtree_jax.oracle.law import target_probs
from ddtree_jax.oracle.tree import compile_retrieve
from ddtree_jax.oracle.types import VerifyResult


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
    require_rank("candidates", candidates_BN, 2)
    require_shape("next_token", next_token_BN, candidates_BN.shape)
    require_shape("next_sibling", next_sibling_BN, candidates_BN.shape)
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
    return require_int("max_depth", max_depth, 0)


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
    require_shape("coins", coins_BN, (batch, slots))
    require_shape("final_coins", final_coins_B, (batch,))
    require_rank("probs", probs_BNV, 3)
    require_shape("probs", probs_BNV, (batch, slots, probs_BNV.shape[-1]))
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
    require_shape("target_argmax", argmax_BN, candidates_BN.shape)

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
    t = tree_arrays(tree)
    retrieve = compile_retrieve(t)
    probs_BNV = target_probs(target_logits, temperature, top_k, top_p)
    return tree_rejection_sample(
        t.tokens, retrieve.next_token, retrieve.next_sibling, coins, final_coins, probs_BNV,
        max_depth=max_depth,
    )
