"""The end of a split-K product with a residual, and the RMSNorm of its result, in plain jnp: the
contract of the ``residual_norm`` kernel."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.matmul_reference import rms_norm


def check_operands(partials_SPN, residual_PN, norm_N) -> None:
    """ValueError naming the operand unless the shapes and dtypes fit `residual_norm_reference`."""
    if partials_SPN.ndim != 3 or partials_SPN.dtype != jnp.float32:
        raise ValueError(f"partials_SPN must be float32 [S, P, N], got {partials_SPN.dtype} {partials_SPN.shape}")
    if residual_PN.shape != partials_SPN.shape[1:] or not jnp.issubdtype(residual_PN.dtype, jnp.floating):
        raise ValueError(f"residual_PN must be a floating {partials_SPN.shape[1:]}, got {residual_PN.dtype} "
                         f"{residual_PN.shape}")
    if norm_N.shape != partials_SPN.shape[2:] or norm_N.dtype != residual_PN.dtype:
        raise ValueError(f"norm_N must be {residual_PN.dtype} {partials_SPN.shape[2:]}, got {norm_N.dtype} "
                         f"{norm_N.shape}")


def residual_norm_reference(partials_SPN, residual_PN, norm_N, *, eps: float):
    """``x = residual + sum_s partials[s]`` (the sum rounded to the residual's dtype first, as a product
    is) and ``rms_norm(x, norm, eps)``: ``(x_PN, normed_PN)``, both in the residual's dtype.

    ``partials [S, P, N]`` float32 are the K chunks' products of a split-K GEMM (`matmul_reference`'s
    ``split_partials``); ``residual [P, N]``; ``norm [N]`` the next product's RMSNorm weight.
    """
    check_operands(partials_SPN, residual_PN, norm_N)
    x_PN = residual_PN + partials_SPN.sum(axis=0).astype(residual_PN.dtype)
    return x_PN, rms_norm(x_PN, norm_N, eps)
