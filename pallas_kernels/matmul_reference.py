"""The decoder's projections in plain jnp: the contract of the skinny matmul kernel.

``y = prologue(x) @ w`` with an optional RMSNorm of ``x``'s rows before the product and an
optional SwiGLU after it. This is also the XLA path of the library: the models run it wherever no
kernel is chosen, and ``rms_norm`` is the models' normalisation everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, computed in float32 (as HF Qwen3): ``w * x / rms(x)``, the
    normalised ``x`` rounded to ``x``'s dtype before the weight multiplies it."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def swiglu(gate_up):
    """``silu(gate) * up`` of ``[..., 2 I]`` ``[gate | up]`` columns: ``[..., I]``."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(gate) * up


def split_partials(x_MK, w_KN, splits: int):
    """The float32 products of ``x`` and ``w`` over ``splits`` equal chunks of K (split-K written out, which
    XLA runs as one batched GEMM): ``[S, M, N]``, whose sum is ``x @ w``. ``splits`` must divide K."""
    m, k = x_MK.shape
    if splits < 1 or k % splits:
        raise ValueError(f"splits must be a positive divisor of K={k}, got {splits}")
    x_SMC = x_MK.reshape(m, splits, k // splits).transpose(1, 0, 2)
    w_SCN = w_KN.reshape(splits, k // splits, w_KN.shape[1])
    return jnp.einsum("smc,scn->smn", x_SMC, w_SCN, preferred_element_type=jnp.float32)


def split_product(x_MK, w_KN, splits: int = 1):
    """``x @ w`` accumulated in float32, as one product (``splits = 1``) or as `split_partials` summed (a
    fusion after XLA's batched GEMM): ``[M, N]`` float32."""
    if splits == 1:
        return jnp.matmul(x_MK, w_KN, preferred_element_type=jnp.float32)
    return split_partials(x_MK, w_KN, splits).sum(axis=0)


def matmul_reference(x_MK, w_KN, *, norm_K=None, eps=1e-6, gated=False, out_dtype=None, columns=None,
                     residual_MN=None, splits=1, then_norm_N=None, with_partials=False):
    """``x @ w`` accumulated in float32, with an optional prologue and epilogue.

    Args:
      x_MK: ``[M, K]`` activations.
      w_KN: ``[K, N]`` weight (``x @ W`` orientation).
      norm_K: optional ``[K]`` RMSNorm weight: the product is ``rms_norm(x, norm_K, eps) @ w``.
      eps: the RMSNorm epsilon.
      gated: ``w``'s columns are ``[gate | up]`` halves; returns ``swiglu`` of the product,
        ``[M, N / 2]``.
      out_dtype: the result's dtype (default ``x``'s); the product is rounded to it before the
        SwiGLU.
      columns: optional static ``(start, stop)``: the product with ``w[:, start:stop]`` only.
      residual_MN: optional ``[M, N]`` (``[M, N / 2]`` when gated) in the result's dtype, added to the
        result (a residual connection).
      splits: the product as `split_product` of this many K chunks (1: one product).
      then_norm_N: optional ``[N]`` RMSNorm weight of the next product, which an implementation may apply
        to the result with this product (``ddtree_jax.kernels.residual_norm_product``); this one leaves
        it to the next product's prologue.
      with_partials: return ``(result, partials)``: an implementation may hand over the float32 split-K
        partials ``[S, R, N]`` (``R >= M``, rows past ``M`` padding) whose sum over ``S`` in order, rounded,
        is the result, for a consumer that sums them itself (``ddtree_jax.kernels.partials_product``); this
        one returns ``None`` for them. Not with ``then_norm_N``.

    Returns:
      ``[M, N]`` (``[M, N / 2]`` when ``gated``); with ``then_norm_N`` or ``with_partials``, ``(result, None)``.
    """
    if with_partials and then_norm_N is not None:
        raise ValueError("with_partials and then_norm_N exclude each other (each asks for a pair)")
    out_dtype = x_MK.dtype if out_dtype is None else out_dtype
    if columns is not None:
        w_KN = w_KN[:, columns[0]:columns[1]]
    if norm_K is not None:
        x_MK = rms_norm(x_MK, norm_K, eps)
    y_MN = split_product(x_MK, w_KN, splits).astype(out_dtype)
    y_MN = swiglu(y_MN) if gated else y_MN
    y_MN = y_MN if residual_MN is None else residual_MN + y_MN
    return (y_MN, None) if with_partials or then_norm_N is not None else y_MN
