"""DDTree construction and its encodings (first-child/next-sibling, attention mask, positions).

Conventions (docs/design.md, "Conventions"). Node 0 is the root (the round's input token). The
budget ``B`` counts non-root nodes and every tree array has ``N = B + 1`` slots. Nodes are stored
in the pop order of the best-first search: non-increasing cumulative draft log-probability
``logw``, ties broken towards the lexicographically smaller *rank tuple* (the per-depth rank of
each token on the path, where rank = position in the depth's order by descending probability, ties
by smaller token id). So a parent always precedes its children and siblings appear by descending
draft probability.
Unused slots are padding: ``parent = -1``, ``depth = 0``, ``token = 0``, ``logw = -inf``.

``build_tree`` computes the heap's result without a heap. The drafter's per-depth distributions do
not depend on the prefix, so the best ``B`` prefixes of depth ``d`` extend the best ``B`` prefixes
of depth ``d - 1``: a width-``B`` beam per depth, then one global order by (-logw, rank tuple),
gives exactly the best-first pop order in about ``L`` fixed-shape steps.

No step sorts (`ddtree_jax.selection`): on a GPU the per-depth top-``K`` tokens come from an exact
staged top-k (group maxima, then the entries of the best groups), and each ordering (a depth's
candidates by (``-logw``, rank tuple), the global order) is a rank counted from pairwise comparisons,
one fused reduction, followed by a selection of the entries ranked first, another. Counting costs
``P^2`` comparisons for ``P`` entries: about ``(B ln B)^2`` per depth and ``(L B)^2`` for the global
order, small next to a sort's kernel launches up to ``B`` of about a thousand and quadratic beyond.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from ddtree_jax import checks, selection
from pallas_kernels.tree_build import beam_pairs, rank_packing

MAX_BUDGET = 32768  # keeps the sorted beam's (parent lex position * K + rank) key inside int32


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "parents", "depths", "logw", "num_nodes"],
    meta_fields=["max_depth"],
)
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, node 0 = root, nodes in best-first pop order.

    Attributes:
      tokens: int32 ``[batch, N]`` token of each node (root = the round's input token).
      parents: int32 ``[batch, N]`` parent node index, ``-1`` for the root and padding.
      depths: int32 ``[batch, N]`` depth (root 0, drafts 1..L, padding 0).
      logw: float32 ``[batch, N]`` cumulative draft log-probability (root 0, padding -inf).
      num_nodes: int32 ``[batch]`` real nodes including the root.
      max_depth: static ``L``, the deepest level a node can have.
    """

    tokens: Int[Array, "B N"]
    parents: Int[Array, "B N"]
    depths: Int[Array, "B N"]
    logw: Float[Array, "B N"]
    num_nodes: Int[Array, " B"]
    max_depth: int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["index", "next_token", "next_sibling"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Retrieve:
    """First-child/next-sibling encoding, int32 ``[batch, N]`` each.

    ``index[b, k] = b * N + k`` (flat slot), ``next_token[b, k]`` = first child of ``k``,
    ``next_sibling[b, k]`` = next sibling of ``k`` (children in ascending index), ``-1`` = none.
    """

    index: Int[Array, "B N"]
    next_token: Int[Array, "B N"]
    next_sibling: Int[Array, "B N"]


def draft_log_probs(draft_logits: Float[Array, "... V"], temperature) -> Float[Array, "... V"]:
    """float32 ``log_softmax(logits / temperature)`` as ``s - log(sum(exp(s)))``, ``s = z - max z``,
    clamped at 0. The clamp matters where ``exp`` or ``log`` round inexactly: XLA's CPU code compiled
    at its lowest optimisation level gave +4.8e-7 for a token of probability 1, and a positive edge
    would give a child more mass than its parent and put it first in the pop order."""
    z = draft_logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    s = z - jnp.max(z, axis=-1, keepdims=True)
    return jnp.minimum(s - jnp.log(jnp.sum(jnp.exp(s), axis=-1, keepdims=True)), 0.0)


def tree_from_top_k(lp_LK: Float[Array, "L K"], tok_LK: Int[Array, "L K"], root: Int[Array, ""], *, budget: int,
                    count_max: int = selection.COUNT_MAX):
    """One request's tree arrays ``(tokens, parents, depths, logw [N], num_nodes [])`` from each
    depth's top ``K`` log-probabilities and int32 token ids (descending, ties by lower id; ``K <=
    budget``): the beam and the global order of `build_tree`, without the vocabulary top-k. Rankings of
    up to ``count_max`` entries are counted, longer ones sorted (`selection.count_limit`)."""
    depth_count, k = lp_LK.shape
    neg_inf = jnp.float32(-jnp.inf)
    width = budget
    bits, per_word, num_words = rank_packing(k, depth_count)

    def with_rank(words_WX, d, r_W):  # set depth d's rank (0-based d) in the packed rank tuples
        shift = bits * (per_word - 1 - d % per_word)
        return words_WX.at[:, d // per_word].add((r_W + 1) << shift)

    # Depth 1: the beam is the K best tokens, already in (logw, rank) order; pad to the width.
    pad = width - k
    logw = jnp.concatenate([lp_LK[0], jnp.full((pad,), neg_inf)])
    rank = jnp.concatenate([jnp.arange(k, dtype=jnp.int32), jnp.zeros((pad,), jnp.int32)])
    words_WX = with_rank(jnp.zeros((width, num_words), jnp.int32), 0, rank)
    beams = [(logw, tok_LK[0, rank], jnp.full((width,), -1, jnp.int32), words_WX)]

    pair_i, pair_r = map(jnp.asarray, beam_pairs(width, k))
    # Candidates of one depth compare their rank tuples: word by word (the parent's, then the new rank)
    # where they are counted; where they are sorted (more than count_max of them), as one int key,
    # parent's lexicographic position x K + rank, since a sort's cost grows with its keys (on an H200
    # the budget-512 build took 1.35 / 1.84 ms at batch 1 / 8 with the words, 1.12 / 1.51 ms with the
    # one key and the earlier top-k).
    sorted_keys = pair_i.shape[0] > count_max
    lexpos = jnp.arange(width, dtype=jnp.int32)
    for d in range(1, depth_count):
        prev_logw, _, _, prev_words = beams[-1]
        cand_logw = prev_logw[pair_i] + lp_LK[d, pair_r]
        cand_words = with_rank(prev_words[pair_i], d, pair_r)
        cand_keys = (lexpos[pair_i] * k + pair_r,) if sorted_keys else tuple(cand_words.T)
        cand_order = selection.ascending_ranks(-cand_logw, *cand_keys, count_max=count_max)
        sel = selection.scatter_by_rank(cand_order, jnp.arange(cand_logw.shape[0], dtype=jnp.int32), width, count_max)
        beams.append((cand_logw[sel], tok_LK[d, pair_r[sel]], pair_i[sel], cand_words[sel]))
        if sorted_keys:  # the beam's lexicographic positions, -inf entries last
            lexpos = selection.ascending_ranks(jnp.where(jnp.isfinite(beams[-1][0]), cand_keys[0][sel],
                                                         jnp.iinfo(jnp.int32).max), count_max=count_max)

    # Global best-first order over all depths: by (-logw, rank tuple), the first B become nodes 1..B.
    logw_C = jnp.concatenate([b[0] for b in beams])
    tok_C = jnp.concatenate([b[1] for b in beams])
    parent_C = jnp.concatenate([b[2] for b in beams])
    words_CX = jnp.concatenate([b[3] for b in beams])
    depth_C = jnp.repeat(jnp.arange(1, depth_count + 1, dtype=jnp.int32), width)
    order_C = selection.ascending_ranks(-logw_C, *words_CX.T, count_max=count_max)
    node_of_C = jnp.where(order_C < budget, order_C + 1, -1)
    parent_flat = (depth_C - 2) * width + parent_C  # flat index of the parent candidate
    parent_C = jnp.where(depth_C == 1, 0, node_of_C[jnp.maximum(parent_flat, 0)])

    real = jnp.isfinite(logw_C)
    fields = (jnp.where(real, tok_C, 0), jnp.where(real, parent_C, -1), jnp.where(real, depth_C, 0),
              jax.lax.bitcast_convert_type(jnp.where(real, logw_C, neg_inf), jnp.int32))
    nodes_B4 = selection.scatter_by_rank(order_C, jnp.stack(fields, axis=-1), budget, count_max)  # one scatter
    heads = (root[None], jnp.array([-1], jnp.int32), jnp.array([0], jnp.int32))
    tokens, parents, depths = (jnp.concatenate([head, nodes_B4[:, j]]) for j, head in enumerate(heads))
    logw = jnp.concatenate([jnp.zeros((1,), jnp.float32), jax.lax.bitcast_convert_type(nodes_B4[:, 3], jnp.float32)])
    return tokens, parents, depths, logw, 1 + jnp.sum(real & (order_C < budget), dtype=jnp.int32)


def top_k_width(budget: int, topk_cap: int | None, vocab: int) -> int:
    """``K``, the tokens a depth's beam can extend with: ``min(budget, V)``, capped by ``topk_cap``."""
    return min(budget, vocab) if topk_cap is None else min(topk_cap, budget, vocab)


def draft_top_k(draft_logits: Float[Array, "B L V"], draft_temperature, k: int):
    """Each depth's top ``k`` draft log-probabilities (float32) and token ids (int32), ``[B, L, k]``
    each, descending, ties by lower token id: what the beam extends with (`selection.top_k`)."""
    return selection.top_k(draft_log_probs(draft_logits, draft_temperature), k)


def tree_from_nodes(root_B: Int[Array, " B"], tokens_BM, parents_BM, depths_BM, logw_BM, max_depth: int) -> DraftTree:
    """The `DraftTree` whose nodes ``1..M`` are the given ``[B, M]`` arrays (pop order, padding as in the
    module docstring), the root prepended: how a kernel's nodes (`pallas_kernels.tree_build.tree_nodes`)
    become the round's tree."""
    head_B1 = jnp.zeros((root_B.shape[0], 1), jnp.int32)
    return DraftTree(jnp.concatenate([root_B.astype(jnp.int32)[:, None], tokens_BM], 1),
                     jnp.concatenate([head_B1 - 1, parents_BM], 1), jnp.concatenate([head_B1, depths_BM], 1),
                     jnp.concatenate([head_B1.astype(jnp.float32), logw_BM], 1),
                     1 + jnp.sum(parents_BM >= 0, axis=1, dtype=jnp.int32), max_depth=max_depth)


@functools.partial(jax.jit, static_argnames=("budget", "topk_cap"))
def build_tree_unchecked(draft_logits, root_tokens, draft_temperature, *, budget, topk_cap) -> DraftTree:
    """`build_tree` without validation, for callers inside jit (``draft_temperature`` may be traced)."""
    depth_count, vocab = draft_logits.shape[1:]
    lp_BLK, tok_BLK = draft_top_k(draft_logits, draft_temperature, top_k_width(budget, topk_cap, vocab))
    build = functools.partial(tree_from_top_k, budget=budget, count_max=selection.count_limit(draft_logits.shape[0]))
    tokens, parents, depths, logw, num_nodes = jax.vmap(build)(lp_BLK, tok_BLK, root_tokens.astype(jnp.int32))
    return DraftTree(tokens, parents, depths, logw, num_nodes, max_depth=depth_count)


def with_token_ids(tree: DraftTree, token_ids_W: Int[Array, " W"]) -> DraftTree:
    """A tree built from draft logits over a draft vocabulary (column ``j`` for token ``token_ids[j]``),
    its drafted nodes' tokens turned from columns into token ids; the root and padding unchanged."""
    slots = jnp.arange(tree.tokens.shape[1])[None, :]
    drafted = (slots >= 1) & (slots < tree.num_nodes[:, None])
    tokens = jnp.where(drafted, jnp.take(token_ids_W, jnp.where(drafted, tree.tokens, 0)), tree.tokens)
    return dataclasses.replace(tree, tokens=tokens)


def build_tree(
    draft_logits: Float[Array, "B L V"],
    root_tokens: Int[Array, " B"],
    *,
    budget: int,
    topk_cap: int | None = None,
    draft_temperature: float = 1.0,
) -> DraftTree:
    """Best-first DDTree of ``budget`` drafts per request (DDTree Algorithm 1, as a beam).

    Args:
      draft_logits: ``[batch, L, V]`` drafter logits; row ``d`` is the marginal of depth ``d + 1``.
      root_tokens: int ``[batch]`` the round's input token (node 0).
      budget: ``B >= 1`` non-root nodes; arrays get ``N = B + 1`` slots.
      topk_cap: optional per-depth cap on the ranks considered (``1`` gives a DFlash chain of
        ``min(B, L)`` drafts); ``None`` means ``min(B, V)``.
      draft_temperature: ``> 0``; the draft log-probabilities are ``log_softmax(logits / t)``.

    Returns:
      ``DraftTree`` with ``max_depth = L``: the ``B`` most probable prefixes under the drafter's
      factorised distribution, in pop order (see the module docstring).

    Checks: shapes, dtypes and the scalar arguments always; finite logits and root ids ``< V``
    when the inputs are concrete.
    """
    draft_logits = checks.array("draft_logits", draft_logits, ndim=3, kind="float")
    root_tokens = checks.array("root_tokens", root_tokens, ndim=1, kind="int")
    checks.same_leading("root_tokens", root_tokens, draft_logits.shape[:1])
    if draft_logits.shape[1] < 1 or draft_logits.shape[2] < 2:
        raise ValueError(f"draft_logits needs L >= 1 and V >= 2, got shape {draft_logits.shape}")
    budget = checks.positive_int("budget", budget, maximum=MAX_BUDGET)
    if topk_cap is not None:
        topk_cap = checks.positive_int("topk_cap", topk_cap)
    if checks.is_concrete(draft_temperature):
        checks.draft_temperature(draft_temperature)
    checks.finite("draft_logits", draft_logits)
    checks.token_range("root_tokens", root_tokens, draft_logits.shape[2])
    return build_tree_unchecked(
        draft_logits, root_tokens, jnp.asarray(draft_temperature, jnp.float32), budget=budget, topk_cap=topk_cap
    )


def _first_child_next_sibling(parents_N: Int[Array, " N"]) -> tuple[Array, Array]:
    """FCNS arrays of one tree from its parent array (children in ascending index)."""
    n = parents_N.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    group = jnp.where(parents_N >= 0, parents_N, n)  # non-children sort last
    group_s, idx_s = jax.lax.sort((group, idx), num_keys=2)
    same_next = (group_s[1:] == group_s[:-1]) & (group_s[1:] < n)
    next_sibling = jnp.full((n,), -1, jnp.int32).at[idx_s[:-1]].set(jnp.where(same_next, idx_s[1:], -1))
    first = (group_s < n) & jnp.concatenate([jnp.array([True]), group_s[1:] != group_s[:-1]])
    next_token = jnp.full((n,), -1, jnp.int32).at[jnp.where(first, group_s, n)].set(idx_s, mode="drop")
    return next_token, next_sibling


def check_tree(tree) -> None:
    """``ValueError`` unless ``tree`` is a `DraftTree` (its fields may be traced)."""
    if not isinstance(tree, DraftTree):
        raise ValueError(f"tree must be a DraftTree (build_tree), got {type(tree).__name__}")


def compile_retrieve(tree: DraftTree) -> Retrieve:
    """First-child/next-sibling encoding of ``tree`` (int32 ``[batch, N]`` arrays, ``-1`` = none)."""
    check_tree(tree)
    return _compile_retrieve(tree)


@jax.jit
def _compile_retrieve(tree: DraftTree) -> Retrieve:
    batch, n = tree.parents.shape
    next_token, next_sibling = jax.vmap(_first_child_next_sibling)(tree.parents)
    index = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
    return Retrieve(index, next_token, next_sibling)


def ancestor_ids(parents_BN: Int[Array, "B N"], max_depth: int) -> Int[Array, "B N A"]:
    """``ids[b, i, t]`` = the ``t``-th ancestor of node ``i`` (``t = 0`` is ``i``), ``-1`` past the root.

    ``A = max_depth + 1``. Padding nodes have only themselves.
    """
    chain = [jnp.arange(parents_BN.shape[1], dtype=jnp.int32)[None, :].repeat(parents_BN.shape[0], 0)]
    for _ in range(max_depth):
        cur = chain[-1]
        up = jnp.take_along_axis(parents_BN, jnp.maximum(cur, 0), axis=1)
        chain.append(jnp.where(cur >= 0, up, -1))
    return jnp.stack(chain, axis=-1)


def tree_attention_mask(tree: DraftTree) -> Bool[Array, "B N N"]:
    """``mask[b, i, j]``: node ``i`` attends to node ``j`` iff ``j`` is ``i`` or an ancestor of ``i``.

    Padding nodes attend only to themselves; real nodes never attend to padding.
    """
    check_tree(tree)
    return _tree_attention_mask(tree)


@jax.jit
def _tree_attention_mask(tree: DraftTree) -> Bool[Array, "B N N"]:
    ids_BNA = ancestor_ids(tree.parents, tree.max_depth)
    n = tree.parents.shape[1]
    return jnp.any(ids_BNA[:, :, :, None] == jnp.arange(n)[None, None, None, :], axis=2)


def tree_positions(tree: DraftTree, prefix_len: Int[Array, " B"]) -> Int[Array, "B N"]:
    """Absolute positions ``prefix_len + depth`` (the root sits at ``prefix_len``): int32 ``[batch, N]``.

    ``prefix_len``: int ``[batch]``, each request's committed length (checked ``>= 0`` when concrete).
    """
    check_tree(tree)
    prefix_len = checks.array("prefix_len", prefix_len, ndim=1, kind="int")
    checks.same_leading("prefix_len", prefix_len, tree.depths.shape[:1])
    checks.non_negative("prefix_len", prefix_len)
    return jnp.asarray(prefix_len, jnp.int32)[:, None] + tree.depths
