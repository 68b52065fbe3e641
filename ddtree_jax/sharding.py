"""Tensor-parallel target and data-parallel batch over a ``("dp", "tp")`` device mesh.

The model code is the single-device code: parameters, caches and the decode state are placed
with explicit ``NamedSharding``s (Auto mesh axes) and XLA's SPMD partitioner inserts the
collectives. Only activations ever move between devices; every weight and cache shard stays
where it was placed.

Partition rules for the target (``tp`` = size of the ``"tp"`` axis):

* ``wqkv [D, (Hq + 2 Hkv) Dh]`` and ``w_gate_up [D, 2 I]`` are split over their *rows* (the
  contraction axis D), not their columns. The fused column layouts ``[q | k | v]`` and
  ``[gate | up]`` are not head-aligned (nor gate/up-aligned) under an even column split: a column
  shard would hold, e.g., the last q heads and the first k heads, and XLA then moves weight slices
  between devices at every step. Row blocks need no reordering, keep one parameter layout for
  one and many devices, and each device streams ``1/tp`` of the weight bytes, as with column
  parallelism. The price is an all-reduce of the projection outputs (``[B, N, C]`` activations),
  small next to the weights for the few tokens of a decode or verify step.
* ``wo [Hq Dh, D]`` and ``w_down [I, D]`` are split over their rows, which are head-aligned
  (``tp`` divides ``Hq``) and MLP-aligned; the partial sums are all-reduced.
* Attention runs per KV-head shard: the KV cache ``[layers, batch, kv_heads, max_len, head_dim]``
  is split over ``kv_heads`` when ``tp`` divides them, otherwise replicated over ``tp`` (every
  device keeps, and computes, the K/V of all KV heads, so each query-head shard finds its KV head
  locally).
* Embedding ``[V, D]`` and LM head ``[D, V]`` are split over the vocabulary (when ``tp`` divides
  V, else replicated): at Qwen3-8B shapes they are 1.2 GB each and the head is read at every
  round, so replicating it would make it about 40% of a device's weight traffic at ``tp = 8``.
  Logits come out vocabulary-sharded and are gathered (`gather_vocab`) before anything sorts,
  takes a top-k or scans along the vocabulary (tree build, target law, verification walk): a
  ``[B, N, V]`` float32 all-gather per round, tens of MB at most.
* Norm weights are replicated. The drafter (a few layers) is replicated, so drafting needs no
  collectives.
* Qwen3-MoE sparse layers: the stacked experts ``experts_gate_up [E, D, 2I]`` and
  ``experts_down [E, I, D]`` are split over the expert axis (expert parallelism on ``"tp"``: device
  j holds experts ``[j E/tp, (j + 1) E/tp)`` whole), the router ``[D, E]`` is replicated. Each
  device computes its own experts' share of every token routed to them inside ``shard_map`` and
  the shares are all-reduced (`ddtree_jax.models.moe`); attention stays tensor-parallel as above.

Data parallelism: every per-request array (prompts, caches, decode state, sampling parameters)
is split over ``"dp"`` along its batch axis; parameters are replicated over ``"dp"``.
Randomness comes from per-request keys (``fold_in(fold_in(key, request_id), round)``) with
partitionable Threefry, never from the device layout, so tokens do not depend on the mesh.

XLA does not partition Pallas kernels, so the tree-attention kernel runs inside ``shard_map``
(`ddtree_jax.kernels.shard_attention`): per device, its ``"dp"`` block of the batch and, for the target, its ``"tp"``
block of query heads with the KV heads they read (the cache's own ``"tp"`` block when it is split
over KV heads; cut from the replicated cache otherwise). The drafter's attention is split over
``"dp"`` only. ``attention_impl="xla"`` stays the plain XLA path, partitioned by XLA.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ddtree_jax import checks
from ddtree_jax.models.cache import KVCache
from ddtree_jax.models.params import Model

AXES = ("dp", "tp")
_ROW_SHARDED = ("wqkv", "w_gate_up", "wo", "w_down")
_EXPERT_SHARDED = ("experts_gate_up", "experts_down")


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``("dp", "tp")`` mesh of shape ``[dp, tp]`` over the first ``dp * tp`` of ``devices``
    (default ``jax.devices()``); the devices of one ``tp`` group are adjacent in that order."""
    tp = checks.positive_int("tp", tp)
    dp = checks.positive_int("dp", dp)
    devices = jax.devices() if devices is None else list(devices)
    if tp * dp > len(devices):
        raise ValueError(f"tp={tp} x dp={dp} needs {tp * dp} devices, but only {len(devices)} are available")
    return Mesh(np.asarray(devices[: tp * dp]).reshape(dp, tp), AXES)


def tp_size(mesh: Mesh) -> int:
    """Size of the mesh's ``"tp"`` axis."""
    return mesh.shape["tp"]


def check_tp(config, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` divides the target's attention heads, hidden size, MLP
    size and, for a Qwen3-MoE target, its number of experts (the row blocks and expert blocks of
    `target_specs` must be whole heads and equal)."""
    tp = checks.positive_int("tp", tp)
    experts = ("num_experts",) if config.sparse_layers else ()
    for name in ("num_attention_heads", "hidden_size", "intermediate_size", *experts):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"tp={tp} does not divide the target's {name}={value}")


def check_mesh(mesh: Mesh, config, batch: int | None = None) -> None:
    """Raise ``ValueError`` unless ``mesh`` has axes ``("dp", "tp")``, `check_tp` passes for the
    target ``config`` (when given) and ``dp`` divides ``batch`` (when given)."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES} (see make_mesh), got {mesh!r}")
    if config is not None:
        check_tp(config, tp_size(mesh))
    if batch is not None and batch % mesh.shape["dp"]:
        raise ValueError(f"dp={mesh.shape['dp']} does not divide the batch size {batch}")


def _param_spec(path, tp: int, vocab: int) -> P:
    name = path[-1].name
    if name in _ROW_SHARDED:
        return P("tp", None)
    if name in _EXPERT_SHARDED:
        return P("tp", None, None)
    if vocab % tp == 0 and name == "embed":
        return P("tp", None)
    if vocab % tp == 0 and name == "lm_head":
        return P(None, "tp")
    return P()


def target_specs(target: Model, tp: int):
    """``PartitionSpec`` of every target parameter (same pytree as ``target.params``), see the
    module docstring."""
    vocab = target.config.vocab_size
    return jax.tree_util.tree_map_with_path(lambda path, _: _param_spec(path, tp, vocab), target.params)


def shard_target(target: Model, mesh: Mesh) -> Model:
    """The target with its parameters placed on ``mesh`` by `target_specs` (validated first)."""
    check_mesh(mesh, target.config)
    specs = target_specs(target, tp_size(mesh))
    params = jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), target.params, specs)
    return dataclasses.replace(target, params=params)


def shard_drafter(drafter: Model, mesh: Mesh) -> Model:
    """The drafter with its parameters replicated on every device of ``mesh``."""
    return dataclasses.replace(drafter, params=jax.device_put(drafter.params, NamedSharding(mesh, P())))


def cache_spec(kv_heads: int, tp: int, *, over_heads: bool = True) -> P:
    """Spec of a ``[layers, batch, kv_heads, max_len, head_dim]`` cache: batch over ``"dp"``; KV
    heads over ``"tp"`` when ``over_heads`` and ``tp`` divides them, replicated otherwise."""
    heads = "tp" if over_heads and kv_heads % tp == 0 else None
    return P(None, "dp", heads, None, None)


def cache_shardings(cache: KVCache, mesh: Mesh, *, over_heads: bool = True) -> KVCache:
    """``NamedSharding``s of a `KVCache` (see `cache_spec`; ``lengths`` over ``"dp"``)."""
    spec = cache_spec(cache.k.shape[2], tp_size(mesh), over_heads=over_heads)
    return KVCache(k=NamedSharding(mesh, spec), v=NamedSharding(mesh, spec), lengths=NamedSharding(mesh, P("dp")))


def batch_sharding(x, mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis over ``"dp"``, the rest replicated; scalars replicated."""
    return NamedSharding(mesh, P("dp") if np.ndim(x) else P())


def state_shardings(state, mesh: Mesh):
    """Shardings of the engine's decode state: the target cache by `cache_shardings`, the drafter
    cache replicated over ``"tp"``, every other array by `batch_sharding`."""
    shardings = jax.tree.map(lambda x: batch_sharding(x, mesh), state)
    drafter_cache = None if state.drafter_cache is None else cache_shardings(state.drafter_cache, mesh,
                                                                             over_heads=False)
    return dataclasses.replace(shardings, target_cache=cache_shardings(state.target_cache, mesh),
                               drafter_cache=drafter_cache)


def constrain_state(state, mesh: Mesh | None):
    """Inside jit: pin the decode state to `state_shardings` (identity when ``mesh`` is None), so
    that a round's output state has its input's layout and can be donated to the next round."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, mesh))


def gather_vocab(logits_BNV, mesh: Mesh | None):
    """Inside jit: logits ``[B, ..., V]`` with whole vocabulary rows on every device (batch over
    ``"dp"``), before sorting, top-k or scanning along V. Identity when ``mesh`` is None.

    The logits are first pinned vocabulary-sharded (when the LM head is, see `target_specs`) so
    that each device multiplies by its own head shard and the all-gather moves logits; left free,
    XLA may gather the whole head instead, which is cheaper only for toy sizes.
    """
    if mesh is None:
        return logits_BNV
    if logits_BNV.shape[-1] % tp_size(mesh) == 0:
        split = P("dp", *[None] * (logits_BNV.ndim - 2), "tp")
        logits_BNV = jax.lax.with_sharding_constraint(logits_BNV, NamedSharding(mesh, split))
    return jax.lax.with_sharding_constraint(logits_BNV, batch_sharding(logits_BNV, mesh))


def shard_batch(arrays, mesh: Mesh):
    """Place a pytree of per-request arrays (batch axis first) on ``mesh`` by `batch_sharding`."""
    return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(x, mesh)), arrays)
