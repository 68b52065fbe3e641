"""Tree verification: greedy walk and exact tree rejection sampling ("target-only").

The walk itself (sgl-kernel's ``tree_speculative_sampling_target_only`` with both thresholds 1,
greedy requests walking one-hot rows) is specified in ``pallas_kernels.tree_sampling.reference``,
which returns the accepted path and the emitted tokens; this module validates the public
entry points and turns a path into a ``VerifyResult`` (``result_from_path``), whichever
implementation produced it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ddtree_jax import checks
from ddtree_jax.sampling import coins_from_keys, request_keys
from ddtree_jax.tree import DraftTree, ancestor_ids, check_tree
from pallas_kernels.tree_sampling import reference


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["accept_index", "num_accepted", "predicts", "emitted", "bonus"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one tree per request.

    Attributes:
      accept_index: int32 ``[batch, max_depth + 1]`` local node ids of the accepted path, root first,
        ``-1`` padded.
      num_accepted: int32 ``[batch]`` drafts accepted (root excluded).
      predicts: int32 ``[batch, N]`` for every node of the accepted path the token emitted after
        it, ``-1`` elsewhere.
      emitted: int32 ``[batch, max_depth + 1]`` the accepted drafts then the final token, ``-1``
        padded.
      bonus: int32 ``[batch]`` the final token (the next round's root).
    """

    accept_index: Int[Array, "B D"]
    num_accepted: Int[Array, " B"]
    predicts: Int[Array, "B N"]
    emitted: Int[Array, "B D"]
    bonus: Int[Array, " B"]


def result_from_path(accept_index_BD: Int[Array, "B D"], emitted_BD: Int[Array, "B D"],
                     num_nodes: int) -> VerifyResult:
    """``VerifyResult`` from the accepted path and the emitted tokens (final token included) of a
    walk over trees of ``num_nodes`` nodes (``[B, max_depth + 1]`` each, ``-1`` padded)."""
    num_accepted = jnp.sum(accept_index_BD >= 0, axis=1, dtype=jnp.int32) - 1
    rows = jnp.arange(accept_index_BD.shape[0])[:, None]
    slots = jnp.where(accept_index_BD >= 0, accept_index_BD, num_nodes)
    predicts = jnp.full((accept_index_BD.shape[0], num_nodes), -1, jnp.int32).at[rows, slots].set(
        emitted_BD, mode="drop")
    bonus = jnp.take_along_axis(emitted_BD, num_accepted[:, None], axis=1)[:, 0]
    return VerifyResult(accept_index_BD, num_accepted, predicts, emitted_BD, bonus)


def _doubling_steps(n: int) -> int:
    """Pointer-doubling rounds that cover any chain of ``n`` nodes (``2**steps >= n``)."""
    return max(1, int(np.ceil(np.log2(n))))


def _reached_from_root(next_token_BN: Int[Array, "B N"], next_sibling_BN: Int[Array, "B N"]) -> Array:
    """bool ``[B, N]``: the nodes reached from node 0 along the links (node 0 included).

    The one-step reachability matrix is squared ``log2 N`` times (a path from the root is at most
    ``N - 1`` links long): ``B N^3 log2 N`` flops in matrix products, small at the tree sizes that
    are verified. Nodes that are not reached may hold links of their own (even into the tree); they
    belong to no tree, so their links are ignored.
    """
    n = next_token_BN.shape[1]
    step = jax.nn.one_hot(next_token_BN, n) + jax.nn.one_hot(next_sibling_BN, n)  # -1: a zero row
    reach = jnp.minimum(step + jnp.eye(n), 1.0)
    for _ in range(_doubling_steps(n)):
        reach = jnp.minimum(reach @ reach, 1.0)
    return reach[:, 0] > 0


def parents_and_sibling_ranks(next_token_BN: Int[Array, "B N"],
                              next_sibling_BN: Int[Array, "B N"]) -> tuple[Int[Array, "B N"], Int[Array, "B N"]]:
    """Each node's parent and its position in its parent's list of children, from first-child /
    next-sibling links (any valid encoding: links may point to any node, in any order).

    Returns ``(parents_BN, sibling_rank_BN)``, int32: parent ``-1`` for the root and for nodes not
    reached from the root (rank 0 there). Links of unreached nodes are dropped first, so every node
    has at most one incoming link; then pointer doubling (``log2 N`` rounds) along the reversed
    sibling links finds each node's leftmost sibling and its distance to it (the rank), and the
    parent is the node whose ``next_token`` is that leftmost sibling. Traceable; the result is
    meaningful for valid encodings only (``_check_fcns``).
    """
    batch, n = next_token_BN.shape
    rows = jnp.arange(batch)[:, None]
    nodes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    reached = _reached_from_root(next_token_BN, next_sibling_BN)
    slots = lambda links: jnp.where(reached & (links >= 0), links, n)  # noqa: E731  (n: dropped)
    left = jnp.full((batch, n), -1, jnp.int32).at[rows, slots(next_sibling_BN)].set(nodes, mode="drop")
    first_of = jnp.full((batch, n), -1, jnp.int32).at[rows, slots(next_token_BN)].set(nodes, mode="drop")
    leftmost = jnp.where(left >= 0, left, nodes)
    rank, up = (left >= 0).astype(jnp.int32), left
    for _ in range(_doubling_steps(n)):
        leftmost = jnp.take_along_axis(leftmost, leftmost, axis=1)
        rank = rank + jnp.where(up >= 0, jnp.take_along_axis(rank, jnp.maximum(up, 0), axis=1), 0)
        up = jnp.where(up >= 0, jnp.take_along_axis(up, jnp.maximum(up, 0), axis=1), -1)
    return jnp.take_along_axis(first_of, leftmost, axis=1), rank


@jax.jit  # one program per shape when the samplers' checks call it on concrete links, not one per op
def parents_from_fcns(next_token_BN: Int[Array, "B N"], next_sibling_BN: Int[Array, "B N"]) -> Int[Array, "B N"]:
    """Parent array from first-child/next-sibling links (``-1`` for the root and unreachable nodes);
    the inverse of ``compile_retrieve`` and of any other valid encoding (``parents_and_sibling_ranks``)."""
    return parents_and_sibling_ranks(next_token_BN, next_sibling_BN)[0]


def _node_on_cycle(next_token_N: np.ndarray, next_sibling_N: np.ndarray) -> int | None:
    """A node on a cycle of links, or None: peel nodes without incoming links (Kahn); every node
    left has an incoming link from another one left, so stepping back ``N`` times lands on a cycle."""
    n = next_token_N.shape[0]
    out = [[int(j) for j in (next_token_N[k], next_sibling_N[k]) if j >= 0] for k in range(n)]
    incoming = np.zeros(n, np.int64)
    for targets in out:
        np.add.at(incoming, targets, 1)  # both links of a node may point to the same node
    free = [k for k in range(n) if incoming[k] == 0]
    while free:
        for j in out[free.pop()]:
            incoming[j] -= 1
            if incoming[j] == 0:
                free.append(j)
    if not incoming.any():
        return None
    back = {j: k for k in range(n) if incoming[k] > 0 for j in out[k] if incoming[j] > 0}
    node = int(np.flatnonzero(incoming)[0])
    for _ in range(n):
        node = back[node]
    return node


def _check_request_links(b: int, next_token_N: np.ndarray, next_sibling_N: np.ndarray) -> None:
    """Raise unless request ``b``'s links are acyclic and reach no node twice from node 0."""
    cycle = _node_on_cycle(next_token_N, next_sibling_N)
    if cycle is not None:
        raise ValueError(f"next_token/next_sibling links of request {b} form a cycle through node {cycle}")
    via, todo = {0: "as the root"}, [0]
    while todo:
        k = todo.pop()
        for name, links in (("next_token", next_token_N), ("next_sibling", next_sibling_N)):
            j = int(links[k])
            if j < 0:
                continue
            if j in via:
                raise ValueError(f"next_token/next_sibling links of request {b} reach node {j} twice from node 0 "
                                 f"({via[j]} and by {name}[{k}]); a node has one parent and one place among "
                                 f"its siblings")
            via[j] = f"by {name}[{k}]"
            todo.append(j)


def _check_fcns(candidates, next_token, next_sibling) -> tuple:
    """The low-level samplers' link arguments ``(next_token, next_sibling)`` as arrays, checked: rank,
    dtype and shape always; when concrete, links in range or ``-1``, no cycle, no node reached twice from
    node 0, distinct tokens among siblings."""
    n = candidates.shape[1]
    next_token = checks.array("next_token", next_token, ndim=2, kind="int")
    next_sibling = checks.array("next_sibling", next_sibling, ndim=2, kind="int")
    for name, x in (("next_token", next_token), ("next_sibling", next_sibling)):
        checks.same_leading(name, x, candidates.shape)
        if checks.is_concrete(x):
            host = np.asarray(x)
            bad = np.argwhere((host < -1) | (host >= n))
            if bad.size:
                b, k = bad[0]
                raise ValueError(f"{name} links must be -1 or a node index < {n}: {name}[{b}, {k}] = {host[b, k]} "
                                 f"(request {b}, node {k})")
    if not (checks.is_concrete(next_token) and checks.is_concrete(next_sibling)):
        return next_token, next_sibling
    links = np.concatenate([np.asarray(next_token), np.asarray(next_sibling)], axis=1)
    _, first = np.unique(links, axis=0, return_index=True)  # each distinct encoding once
    for b in np.sort(first):
        _check_request_links(int(b), links[b, :n], links[b, n:])
    parents = np.asarray(parents_from_fcns(jnp.asarray(next_token), jnp.asarray(next_sibling)))
    cand = np.asarray(candidates)
    for b in range(cand.shape[0]):
        for p in np.unique(parents[b][parents[b] >= 0]):
            toks = cand[b][parents[b] == p]
            if len(np.unique(toks)) != len(toks):
                raise ValueError(
                    f"candidates: node {p} of request {b} has duplicate child tokens {toks.tolist()}"
                )
    return next_token, next_sibling


@functools.partial(jax.jit, static_argnames="max_depth")
def _rejection_sample(candidates, next_token, next_sibling, coins, final_coins, probs, *, max_depth):
    parents, ranks = parents_and_sibling_ranks(next_token, next_sibling)
    rows = jnp.arange(candidates.shape[0])
    path = reference.walk(candidates, parents, coins, final_coins, lambda cur: reference.ProbRow(probs[rows, cur]),
                          max_depth, ranks)
    return result_from_path(*path, candidates.shape[1])


def tree_rejection_sample(
    candidates: Int[Array, "B N"],
    next_token: Int[Array, "B N"],
    next_sibling: Int[Array, "B N"],
    coins: Float[Array, "B N"],
    final_coins: Float[Array, " B"],
    probs: Float[Array, "B N V"],
    *,
    max_depth: int,
) -> VerifyResult:
    """Tree rejection sampling on local node indices (sgl-kernel semantics, thresholds 1).

    Args:
      candidates: int ``[batch, N]`` node tokens (node 0 = root).
      next_token, next_sibling: int ``[batch, N]`` first-child/next-sibling links, ``-1`` = none.
        Any valid encoding: links point to any node in any order, as long as no link leaves
        ``[0, N)``, no links form a cycle and no node is reached twice from node 0 (nodes not
        reached are ignored). Children are visited in their sibling-list order.
      coins: ``[batch, N]`` in ``(0, 1]``; the coin of node ``k`` chooses among ``k``'s children.
      final_coins: ``[batch]`` in ``(0, 1]`` for the final (bonus) draw.
      probs: ``[batch, N, V]`` target distribution after each node.
      max_depth: at most this many drafts are accepted.

    Checks: shapes, dtypes and ``max_depth`` always; when concrete, the links (above; the error
    names the request and node), coin range, token ids ``< V``, every row of ``probs`` a distribution
    (finite, in ``[0, 1]``, summing to 1) and distinct sibling tokens.
    """
    candidates = checks.array("candidates", candidates, ndim=2, kind="int")
    probs = checks.array("probs", probs, ndim=3, kind="float")
    coins = checks.array("coins", coins, ndim=2, kind="float")
    final_coins = checks.array("final_coins", final_coins, ndim=1, kind="float")
    checks.same_leading("probs", probs, candidates.shape)
    checks.same_leading("coins", coins, candidates.shape)
    checks.same_leading("final_coins", final_coins, candidates.shape[:1])
    max_depth = checks.positive_int("max_depth", max_depth, minimum=0)
    next_token, next_sibling = _check_fcns(candidates, next_token, next_sibling)
    checks.token_range("candidates", candidates, probs.shape[2])
    checks.distributions("probs", probs)
    for name, c in (("coins", coins), ("final_coins", final_coins)):
        if checks.is_concrete(c) and not bool(jnp.all((c > 0) & (c <= 1))):
            raise ValueError(f"{name} must lie in (0, 1]")
    return _rejection_sample(
        candidates, next_token, next_sibling, coins, final_coins, probs, max_depth=max_depth
    )


@functools.partial(jax.jit, static_argnames="max_depth")
def _greedy_verify(candidates, next_token, next_sibling, target_argmax, *, max_depth):
    parents, ranks = parents_and_sibling_ranks(next_token, next_sibling)
    path = reference.argmax_walk(candidates, parents, target_argmax, max_depth, ranks)
    return result_from_path(*path, candidates.shape[1])


def tree_greedy_verify(
    candidates: Int[Array, "B N"],
    next_token: Int[Array, "B N"],
    next_sibling: Int[Array, "B N"],
    target_argmax: Int[Array, "B N"],
    *,
    max_depth: int,
) -> VerifyResult:
    """Greedy verification: follow the child whose token is the target argmax at each node.

    ``target_argmax[b, k]`` is the target's argmax after node ``k``; the bonus is the argmax at the
    last accepted node. Arguments and checks as ``tree_rejection_sample``.
    """
    candidates = checks.array("candidates", candidates, ndim=2, kind="int")
    target_argmax = checks.array("target_argmax", target_argmax, ndim=2, kind="int")
    checks.same_leading("target_argmax", target_argmax, candidates.shape)
    max_depth = checks.positive_int("max_depth", max_depth, minimum=0)
    next_token, next_sibling = _check_fcns(candidates, next_token, next_sibling)
    checks.non_negative("target_argmax", target_argmax, "token ids >= 0")
    return _greedy_verify(candidates, next_token, next_sibling, target_argmax, max_depth=max_depth)


def verify_from_coins(
    tree: DraftTree,
    target_logits_BNV: Float[Array, "B N V"],
    coins_BN: Float[Array, "B N"],
    final_coins_B: Float[Array, " B"],
    temperature_B: Float[Array, " B"],
    top_k_B: Int[Array, " B"],
    top_p_B: Float[Array, " B"],
) -> VerifyResult:
    """Step 5 of a round for a mixed greedy/sampled batch, given the coins (no validation):
    ``pallas_kernels.tree_sampling.reference.tree_sample_reference`` as a ``VerifyResult``.
    Traceable; the engine calls it inside its jitted round.
    """
    path = reference.tree_sample_reference(tree.tokens, tree.parents, target_logits_BNV, coins_BN, final_coins_B,
                                           temperature_B, top_k_B, top_p_B, max_depth=tree.max_depth)
    return result_from_path(*path, tree.tokens.shape[1])


@jax.jit
def _verify(tree, target_logits, key, request_ids, round_index, temperature, top_k, top_p):
    keys = request_keys(key, request_ids, round_index)
    coins, final_coins = coins_from_keys(keys, tree.tokens.shape[1])
    return verify_from_coins(tree, target_logits, coins, final_coins, temperature, top_k, top_p)


def verify(
    tree: DraftTree,
    target_logits: Float[Array, "B N V"],
    *,
    key: jax.Array,
    temperature,
    top_k=0,
    top_p=1.0,
    request_ids=None,
    round_index=0,
) -> VerifyResult:
    """Verify a batch of trees against the target's logits at every node (greedy and sampled mixed).

    Args:
      tree: the drafted trees (``N`` nodes each).
      target_logits: ``[batch, N, V]`` target logits after each node.
      key: a ``jax.random`` key; request ``b`` draws its coins from
        ``fold_in(fold_in(key, request_ids[b]), round_index)``, so its result does not depend on the
        rest of the batch.
      temperature, top_k, top_p: scalars or ``[batch]`` (``temperature = 0`` is greedy).
      request_ids: int ``[batch]`` in ``[0, 2**31)`` (default ``arange(batch)``); round_index: int.

    Checks: shapes and parameter ranges always; finite logits when concrete (the walk would
    otherwise turn NaN into arbitrary tokens).
    """
    check_tree(tree)
    if key is None:
        raise ValueError("key must be a jax.random key such as jax.random.key(0), got None")
    checks.random_key("key", key)
    index = np.asarray(round_index) if checks.is_concrete(round_index) else None
    if index is not None and not (index.ndim == 0 and index.dtype.kind in "iu" and index >= 0):
        raise ValueError(f"round_index must be an integer >= 0, got {round_index!r}")
    target_logits = checks.array("target_logits", target_logits, ndim=3, kind="float")
    checks.same_leading("target_logits", target_logits, tree.tokens.shape)
    batch = target_logits.shape[0]
    t, k, p = checks.sampling_params(temperature, top_k, top_p, batch)
    if request_ids is None:
        request_ids = jnp.arange(batch, dtype=jnp.int32)
    request_ids = checks.array("request_ids", request_ids, ndim=1, kind="int")
    checks.same_leading("request_ids", request_ids, (batch,))
    if checks.is_concrete(request_ids):
        checks.int_ids("request_ids", request_ids, low=0, high=2**31)
    checks.finite("target_logits", target_logits)
    return _verify(tree, target_logits, key, request_ids, jnp.int32(round_index), t, k, p)


def path_probs(tree: DraftTree, edge_probs_BN: Float[Array, "B N"]) -> Float[Array, "B N"]:
    """Product of ``edge_probs`` over each node's root-to-node path (1 at the root, 0 for padding).

    ``edge_probs[b, j]`` is the target probability of node ``j``'s token under its parent's row.
    """
    ids = ancestor_ids(tree.parents, tree.max_depth)
    real = jnp.take_along_axis(edge_probs_BN, jnp.maximum(ids, 0).reshape(ids.shape[0], -1), 1)
    factors = jnp.where(ids > 0, real.reshape(ids.shape), 1.0)
    return jnp.where(tree.parents >= 0, jnp.prod(factors, axis=-1), 0.0).at[:, 0].set(1.0)


@jax.jit
def _expected_acceptance(tree: DraftTree, probs: Float[Array, "B N V"]) -> Float[Array, " B"]:
    """`expected_acceptance` without its checks."""
    rows = jnp.arange(tree.tokens.shape[0])[:, None]
    edge = probs[rows, jnp.maximum(tree.parents, 0), tree.tokens]
    return jnp.sum(path_probs(tree, edge)[:, 1:], axis=1)


def expected_acceptance(tree: DraftTree, probs: Float[Array, "B N V"]) -> Float[Array, " B"]:
    """Exact expected number of accepted drafts: the sum over non-root nodes of their path probability.

    ``probs[b, k]`` is the target distribution after node ``k`` (``target_probs`` of the verify
    logits). Under the walk above, node ``j`` is accepted with probability equal to the product of
    ``probs[parent(e), token(e)]`` over the edges ``e`` of its path, because siblings hold distinct
    tokens.

    Checks: ``probs`` is float ``[batch, N, V]`` matching the tree; when concrete, the tree's tokens
    lie in ``[0, V)`` and every row of ``probs`` is a distribution (finite, in ``[0, 1]``, summing to 1).
    """
    check_tree(tree)
    probs = checks.array("probs", probs, ndim=3, kind="float")
    checks.same_leading("probs", probs, tree.tokens.shape)
    checks.token_range("tree.tokens", tree.tokens, probs.shape[2])
    checks.distributions("probs", probs)
    return _expected_acceptance(tree, probs)
