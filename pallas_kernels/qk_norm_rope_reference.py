"""What happens between a layer's q/k/v projection and its attention, in plain jnp.

Qwen3 normalises every query and key head with RMSNorm over ``head_dim`` (one weight for the
queries, one for the keys), then rotates it with RoPE (rotate-half / NeoX pairing); values pass
through. The rotation angles depend on the positions only, so a forward computes them once
(`rope_tables`) and every layer reuses them. This is the models' code and the contract of the fused
kernel in ``qk_norm_rope.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.matmul_reference import rms_norm


def rope_tables(positions_BN, head_dim: int, theta: float):
    """RoPE ``cos, sin`` tables, float32 ``[B, N, head_dim / 2]``: pair ``(x[i], x[i + D/2])`` of a
    head at integer position ``p`` turns by angle ``p * theta ** (-2i / D)``."""
    half = head_dim // 2
    inv_freq_F = 1.0 / (theta ** (np.arange(half, dtype=np.float32) * 2.0 / head_dim))
    angle_BNF = positions_BN.astype(jnp.float32)[..., None] * inv_freq_F
    return jnp.cos(angle_BNF), jnp.sin(angle_BNF)


def rotate(x_BNHD, cos_BNF, sin_BNF):
    """RoPE of ``x [B, N, H, D]`` by `rope_tables` ``[B, N, D / 2]``, in float32, rounded back to
    ``x``'s dtype."""
    half = x_BNHD.shape[-1] // 2
    cos_BN1F, sin_BN1F = cos_BNF[:, :, None], sin_BNF[:, :, None]
    x32 = x_BNHD.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos_BN1F - x2 * sin_BN1F, x2 * cos_BN1F + x1 * sin_BN1F], -1)
    return rotated.astype(x_BNHD.dtype)


def norm_rotate(x_BNHD, weight_D, eps: float, cos_BNF, sin_BNF):
    """RMSNorm of each head of ``x [B, N, H, D]`` (``rms_norm`` with ``weight``), then `rotate`."""
    return rotate(rms_norm(x_BNHD, weight_D, eps), cos_BNF, sin_BNF)


def qk_norm_rope_reference(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, *, heads: int, kv_heads: int,
                           eps: float):
    """Split a fused projection into heads, q/k RMSNorm then RoPE.

    Args:
      qkv_BNC: ``[B, N, (heads + 2 kv_heads) * D]``, columns ``[q | k | v]``.
      q_norm_D, k_norm_D: ``[D]`` RMSNorm weights of the query and key heads.
      cos_BNF, sin_BNF: float32 ``[B, N, D / 2]`` (`rope_tables`).

    Returns:
      ``q [B, N, heads, D]``, ``k [B, N, kv_heads, D]`` (normalised and rotated) and
      ``v [B, N, kv_heads, D]``, in ``qkv``'s dtype.
    """
    batch, num, cols = qkv_BNC.shape
    head_dim = cols // (heads + 2 * kv_heads)
    qkv_BNXD = qkv_BNC.reshape(batch, num, heads + 2 * kv_heads, head_dim)
    q_BNHD = norm_rotate(qkv_BNXD[:, :, :heads], q_norm_D, eps, cos_BNF, sin_BNF)
    k_BNKD = norm_rotate(qkv_BNXD[:, :, heads:heads + kv_heads], k_norm_D, eps, cos_BNF, sin_BNF)
    return q_BNHD, k_BNKD, qkv_BNXD[:, :, heads + kv_heads:]


def qk_norm_rope_write_reference(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, k_LBKSD, v_LBKSD, lengths_B, *,
                                 layer: int, heads: int, kv_heads: int, eps: float, queries: int | None = None,
                                 partials_SRC=None):
    """`qk_norm_rope_reference`, then its keys and values written into ``layer`` of the stacked caches
    ``[L, B, K, S, D]`` at slots ``[lengths[b], lengths[b] + N)`` (`kv_write_reference`; past the end:
    dropped). Returns the queries of the last ``queries`` rows (all ``N`` by default; the DFlash
    drafter's context rows have keys and values but no queries), ``q [B, queries, heads, D]``, and the
    two caches. With ``partials_SRC``, float32 split-K partials of the q/k/v product ``[S, R, C]`` (``R >=
    B * N``, rows past ``B * N`` padding), the projection is `summed_partials` (``qkv``'s values unread)."""
    check_partials(partials_SRC, qkv_BNC)
    if partials_SRC is not None:
        qkv_BNC = summed_partials(partials_SRC, qkv_BNC.shape, qkv_BNC.dtype)
    q_BNHD, k_BNKD, v_BNKD = qk_norm_rope_reference(qkv_BNC, q_norm_D, k_norm_D, cos_BNF, sin_BNF, heads=heads,
                                                    kv_heads=kv_heads, eps=eps)
    num = qkv_BNC.shape[1]
    return (q_BNHD[:, num - check_queries(queries, num):],
            *kv_write_reference(k_LBKSD, v_LBKSD, k_BNKD, v_BNKD, lengths_B, layer=layer))


def summed_partials(partials_SRC, shape, dtype):
    """The product whose split-K partials are ``partials [S, R, C]``: their sum over ``S`` (in order, float32)
    rounded to ``dtype``, its first ``B * N`` rows as ``shape = (B, N, C)``."""
    total_RC = partials_SRC[0]
    for part_RC in partials_SRC[1:]:
        total_RC = total_RC + part_RC
    return total_RC[:shape[0] * shape[1]].astype(dtype).reshape(shape)


def check_partials(partials_SRC, qkv_BNC) -> None:
    """ValueError unless ``partials_SRC`` is ``None`` or float32 ``[S, R, C]`` partials of ``qkv [B, N, C]``'s
    product (``R >= B * N``)."""
    if partials_SRC is None:
        return
    batch, num, cols = qkv_BNC.shape
    shape = jnp.shape(partials_SRC)
    if len(shape) != 3 or shape[0] < 1 or shape[1] < batch * num or shape[2] != cols \
            or partials_SRC.dtype != jnp.float32:
        raise ValueError(f"partials_SRC must be float32 [S, R, {cols}] with R >= {batch * num} (qkv_BNC's rows), "
                         f"got {partials_SRC.dtype} {shape}")


def check_queries(queries, num: int) -> int:
    """``queries`` (``num`` for ``None``) if it is an int in ``[1, num]``, else a ValueError naming it."""
    queries = num if queries is None else queries
    if not isinstance(queries, int) or not 1 <= queries <= num:
        raise ValueError(f"queries must be an int in [1, {num}] (the rows given), got {queries!r}")
    return queries
