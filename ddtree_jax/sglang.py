"""SGLang's flat index layout for tree verification, and ours.

SGLang's tree samplers (sgl-kernel's ``tree_speculative_sampling_target_only`` and
``verify_tree_greedy``) read a batch of ``batch`` trees of ``N`` nodes each through flat pointers,
the nodes of request ``b`` at offsets ``b * N .. b * N + N - 1``. SGLang name -> ours:

- ``candidates[b * N + k]`` -> ``candidates[b, k]``, the token of node ``k``;
- ``retrieve_next_token[b * N + k]``, ``retrieve_next_sibling[b * N + k]`` -> ``next_token[b, k]``,
  ``next_sibling[b, k]``: first child and next sibling as *local* ids (``0 .. N - 1``, ``-1``);
- ``uniform_samples[b * N + k]`` -> ``coins[b, k]``; ``uniform_samples_for_final_sampling[b]`` ->
  ``final_coins[b]``; ``target_probs[(b * N + k) * V + t]`` -> ``probs[b, k, t]``;
- ``retrieve_index[b * N + k]``: the *flat slot* of node ``k`` (``b * N + k`` in SGLang's own trees,
  our ``Retrieve.index``), which names nodes in the outputs:
- ``predicts[retrieve_index[b, k]]`` -> ``VerifyResult.predicts[b, k]``, the token emitted after
  node ``k`` of the accepted path, ``-1`` elsewhere;
- ``accept_index[b, t]`` (flat slots, ``max_depth + 1`` columns: SGLang's ``num_spec_step``) ->
  ``VerifyResult.accept_index[b, t]`` (local ids); ``accept_token_num[b]`` -> ``num_accepted[b]``.

So links, coins and probabilities are already per request; only the outputs need translating.
Any one-to-one ``retrieve_index`` into ``[0, num_slots)`` works here. SGLang passes the per-node
arrays as ``[batch, N]`` tensors, so both shapes are accepted. The samplers themselves are
``verify.tree_rejection_sample`` and ``verify.tree_greedy_verify`` (sgl-kernel's walk with
``threshold_single = threshold_acc = 1``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from ddtree_jax import checks
from ddtree_jax.verify import VerifyResult


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["candidates", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class FlatTree:
    """A batch of trees in SGLang's layout: int32 ``[batch * N]`` each (``[batch, N]`` accepted).

    Attributes:
      candidates: node tokens.
      retrieve_index: the flat slot of each node.
      retrieve_next_token, retrieve_next_sibling: first child / next sibling, local ids, ``-1`` = none.
    """

    candidates: Int[Array, " BN"]
    retrieve_index: Int[Array, " BN"]
    retrieve_next_token: Int[Array, " BN"]
    retrieve_next_sibling: Int[Array, " BN"]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["predicts", "accept_index", "accept_token_num"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class FlatResult:
    """SGLang's outputs of one verification, int32.

    Attributes:
      predicts: ``[num_slots]`` at the flat slot of every accepted-path node the token emitted
        after it, ``-1`` elsewhere.
      accept_index: ``[batch, max_depth + 1]`` flat slots of the accepted path, root first, ``-1``
        padded.
      accept_token_num: ``[batch]`` drafts accepted.
    """

    predicts: Int[Array, " P"]
    accept_index: Int[Array, "B D"]
    accept_token_num: Int[Array, " B"]


def _per_request(name: str, x, batch: int) -> jax.Array:
    """A ``[batch * N]`` or ``[batch, N]`` integer array as int32 ``[batch, N]``."""
    shape = np.shape(x)
    if len(shape) not in (1, 2) or shape[0] % batch or (len(shape) == 2 and shape[0] != batch):
        raise ValueError(f"{name} must have shape [{batch} * N] or [{batch}, N], got {shape}")
    x = checks.array(name, x, ndim=len(shape), kind="int")
    return jnp.asarray(x, jnp.int32).reshape(batch, -1)


def _check_retrieve_index(retrieve_index_BN, num_slots: int) -> None:
    """Concrete check: flat slots in ``[0, num_slots)``, no slot used twice."""
    if not checks.is_concrete(retrieve_index_BN):
        return
    host = np.asarray(retrieve_index_BN).ravel()
    bad = host[(host < 0) | (host >= num_slots)]
    if bad.size:
        raise ValueError(f"retrieve_index must hold flat slots in [0, {num_slots}), got {bad[:4].tolist()}")
    slots, counts = np.unique(host, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"retrieve_index must not repeat a slot, got {slots[counts > 1][:4].tolist()} twice")


def tree_from_flat(flat: FlatTree, batch: int) -> tuple[Int[Array, "B N"], ...]:
    """Our layout of SGLang's: ``(candidates_BN, next_token_BN, next_sibling_BN, retrieve_index_BN)``,
    int32 ``[batch, N]`` (the links are local already; ``retrieve_index_BN`` is for
    ``result_to_flat``). Raises ``ValueError`` for a bad shape or, when concrete, a bad
    ``retrieve_index`` (out of ``[0, batch * N)`` or repeated)."""
    batch = checks.positive_int("batch", batch)
    arrays = [_per_request(f.name, getattr(flat, f.name), batch) for f in dataclasses.fields(flat)]
    for f, x in zip(dataclasses.fields(flat), arrays, strict=True):
        checks.same_leading(f.name, x, arrays[0].shape)
    candidates, retrieve_index, next_token, next_sibling = arrays
    _check_retrieve_index(retrieve_index, retrieve_index.size)
    return candidates, next_token, next_sibling, retrieve_index


def tree_to_flat(candidates_BN, next_token_BN, next_sibling_BN, retrieve_index_BN=None) -> FlatTree:
    """SGLang's layout of ours: every array flattened to ``[batch * N]``; ``retrieve_index``
    defaults to ``b * N + k``."""
    candidates_BN = checks.array("candidates", candidates_BN, ndim=2, kind="int")
    batch, n = candidates_BN.shape
    if retrieve_index_BN is None:
        retrieve_index_BN = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
    arrays = {"candidates": candidates_BN, "retrieve_index": retrieve_index_BN,
              "retrieve_next_token": next_token_BN, "retrieve_next_sibling": next_sibling_BN}
    for name, x in arrays.items():
        checks.array(name, x, ndim=2, kind="int")
        checks.same_leading(name, x, (batch, n))
    _check_retrieve_index(retrieve_index_BN, batch * n)
    return FlatTree(**{name: jnp.asarray(x, jnp.int32).reshape(-1) for name, x in arrays.items()})


def result_to_flat(result: VerifyResult, retrieve_index_BN: Int[Array, "B N"], num_slots: int | None = None
                   ) -> FlatResult:
    """SGLang's outputs from a ``VerifyResult`` on local ids: node ``k`` of request ``b`` becomes
    slot ``retrieve_index_BN[b, k]`` of a ``num_slots``-long ``predicts`` (default ``batch * N``)."""
    retrieve_index_BN = checks.array("retrieve_index", retrieve_index_BN, ndim=2, kind="int")
    checks.same_leading("retrieve_index", retrieve_index_BN, result.predicts.shape)
    num_slots = checks.positive_int("num_slots", retrieve_index_BN.size if num_slots is None else num_slots)
    _check_retrieve_index(retrieve_index_BN, num_slots)
    slots = jnp.asarray(retrieve_index_BN, jnp.int32)
    path = result.accept_index
    accept_index = jnp.where(path >= 0, jnp.take_along_axis(slots, jnp.maximum(path, 0), axis=1), -1)
    # Off the path result.predicts is -1, so writing every node leaves the other slots at -1.
    predicts = jnp.full((num_slots,), -1, jnp.int32).at[slots.reshape(-1)].set(result.predicts.reshape(-1))
    return FlatResult(predicts, accept_index.astype(jnp.int32), result.num_accepted.astype(jnp.int32))


def result_from_flat(flat: FlatResult, retrieve_index_BN: Int[Array, "B N"]) -> VerifyResult:
    """The ``VerifyResult`` on local ids that SGLang's outputs describe (the inverse of
    ``result_to_flat``); ``emitted`` and ``bonus`` are read from ``predicts`` along the path.

    Raises ``ValueError`` (concrete inputs) when an ``accept_index`` slot is not one of its
    request's nodes or ``accept_token_num`` does not count the path.
    """
    retrieve_index_BN = checks.array("retrieve_index", retrieve_index_BN, ndim=2, kind="int")
    accept_flat = checks.array("accept_index", flat.accept_index, ndim=2, kind="int")
    predicts_flat = checks.array("predicts", flat.predicts, ndim=1, kind="int")
    num_accepted = checks.array("accept_token_num", flat.accept_token_num, ndim=1, kind="int")
    checks.same_leading("accept_index", accept_flat, retrieve_index_BN.shape[:1])
    checks.same_leading("accept_token_num", num_accepted, retrieve_index_BN.shape[:1])
    _check_retrieve_index(retrieve_index_BN, predicts_flat.shape[0])
    slots = jnp.asarray(retrieve_index_BN, jnp.int32)
    match_BDN = jnp.asarray(accept_flat)[:, :, None] == slots[:, None, :]
    known = jnp.any(match_BDN, axis=2)
    if checks.is_concrete(accept_flat) and checks.is_concrete(num_accepted):
        on_path = np.asarray(accept_flat) >= 0
        if not np.all(np.asarray(known) | ~on_path):
            b, t = np.argwhere(~np.asarray(known) & on_path)[0]
            raise ValueError(f"accept_index[{b}, {t}] = {np.asarray(accept_flat)[b, t]} is no node of request {b}")
        if not np.array_equal(on_path.sum(axis=1) - 1, np.asarray(num_accepted)):
            raise ValueError(f"accept_token_num {np.asarray(num_accepted).tolist()} does not count the accepted "
                             f"paths of accept_index")
    accept_index = jnp.where(known, jnp.argmax(match_BDN, axis=2), -1).astype(jnp.int32)
    predicts = jnp.asarray(predicts_flat, jnp.int32)[slots]
    emitted = jnp.where(accept_index >= 0, jnp.take_along_axis(predicts, jnp.maximum(accept_index, 0), axis=1), -1)
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    bonus = jnp.take_along_axis(emitted, num_accepted[:, None], axis=1)[:, 0]
    return VerifyResult(accept_index, num_accepted, predicts, emitted, bonus)
