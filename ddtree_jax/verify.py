"""Tree verification: greedy walk and exact tree rejection sampling ("target-only").

One walk serves every case. From the root, at the current node with target row ``q`` and coin
``c``, the children are visited in sibling order (ascending node index) accumulating
``acc += q[token(child)]``; the first child with ``c <= acc`` is accepted and the walk continues
from it with its own coin. When no child is accepted (or at a leaf, or after ``max_depth``
acceptances) the final token is drawn from ``q`` with the rejected children's tokens removed,
renormalised, by inverse CDF with the request's final coin. These are the semantics of sgl-kernel's
``tree_speculative_sampling_target_only`` with both thresholds 1. Greedy verification is the same
walk on one-hot rows (a one-hot row accepts exactly the child holding the argmax, and the final
draw returns the argmax), which is how ``verify`` serves batches mixing greedy and sampled requests.

The walk computes a target row only for the nodes it visits: ``max_depth + 1`` rows per request
instead of ``N``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ddtree_jax import checks
from ddtree_jax.sampling import coins_from_keys, request_keys, row_probs
from ddtree_jax.tree import DraftTree, ancestor_ids


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


@dataclasses.dataclass(frozen=True)
class _ProbRow:
    """A batch of target rows given as probabilities ``q_BV``."""

    q_BV: Float[Array, "B V"]

    def mass(self, tokens_BN):
        return jnp.take_along_axis(self.q_BV, tokens_BN, axis=1)

    def draw(self, rejected_BN, tokens_BN, coin_B):
        vocab = self.q_BV.shape[1]
        rows = jnp.arange(tokens_BN.shape[0])[:, None]
        drop = jnp.where(rejected_BN, tokens_BN, vocab)  # vocab = out of range, dropped
        residual = self.q_BV.at[rows, drop].set(0.0, mode="drop")
        residual = jnp.where(jnp.sum(residual, 1, keepdims=True) > 0, residual, self.q_BV)
        cdf = jnp.cumsum(residual, axis=1)
        return jnp.argmax(cdf >= coin_B[:, None] * cdf[:, -1:], axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _ArgmaxRow:
    """A batch of one-hot target rows given by their argmax token."""

    argmax_B: Int[Array, " B"]

    def mass(self, tokens_BN):
        return (tokens_BN == self.argmax_B[:, None]).astype(jnp.float32)

    def draw(self, rejected_BN, tokens_BN, coin_B):
        return self.argmax_B


def _walk(
    tokens_BN: Int[Array, "B N"],
    parents_BN: Int[Array, "B N"],
    coins_BN: Float[Array, "B N"],
    final_coins_B: Float[Array, " B"],
    row_at: Callable[[Int[Array, " B"]], _ProbRow | _ArgmaxRow],
    max_depth: int,
) -> VerifyResult:
    batch, n = tokens_BN.shape
    rows = jnp.arange(batch)
    node_ids = jnp.arange(n, dtype=jnp.int32)[None, :]

    def children(cur):
        return (parents_BN == cur[:, None]) & (node_ids > 0)

    def step(t, state):
        cur, active, accept, predicts, emitted = state
        is_child = children(cur) & active[:, None]
        acc = jnp.cumsum(jnp.where(is_child, row_at(cur).mass(tokens_BN), 0.0), axis=1)
        hit = is_child & (coins_BN[rows, cur][:, None] <= acc)
        took = jnp.any(hit, axis=1)
        child = jnp.argmax(hit, axis=1).astype(jnp.int32)
        token = tokens_BN[rows, child]
        accept = accept.at[:, t + 1].set(jnp.where(took, child, -1))
        emitted = emitted.at[:, t].set(jnp.where(took, token, -1))
        predicts = predicts.at[rows, cur].set(jnp.where(took, token, predicts[rows, cur]))
        return jnp.where(took, child, cur), active & took, accept, predicts, emitted

    init = (
        jnp.zeros((batch,), jnp.int32),
        jnp.ones((batch,), bool),
        jnp.full((batch, max_depth + 1), -1, jnp.int32).at[:, 0].set(0),
        jnp.full((batch, n), -1, jnp.int32),
        jnp.full((batch, max_depth + 1), -1, jnp.int32),
    )
    cur, active, accept, predicts, emitted = jax.lax.fori_loop(0, max_depth, step, init, unroll=True)
    num_accepted = jnp.sum(accept >= 0, axis=1, dtype=jnp.int32) - 1
    # A walk that stopped early rejected every child of its last node; one that ran out of depth
    # examined none of them.
    rejected = children(cur) & ~active[:, None]
    bonus = row_at(cur).draw(rejected, tokens_BN, final_coins_B)
    emitted = emitted.at[rows, num_accepted].set(bonus)
    predicts = predicts.at[rows, cur].set(bonus)
    return VerifyResult(accept, num_accepted, predicts, emitted, bonus)


def parents_from_fcns(next_token_BN: Int[Array, "B N"], next_sibling_BN: Int[Array, "B N"]) -> Int[Array, "B N"]:
    """Parent array from first-child/next-sibling links (``-1`` for the root and unreachable nodes).

    Each node's leftmost sibling is found by pointer doubling (``log2 N`` steps); its parent is the
    node whose ``next_token`` points at that leftmost sibling.
    """
    batch, n = next_token_BN.shape
    rows = jnp.arange(batch)[:, None]
    nodes = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    out_of_range = lambda x: jnp.where(x >= 0, x, n)  # noqa: E731
    left = jnp.full((batch, n), -1, jnp.int32).at[rows, out_of_range(next_sibling_BN)].set(nodes, mode="drop")
    first_of = jnp.full((batch, n), -1, jnp.int32).at[rows, out_of_range(next_token_BN)].set(nodes, mode="drop")
    leftmost = jnp.where(left >= 0, left, nodes)
    for _ in range(max(1, int(np.ceil(np.log2(n))))):
        leftmost = jnp.take_along_axis(leftmost, leftmost, axis=1)
    return jnp.take_along_axis(first_of, leftmost, axis=1)


def _check_fcns(candidates, next_token, next_sibling) -> None:
    """Concrete-input checks of the low-level samplers' tree arguments."""
    n = candidates.shape[1]
    for name, x in (("next_token", next_token), ("next_sibling", next_sibling)):
        checks.array(name, x, ndim=2, kind="int")
        checks.same_leading(name, x, candidates.shape)
        if checks.is_concrete(x):
            host = np.asarray(x)
            nodes = np.arange(n)[None, :]
            if np.any((host != -1) & ((host <= nodes) | (host >= n))):
                raise ValueError(f"{name} links must point to a larger node index < {n} or be -1")
    if checks.is_concrete(next_token) and checks.is_concrete(next_sibling):
        parents = np.asarray(parents_from_fcns(jnp.asarray(next_token), jnp.asarray(next_sibling)))
        cand = np.asarray(candidates)
        for b in range(cand.shape[0]):
            for p in np.unique(parents[b][parents[b] >= 0]):
                toks = cand[b][parents[b] == p]
                if len(np.unique(toks)) != len(toks):
                    raise ValueError(
                        f"candidates: node {p} of request {b} has duplicate child tokens {toks.tolist()}"
                    )


@functools.partial(jax.jit, static_argnames="max_depth")
def _rejection_sample(candidates, next_token, next_sibling, coins, final_coins, probs, *, max_depth):
    parents = parents_from_fcns(next_token, next_sibling)
    rows = jnp.arange(candidates.shape[0])
    return _walk(candidates, parents, coins, final_coins, lambda cur: _ProbRow(probs[rows, cur]), max_depth)


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
      next_token, next_sibling: int ``[batch, N]`` first-child/next-sibling links, children in
        ascending index (as ``compile_retrieve`` produces), ``-1`` = none.
      coins: ``[batch, N]`` in ``(0, 1]``; the coin of node ``k`` chooses among ``k``'s children.
      final_coins: ``[batch]`` in ``(0, 1]`` for the final (bonus) draw.
      probs: ``[batch, N, V]`` target distribution after each node.
      max_depth: at most this many drafts are accepted.

    Checks: shapes, dtypes and ``max_depth`` always; when concrete, link order, coin range, token
    ids ``< V``, finite probabilities and distinct sibling tokens.
    """
    candidates = checks.array("candidates", candidates, ndim=2, kind="int")
    probs = checks.array("probs", probs, ndim=3, kind="float")
    coins = checks.array("coins", coins, ndim=2, kind="float")
    final_coins = checks.array("final_coins", final_coins, ndim=1, kind="float")
    checks.same_leading("probs", probs, candidates.shape)
    checks.same_leading("coins", coins, candidates.shape)
    checks.same_leading("final_coins", final_coins, candidates.shape[:1])
    max_depth = checks.positive_int("max_depth", max_depth, minimum=0)
    _check_fcns(candidates, next_token, next_sibling)
    checks.token_range("candidates", candidates, probs.shape[2])
    checks.finite("probs", probs)
    for name, c in (("coins", coins), ("final_coins", final_coins)):
        if checks.is_concrete(c) and not bool(jnp.all((c > 0) & (c <= 1))):
            raise ValueError(f"{name} must lie in (0, 1]")
    return _rejection_sample(
        candidates, next_token, next_sibling, coins, final_coins, probs, max_depth=max_depth
    )


@functools.partial(jax.jit, static_argnames="max_depth")
def _greedy_verify(candidates, next_token, next_sibling, target_argmax, *, max_depth):
    return _argmax_walk(candidates, parents_from_fcns(next_token, next_sibling), target_argmax, max_depth)


def _argmax_walk(tokens_BN, parents_BN, argmax_BN, max_depth: int) -> VerifyResult:
    """The walk on one-hot rows given each node's target argmax (coins cannot change its outcome)."""
    rows = jnp.arange(tokens_BN.shape[0])
    ones = jnp.ones(tokens_BN.shape, jnp.float32)
    return _walk(tokens_BN, parents_BN, ones, ones[:, 0], lambda cur: _ArgmaxRow(argmax_BN[rows, cur]), max_depth)


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
    _check_fcns(candidates, next_token, next_sibling)
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
    """Step 5 of a round for a mixed greedy/sampled batch, given the coins (no validation).

    Computes the processed target row (``sampling.row_probs``) only at the nodes the walk visits.
    An all-greedy batch instead takes every node's argmax in one pass and walks on those (the same
    walk on one-hot rows, without a dependent vocabulary pass per step). Traceable; the engine
    calls it inside its jitted round.
    """
    rows = jnp.arange(tree.tokens.shape[0])

    def greedy():
        argmax_BN = jnp.argmax(target_logits_BNV, axis=-1).astype(jnp.int32)
        return _argmax_walk(tree.tokens, tree.parents, argmax_BN, tree.max_depth)

    def sampled():
        row_at = lambda cur: _ProbRow(row_probs(target_logits_BNV[rows, cur], temperature_B, top_k_B, top_p_B))  # noqa: E731
        return _walk(tree.tokens, tree.parents, coins_BN, final_coins_B, row_at, tree.max_depth)

    return jax.lax.cond(jnp.all(temperature_B <= 0), greedy, sampled)


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
      request_ids: int ``[batch]`` (default ``arange(batch)``); round_index: int.

    Checks: shapes and parameter ranges always; finite logits when concrete (the walk would
    otherwise turn NaN into arbitrary tokens).
    """
    target_logits = checks.array("target_logits", target_logits, ndim=3, kind="float")
    checks.same_leading("target_logits", target_logits, tree.tokens.shape)
    batch = target_logits.shape[0]
    t, k, p = checks.sampling_params(temperature, top_k, top_p, batch)
    if request_ids is None:
        request_ids = jnp.arange(batch, dtype=jnp.int32)
    request_ids = checks.array("request_ids", request_ids, ndim=1, kind="int")
    checks.same_leading("request_ids", request_ids, (batch,))
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
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree must be a DraftTree, got {type(tree).__name__}")
    probs = checks.array("probs", probs, ndim=3, kind="float")
    checks.same_leading("probs", probs, tree.tokens.shape)
    checks.token_range("tree.tokens", tree.tokens, probs.shape[2])
    checks.distributions("probs", probs)
    return _expected_acceptance(tree, probs)
