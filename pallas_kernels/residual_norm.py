"""The sum of a split-K product's partials, its residual add and the next RMSNorm, as one kernel.

Between two products of a decoder layer XLA runs the split-K sum with the residual add as one fusion
and the RMSNorm of the result as another. Here program ``p`` of the grid ``(P,)`` reads row p of every
partial product, sums them, adds the residual row and normalises the result, storing both: one launch
instead of two, and the sum read once.

Same function as ``residual_norm_reference`` within float32 rounding of the sums (the partials and the
squares are summed in another order). ``S`` and ``N`` must be powers of two (`kernel_supports`). On an
H200 after a split-K product of 64 rows it took 3.5 us against 5.2 us for XLA's two fusions, and 2.8
against 3.0 at 16 rows, where one program reading all of its row's partials is most of the time;
``ddtree_jax.kernels`` runs it from 17 rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.configs import is_pow2
from pallas_kernels.residual_norm_reference import check_operands


def residual_norm(partials_SPN, residual_PN, norm_N, *, eps: float, num_warps: int = 16, interpret: bool = False):
    """`residual_norm_reference` by the Pallas kernel (Triton lowering); same arguments and result, plus
    ``num_warps`` (a program's warps) and ``interpret`` (run in the Pallas interpreter)."""
    check_operands(partials_SPN, residual_PN, norm_N)
    if not kernel_supports(partials_SPN):
        raise ValueError(f"the residual_norm kernel needs powers of two for S and N, got partials "
                         f"{partials_SPN.shape}")
    return _residual_norm(partials_SPN, residual_PN, norm_N, eps=float(eps), num_warps=int(num_warps),
                          interpret=bool(interpret))


def kernel_supports(partials_SPN) -> bool:
    """Whether the kernel takes these partials: a power-of-two count ``S`` and width ``N`` (Triton blocks)."""
    return is_pow2(partials_SPN.shape[0]) and is_pow2(partials_SPN.shape[2])


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def _residual_norm(partials_SPN, residual_PN, norm_N, *, eps, num_warps, interpret):
    splits, rows, cols = partials_SPN.shape
    row_spec = pl.BlockSpec((None, cols), lambda p: (p, 0))
    out = jax.ShapeDtypeStruct((rows, cols), residual_PN.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps), grid=(rows,),
        in_specs=[pl.BlockSpec((splits, None, cols), lambda p: (0, p, 0)), row_spec,
                  pl.BlockSpec((cols,), lambda p: (0,))],
        out_specs=[row_spec, row_spec], out_shape=[out, out], interpret=interpret, name="residual_norm",
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
    )(partials_SPN, residual_PN, norm_N)


def _kernel(partials_ref, residual_ref, norm_ref, x_ref, normed_ref, *, eps):
    """Program p: row p of ``x = residual + sum_s partials[s]`` and its RMSNorm, rounded as the reference
    rounds (the product, then the sum with the residual, then the normalised row, then its product with
    the weight)."""
    dtype = x_ref.dtype
    product = jnp.sum(partials_ref[...], axis=0).astype(dtype).astype(jnp.float32)
    x = (residual_ref[...].astype(jnp.float32) + product).astype(dtype)
    x_ref[...] = x
    x32 = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.sum(x32 * x32) / x32.shape[0] + eps)
    normed = (x32 * inv).astype(dtype).astype(jnp.float32)
    normed_ref[...] = (norm_ref[...].astype(jnp.float32) * normed).astype(dtype)
