"""The q/k RMSNorm, the RoPE and the q/k/v split of a decoder layer as one kernel, alone or with
the write of the new keys and values into the KV cache.

Between the q/k/v projection and the attention, XLA runs this step as a few small fusions per
layer (the two norms' reductions and scalings, the rotation, the slices), each a launch of about a
microsecond on a few kilobytes, and the cache write as six more (see ``kv_write.py``). Here the
programs ``(m, j)`` of the grid ``(M, G + 2)`` (``G = H / K``, `parts_per_row`) read token row ``m`` of
the fused projection once between them: j < G normalises and rotates a group of K query heads, j = G
the key heads, j = G + 1 moves the value heads (one program a row took the decode step's whole row on
one SM). `qk_norm_rope` writes ``q``, ``k`` and ``v`` in their head layouts; `qk_norm_rope_write` writes
``q`` and stores the keys and values straight into the row's cache slot (masked off past the cache's
end), the caches aliased to its outputs. `qk_norm_rope_write` also takes the projection as the float32
split-K partials of its product (``partials_SRC``): each program sums its heads' partials, so the sum
is not a launch of its own.

Head counts and ``head_dim / 2`` must be powers of two, with ``H >= K`` (`kernel_supports`). Same functions as
``qk_norm_rope_reference`` and ``qk_norm_rope_write_reference``, within float32 rounding (the
rotation may contract to fused multiply-adds). On an H200 at Qwen3-8B shapes `qk_norm_rope` alone
(2.6 µs a layer) replaced 3.3 µs of XLA's fusions and no wall time, so ``auto`` does not pick it;
`qk_norm_rope_write` took the AR round from 5.36 ms (XLA) and 5.20 ms (XLA's norms, the ``kv_write``
kernel) to 5.04 ms, so ``auto`` runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.kv_write import store_slot
from pallas_kernels.qk_norm_rope_reference import check_partials, check_queries


def qk_norm_rope(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, *, heads: int, kv_heads: int, eps: float,
                 interpret: bool = False):
    """`qk_norm_rope_reference` by the Pallas kernel (Triton lowering); same arguments and result,
    plus ``interpret`` (run in the Pallas interpreter)."""
    check_operands(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads, kv_heads)
    if not kernel_supports(qkv_BNC, heads, kv_heads):
        raise ValueError(f"the qk_norm_rope kernel needs powers of two for heads ({heads}), kv_heads ({kv_heads}) "
                         f"and head_dim / 2 ({qkv_BNC.shape[-1] // (heads + 2 * kv_heads) // 2}), heads >= kv_heads")
    return _qk_norm_rope(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads=int(heads), kv_heads=int(kv_heads),
                         eps=float(eps), interpret=bool(interpret))


def check_operands(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads, kv_heads) -> None:
    """ValueError naming the operand unless the shapes and dtypes fit `qk_norm_rope`."""
    if qkv_BNC.ndim != 3 or heads < 1 or kv_heads < 1 or qkv_BNC.shape[2] % (heads + 2 * kv_heads):
        raise ValueError(f"qkv_BNC must be [B, N, (heads + 2 kv_heads) * D] with heads={heads}, "
                         f"kv_heads={kv_heads}; got shape {qkv_BNC.shape}")
    head_dim = qkv_BNC.shape[2] // (heads + 2 * kv_heads)
    if head_dim % 2 or not jnp.issubdtype(qkv_BNC.dtype, jnp.floating):
        raise ValueError(f"qkv_BNC needs a floating dtype and an even head_dim, got {qkv_BNC.dtype}, {head_dim}")
    for name, norm in (("q_norm_D", q_norm_D), ("k_norm_D", k_norm_D)):
        if norm.shape != (head_dim,) or norm.dtype != qkv_BNC.dtype:
            raise ValueError(f"{name} must be {qkv_BNC.dtype} ({head_dim},), got {norm.dtype} {norm.shape}")
    want = (*qkv_BNC.shape[:2], head_dim // 2)
    for name, table in (("cos_BNF", cos_BNF), ("sin_BNF", sin_BNF)):
        if table.shape != want or table.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 {want}, got {table.dtype} {table.shape}")


def kernel_supports(qkv_BNC, heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes these operands: ``heads``, ``kv_heads`` and ``head_dim / 2`` powers of
    two (Triton blocks; every Qwen3 model but the 40-head 14B), at least as many query heads as key/value
    heads (grouped-query attention), a floating dtype."""
    head_dim = qkv_BNC.shape[-1] // (heads + 2 * kv_heads)
    return all(n >= 1 and n & (n - 1) == 0 for n in (heads, kv_heads, head_dim // 2)) and head_dim % 2 == 0 \
        and heads >= kv_heads and jnp.issubdtype(qkv_BNC.dtype, jnp.floating)


@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "eps", "interpret"))
def _qk_norm_rope(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, *, heads, kv_heads, eps, interpret):
    batch, num, cols = qkv_BNC.shape
    rows, head_dim = batch * num, cols // (heads + 2 * kv_heads)
    dtype = qkv_BNC.dtype
    # Head rows flattened, [M * heads, D] and so on: a program gathers its rows by index.
    out_shape = tuple(jax.ShapeDtypeStruct((rows * h, head_dim), dtype) for h in (heads, kv_heads, kv_heads))
    kernel = functools.partial(_kernel, heads=heads, kv_heads=kv_heads, half=head_dim // 2, eps=eps)
    q, k, v = pl.pallas_call(
        kernel, grid=(rows, parts_per_row(heads, kv_heads)), out_shape=out_shape, interpret=interpret,
        name="qk_norm_rope",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(qkv_BNC.reshape(-1, head_dim), q_norm_D, k_norm_D, *_rotation_rows(cos_BNF, sin_BNF))
    return tuple(x.reshape(batch, num, -1, head_dim) for x in (q, k, v))


def qk_norm_rope_write(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, *, layer: int,
                       heads: int, kv_heads: int, eps: float, queries: int | None = None, partials_SRC=None,
                       interpret: bool = False):
    """`qk_norm_rope_write_reference` by one kernel: `qk_norm_rope`'s programs of a token row also store
    the row's keys and values into slot ``lengths[b] + n`` of ``layer`` of the stacked caches (masked
    off past their end), which are aliased to the outputs (updated in place). Only the programs of the
    last ``queries`` rows of a request (all by default) normalise, rotate and store query heads.
    With ``partials_SRC`` (float32 ``[S, R, C]``, ``R >= B * N``) the programs of row m sum their heads of
    row m of the partials and round them to ``qkv``'s dtype in place of reading ``qkv`` (``summed_partials``
    of the reference), whose values are then not read. Returns ``q [B, queries, H, D]`` and the caches."""
    check_operands(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads, kv_heads)
    check_partials(partials_SRC, qkv_BNC)
    queries = check_queries(queries, qkv_BNC.shape[1])
    head_dim = qkv_BNC.shape[-1] // (heads + 2 * kv_heads)
    batch, num_layers = qkv_BNC.shape[0], k_LBKSD.shape[0]
    want = (num_layers, batch, kv_heads, k_LBKSD.shape[3], head_dim)
    if k_LBKSD.ndim != 5 or k_LBKSD.shape != want or v_LBKSD.shape != want or not 0 <= layer < num_layers \
            or jnp.shape(lengths_B) != (batch,):
        raise ValueError(f"k_LBKSD and v_LBKSD must be caches {want[:3]} + (S, {head_dim}) and lengths_B ({batch},), "
                         f"layer in [0, {num_layers}); got {k_LBKSD.shape}, {v_LBKSD.shape}, "
                         f"{jnp.shape(lengths_B)}, layer {layer}")
    if not kernel_supports(qkv_BNC, heads, kv_heads):
        raise ValueError(f"the qk_norm_rope kernel needs powers of two for heads ({heads}), kv_heads ({kv_heads}) "
                         f"and head_dim / 2 ({head_dim // 2}), heads >= kv_heads")
    # Head rows [M * (H + 2K), D], or the partials' [S, R * (H + 2K), D]: a program gathers its rows by index.
    rows = (qkv_BNC.reshape(-1, head_dim) if partials_SRC is None
            else partials_SRC.reshape(partials_SRC.shape[0], -1, head_dim))
    return _qk_norm_rope_write(rows, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD,
                               jnp.asarray(lengths_B, jnp.int32), layer=int(layer), heads=int(heads),
                               kv_heads=int(kv_heads), eps=float(eps), queries=queries, dtype=jnp.dtype(qkv_BNC.dtype),
                               interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("layer", "heads", "kv_heads", "eps", "queries", "dtype", "interpret"))
def _qk_norm_rope_write(rows, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, *, layer, heads,
                        kv_heads, eps, queries, dtype, interpret):
    """The launch over ``rows``: head rows ``[M * (H + 2K), D]`` in ``dtype``, or float32 partials ``[S, R * (H +
    2K), D]``."""
    batch, num = cos_BNF.shape[:2]
    head_dim, num_slots = rows.shape[-1], k_LBKSD.shape[3]
    whole = pl.BlockSpec()
    cache_spec = pl.BlockSpec((None, None, kv_heads, num_slots, head_dim), lambda m, j: (layer, m // num, 0, 0, 0))
    kernel = functools.partial(_write_kernel, heads=heads, kv_heads=kv_heads, half=head_dim // 2, eps=eps,
                               num_new=num, queries=queries, dtype=dtype)
    q, k_LBKSD, v_LBKSD = pl.pallas_call(
        kernel, grid=(batch * num, parts_per_row(heads, kv_heads)),
        in_specs=[whole] * 5 + [pl.BlockSpec((None,), lambda m, j: (m // num,)), cache_spec, cache_spec],
        out_specs=[whole, cache_spec, cache_spec],
        out_shape=[jax.ShapeDtypeStruct((batch * queries * heads, head_dim), dtype),
                   *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (k_LBKSD, v_LBKSD))],
        input_output_aliases={6: 1, 7: 2}, interpret=interpret, name="qk_norm_rope_write",
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(rows, q_norm_D, k_norm_D, *_rotation_rows(cos_BNF, sin_BNF), lengths_B, k_LBKSD, v_LBKSD)
    return q.reshape(batch, queries, heads, head_dim), k_LBKSD, v_LBKSD


def _rotation_rows(cos_BNF, sin_BNF):
    """The rotation tables as ``[M, D / 2]``, a token row each."""
    rows = cos_BNF.shape[0] * cos_BNF.shape[1]
    return cos_BNF.reshape(rows, -1), sin_BNF.reshape(rows, -1)


def _kernel(qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref, q_ref, k_ref, v_ref, *, heads, kv_heads, half, eps):
    """Program (m, j): part j of token row m (`_norm_rope_part`), its heads stored as rows of ``q``, ``k`` and
    ``v``."""
    m, j = pl.program_id(0), pl.program_id(1)
    _norm_rope_part(m, j, qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref,
                    lambda j: _rows_store(q_ref, m * heads + j * kv_heads, kv_heads, half),
                    _rows_store(k_ref, m * kv_heads, kv_heads, half), _rows_store(v_ref, m * kv_heads, kv_heads, half),
                    heads=heads, kv_heads=kv_heads, half=half, eps=eps, dtype=qkv_ref.dtype)


def _rows_store(out_ref, first, count, half):
    """The store of ``count`` heads as rows ``[first, first + count)`` of ``out [*, D]``."""
    def store(y1, y2):
        for c0, y in ((0, y1), (half, y2)):
            plt.store(out_ref.at[pl.ds(first, count), pl.ds(c0, half)], y.astype(out_ref.dtype))
    return store


def _write_kernel(qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref, lengths_ref, k_in_ref, v_in_ref, q_ref, k_ref,
                  v_ref, *, heads, kv_heads, half, eps, num_new, queries, dtype):
    """Program (m, j): part j of token row m = (b, n) (`_norm_rope_part`); its key and value heads into slot
    ``lengths[b] + n`` of request b's ``[K, S, D]`` layer caches (``k_in_ref``/``v_in_ref`` are the same
    buffers as ``k_ref``/``v_ref``), and, for the last ``queries`` rows of the request, its query heads as
    rows of ``q`` (``[B * queries * H, D]``). ``qkv_ref``: head rows, or the partials' (summed, rounded to
    ``dtype``)."""
    del k_in_ref, v_in_ref
    m, j = pl.program_id(0), pl.program_id(1)
    n = m % num_new
    slot = lengths_ref[()] + n
    skipped = num_new - queries  # rows of a request without queries, its first

    def into_slot(cache_ref):
        def store(y1, y2):  # rounded to the activations' dtype first, as the reference's heads are
            for c0, y in ((0, y1), (half, y2)):
                store_slot(cache_ref, slot, y.astype(dtype), first_col=c0)
        return store

    q_row = (m // num_new) * queries + n - skipped
    _norm_rope_part(m, j, qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref,
                    lambda j: _rows_store(q_ref, q_row * heads + j * kv_heads, kv_heads, half), into_slot(k_ref),
                    into_slot(v_ref), heads=heads, kv_heads=kv_heads, half=half, eps=eps, dtype=dtype,
                    with_q=n >= skipped if skipped else None)


def parts_per_row(heads: int, kv_heads: int) -> int:
    """Programs a token row takes: one per group of ``kv_heads`` query heads, one for its keys, one for its
    values."""
    return heads // kv_heads + 2


def _norm_rope_part(m, j, qkv_ref, q_norm_ref, k_norm_ref, cos_ref, sin_ref, store_q, store_k, store_v, *, heads,
                    kv_heads, half, eps, dtype, with_q=None):
    """Part j of token row m (`parts_per_row`; ``G = heads / kv_heads``): for j < G its query heads ``[j K,
    (j + 1) K)`` normalised and rotated, passed to ``store_q(j)`` where ``with_q`` (a traced bool; ``None``:
    always); for j = G its key heads normalised and rotated, to ``store_k``; for j = G + 1 its value heads
    as they are, to ``store_v``. Each store takes two ``[K, D / 2]`` halves: ``x[:D/2]``, ``x[D/2:]`` are
    loaded apart, so the rotation pairs them without moving data within registers. ``qkv_ref`` holds
    head rows ``[*, D]`` in ``dtype``, or float32 split-K partials ``[S, *, D]``, summed here and rounded
    to ``dtype``. Several programs a row: one row's projection is too little work for one program."""
    row = pl.ds(m, 1)
    group = heads // kv_heads

    def halves(first):
        """Heads [first, first + K) of row m as two [K, D / 2] blocks in ``dtype``."""
        src = pl.ds(m * (heads + 2 * kv_heads) + first, kv_heads)
        if len(qkv_ref.shape) == 2:
            return tuple(plt.load(qkv_ref.at[src, pl.ds(c0, half)]) for c0 in (0, half))
        return tuple(sum(plt.load(qkv_ref.at[jnp.int32(s), src, pl.ds(c0, half)]) for s in range(qkv_ref.shape[0]))
                     .astype(dtype) for c0 in (0, half))

    def norm_rope(first, norm_ref, store):
        cos_1F, sin_1F = (plt.load(ref.at[row, :]) for ref in (cos_ref, sin_ref))
        x1, x2 = (x.astype(jnp.float32) for x in halves(first))
        mean_sq = (jnp.sum(x1 * x1, axis=1, keepdims=True) + jnp.sum(x2 * x2, axis=1, keepdims=True)) / (2 * half)
        inv_X1 = lax.rsqrt(mean_sq + eps)
        # rms_norm rounds the normalised x to dtype, then its product with the weight

        def scaled(x, c0):
            w_1F = plt.load(norm_ref.at[pl.ds(c0, half)]).astype(jnp.float32)[None, :]
            return (w_1F * (x * inv_X1).astype(dtype).astype(jnp.float32)).astype(dtype).astype(jnp.float32)

        y1, y2 = scaled(x1, 0), scaled(x2, half)
        store(y1 * cos_1F - y2 * sin_1F, y2 * cos_1F + y1 * sin_1F)

    is_q = j < group
    pl.when(is_q if with_q is None else jnp.logical_and(is_q, with_q))(
        lambda: norm_rope(j * kv_heads, q_norm_ref, store_q(j)))
    pl.when(j == group)(lambda: norm_rope(heads, k_norm_ref, store_k))
    pl.when(j == group + 1)(lambda: store_v(*halves(heads + kv_heads)))
