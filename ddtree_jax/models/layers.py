"""Building blocks shared by the Qwen3 target and the DFlash drafter.

A decoder layer's weights are a `params.DecoderLayer`. Norms, RoPE and softmax run in float32;
matmuls accumulate in float32 and return the activation dtype. Attention goes through
`ddtree_jax.kernels`, which picks the implementation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import kernels
from ddtree_jax.models.cache import KVCache
from ddtree_jax.models.params import DecoderLayer
from pallas_kernels.matmul_reference import matmul_reference, rms_norm
from pallas_kernels.qk_norm_rope_reference import norm_rotate, qk_norm_rope_reference, rope_tables


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The static fields of a Qwen3 decoder layer (shared by target and drafter configs); the
    routing fields are read by sparse (`MoeDecoderLayer`) layers only."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False


def layer_shape(config) -> LayerShape:
    """The `LayerShape` of any config carrying the Qwen3 layer fields (and, for a Qwen3-MoE
    config, the routing fields)."""
    fields = dataclasses.fields(LayerShape)
    return LayerShape(**{f.name: getattr(config, f.name) for f in fields
                         if f.default is dataclasses.MISSING or hasattr(config, f.name)})


def project(matmul, x_BNK, w_KN, *, residual_BNM=None, **kwargs):
    """``matmul`` (a `kernels.matmul_fn`, see ``matmul_reference`` for ``kwargs``) over the rows of
    ``x [B, N, K]``, plus ``residual [B, N, M]`` if given: ``[B, N, M]`` (with ``then_norm_N``, the pair
    ``matmul`` returns, each array ``[B, N, M]``; with ``with_partials``, the result ``[B, N, M]`` and the
    partials as ``matmul`` returns them, ``[S, R, M]`` or ``None``)."""
    batch, num = x_BNK.shape[:2]
    residual_MN = None if residual_BNM is None else residual_BNM.reshape(batch * num, -1)
    out = matmul(x_BNK.reshape(batch * num, -1), w_KN, residual_MN=residual_MN, **kwargs)
    if kwargs.get("with_partials"):
        return out[0].reshape(batch, num, -1), out[1]
    if isinstance(out, tuple):
        return tuple(None if y is None else y.reshape(batch, num, -1) for y in out)
    return out.reshape(batch, num, -1)


def key_value(layer: DecoderLayer, x_BND, rope_BNF, shape: LayerShape, matmul=matmul_reference):
    """Keys and values of inputs ``x [B, N, D]`` from the k/v columns of ``wqkv`` (read in place).

    Returns ``k_BNKD`` (k_norm then RoPE by ``rope_BNF``, the inputs' ``(cos, sin)`` `rope_tables`)
    and ``v_BNKD``. The DFlash drafter's prefill uses this alone for a prompt's context features, which
    have no queries (a round projects them with its block, `run_decoder`'s ``context``).
    """
    q_cols, kv_cols = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    kv_BNC = project(matmul, x_BND, layer.wqkv, columns=(q_cols, layer.wqkv.shape[1]))
    k_BNKD = kv_BNC[..., :kv_cols].reshape(*x_BND.shape[:2], -1, shape.head_dim)
    v_BNKD = kv_BNC[..., kv_cols:].reshape(*x_BND.shape[:2], -1, shape.head_dim)
    return norm_rotate(k_BNKD, layer.k_norm, shape.rms_norm_eps, *rope_BNF), v_BNKD


@dataclasses.dataclass(frozen=True)
class HeadInputs:
    """A layer's fused q/k/v projection ``qkv [B, N, (H + 2K) * D]`` and what its q/k RMSNorms and
    RoPE take: the arguments of ``qk_norm_rope_reference`` (and of the kernels that share its
    contract). An attention step turns it into heads (`split`), or hands it to a kernel that also
    writes the keys and values into a cache."""

    qkv_BNC: jax.Array
    q_norm_D: jax.Array
    k_norm_D: jax.Array
    cos_BNF: jax.Array
    sin_BNF: jax.Array
    heads: int
    kv_heads: int
    eps: float
    partials_SRC: jax.Array | None = None  # the product's split-K partials, where ``matmul`` hands them over

    @property
    def args(self) -> tuple:
        """The arrays, in ``qk_norm_rope_reference``'s order: ``(qkv, q_norm, k_norm, cos, sin)``."""
        return self.qkv_BNC, self.q_norm_D, self.k_norm_D, self.cos_BNF, self.sin_BNF

    @property
    def kwargs(self) -> dict:
        """The static fields as its keywords: ``heads``, ``kv_heads``, ``eps``."""
        return dict(heads=self.heads, kv_heads=self.kv_heads, eps=self.eps)

    def split(self, qk_norm_rope=qk_norm_rope_reference):
        """``q_BNHD, k_BNKD, v_BNKD`` by ``qk_norm_rope`` (a `kernels.qk_norm_rope_fn`)."""
        return qk_norm_rope(*self.args, **self.kwargs)


def attention_inputs(layer: DecoderLayer, x_BND, rope_BNF, shape: LayerShape, matmul=matmul_reference,
                     context_BCD=None, normed_BND=None) -> HeadInputs:
    """Input norm and the fused q/k/v projection of a decoder layer (one product, the norm as its
    prologue, or ``normed [B, N, D]``, ``x`` normalised already), with the layer's q/k norms and the
    forward's ``(cos, sin)`` `rope_tables` ``rope_BNF``. With ``context [B, C, D]``, those rows, not
    normalised, come first in the same product (its ``[B, C + N, ...]`` rows; ``rope_BNF`` covers them
    first). The product is asked ``with_partials``: its split-K partials, where ``matmul`` hands them over,
    go with the inputs for a kernel that sums them itself."""
    prologue = {}
    if context_BCD is None and normed_BND is None:
        rows_BXD, prologue = x_BND, dict(norm_K=layer.input_norm, eps=shape.rms_norm_eps)
    elif context_BCD is None:
        rows_BXD = normed_BND
    else:
        if normed_BND is None:
            normed_BND = rms_norm(x_BND, layer.input_norm, shape.rms_norm_eps)
        rows_BXD = jnp.concatenate([context_BCD, normed_BND], axis=1)
    qkv_BNC, partials_SRC = project(matmul, rows_BXD, layer.wqkv, with_partials=True, **prologue)
    return HeadInputs(qkv_BNC, layer.q_norm, layer.k_norm, *rope_BNF, heads=shape.num_attention_heads,
                      kv_heads=shape.num_key_value_heads, eps=shape.rms_norm_eps, partials_SRC=partials_SRC)


def dense_mlp(layer: DecoderLayer, x_BND, shape: LayerShape, matmul=matmul_reference, h_BND=None, then_norm_D=None):
    """The SwiGLU MLP block and its residual: ``x + down(swiglu(h @ w_gate_up))``, ``h = rms_norm(x,
    post_norm)`` (given, or the gate/up product's prologue), SwiGLU that product's epilogue and the
    residual add the down product's. Returns the new ``x`` and, for ``then_norm [D]`` (the next layer's
    input norm), its RMSNorm where ``matmul`` computes it with the down product (else ``None``)."""
    if h_BND is None:
        g_BNI = project(matmul, x_BND, layer.w_gate_up, norm_K=layer.post_norm, eps=shape.rms_norm_eps, gated=True)
    else:
        g_BNI = project(matmul, h_BND, layer.w_gate_up, gated=True)
    if then_norm_D is None:
        return project(matmul, g_BNI, layer.w_down, residual_BNM=x_BND), None
    return project(matmul, g_BNI, layer.w_down, residual_BNM=x_BND, then_norm_N=then_norm_D, eps=shape.rms_norm_eps)


def layer_output(layer, x_BND, attn_BNHD, shape: LayerShape, matmul=matmul_reference, mlp=dense_mlp,
                 then_norm_D=None):
    """The rest of a decoder layer after attention: output projection and residual (its epilogue), with
    the RMSNorm of the result where ``matmul`` computes it, then ``mlp(layer, x_BND, shape, matmul, h_BND,
    then_norm_D)``, the MLP block with its residual (`dense_mlp`, or `moe.decoder_mlp`'s choice per layer
    type). Returns the layer's output and its RMSNorm by ``then_norm [D]`` where computed (else ``None``)."""
    x_BND, h_BND = project(matmul, attn_BNHD.reshape(*x_BND.shape[:2], -1), layer.wo, residual_BNM=x_BND,
                           then_norm_N=layer.post_norm, eps=shape.rms_norm_eps)
    return mlp(layer, x_BND, shape, matmul, h_BND, then_norm_D)


def cached_attend(mask_BNM, scale, impl: str = "xla", mesh=None, *, split_heads: bool = True):
    """The `run_decoder` attention step over a `KVCache` state: layer i's q/k norms and RoPE and the
    write of its new K/V to the scratch slots ``[lengths, lengths + N)`` (`kernels.qk_norm_rope_write_fn`),
    then attention (``impl``, ``mesh`` and ``split_heads``: see `kernels.attention_fn`) over the cache
    with ``mask [B, N, M]``: the inputs' M rows are written, their last N are the queries (all of them
    but a `run_decoder` context's)."""
    attend_fn = kernels.attention_fn(impl, mesh, split_heads=split_heads)
    norm_rope_write = kernels.qk_norm_rope_write_fn(impl, mesh)

    def attend(i, inputs: HeadInputs, cache: KVCache):
        q_BNHD, k_LBKSD, v_LBKSD = norm_rope_write(*inputs.args, cache.k, cache.v, cache.lengths, layer=i,
                                                   queries=mask_BNM.shape[1], partials_SRC=inputs.partials_SRC,
                                                   **inputs.kwargs)
        cache = KVCache(k=k_LBKSD, v=v_LBKSD, lengths=cache.lengths)
        return attend_fn(q_BNHD, cache.k, cache.v, cache.lengths, mask_BNM, scale=scale, layer=i), cache

    return attend


def packed_attend(mask_BNM, row_M, slot_M, scale, impl: str = "xla", mesh=None):
    """`cached_attend` for rows packed across requests (a budget policy's ragged trees, see
    `ddtree_jax.budget.packing`): inputs ``[1, M, ...]`` whose row ``m`` is node ``slot_M[m]`` of
    request ``row_M[m]`` (``row = B``: an unused row). Each layer splits the packed rows into heads,
    scatters q/k/v into the per-request layout ``[B, N, ...]`` (zeros where no row lands), writes K/V to
    each request's own scratch slots and attends with the per-request ``mask [B, N, N]``, then gathers
    the packed rows back: requests never see each other's nodes or caches."""
    attend_fn = kernels.attention_fn(impl, mesh)
    qk_norm_rope, kv_write = kernels.qk_norm_rope_fn(impl, mesh), kernels.kv_write_fn(impl, mesh)
    batch, num = mask_BNM.shape[:2]

    def unpack(x_1MXD):
        return jnp.zeros((batch, num, *x_1MXD.shape[2:]), x_1MXD.dtype).at[row_M, slot_M].set(x_1MXD[0],
                                                                                               mode="drop")

    def run(i, inputs: HeadInputs, cache: KVCache):
        q_BNHD, k_BNKD, v_BNKD = (unpack(x) for x in inputs.split(qk_norm_rope))
        k_LBKSD, v_LBKSD = kv_write(cache.k, cache.v, k_BNKD, v_BNKD, cache.lengths, layer=i)
        cache = KVCache(k=k_LBKSD, v=v_LBKSD, lengths=cache.lengths)
        out_BNHD = attend_fn(q_BNHD, cache.k, cache.v, cache.lengths, mask_BNM, scale=scale, layer=i)
        return out_BNHD[jnp.minimum(row_M, batch - 1), slot_M][None], cache

    return run


def run_decoder(layers, shape: LayerShape, x_BND, positions_BN, attend, state, tap_layers=(),
                matmul=matmul_reference, mlp=dense_mlp, context_BCD=None):
    """Run decoder layers on ``x [B, N, D]``; only the attention and the MLP differ between callers.

    ``attend(i, inputs, state) -> (out_BNHD, state)`` does layer i's attention from its `HeadInputs`
    (the q/k/v projection; the q/k norms and RoPE, whose tables are computed once per forward, are the
    step's own, with any cache writes threaded through ``state``); ``matmul`` (a `kernels.matmul_fn`)
    does the projections, each layer's last one also its output's RMSNorm by the next layer's input norm
    where ``matmul`` computes it (`kernels.residual_norm_product`); ``mlp`` the MLP block (see
    `layer_output`). ``context [B, C, D]``: rows
    whose keys and values join every layer's (the DFlash drafter's context features, the same at every
    layer): they come first in the inputs ``attend`` gets (`attention_inputs`; ``positions [B, C + N]``
    covers them first), which returns the outputs of the last ``N`` rows alone. Returns the final hidden
    ``[B, N, D]`` (before the final norm), the list of hidden states after each layer id in
    ``tap_layers`` (in that order) and the state.
    """
    taps, normed_BND = {}, None
    rope_BNF = rope_tables(positions_BN, shape.head_dim, shape.rope_theta)
    for i, layer in enumerate(layers):
        then_norm_D = layers[i + 1].input_norm if i + 1 < len(layers) else None
        with jax.named_scope(f"layer_{i}"):
            inputs = attention_inputs(layer, x_BND, rope_BNF, shape, matmul, context_BCD, normed_BND)
            attn_BNHD, state = attend(i, inputs, state)
            x_BND, normed_BND = layer_output(layer, x_BND, attn_BNHD, shape, matmul, mlp, then_norm_D)
        taps[i] = x_BND
    return x_BND, [taps[i] for i in tap_layers], state


def random_matrix(key, shape, dtype, std):
    """A normal(0, std) weight matrix."""
    return (std * jax.random.normal(key, shape)).astype(dtype)


def random_norm(key, size, dtype):
    """Norm weights near 1 (normal(1, 0.1)), so that tests see them act."""
    return (1.0 + 0.1 * jax.random.normal(key, (size,))).astype(dtype)


def init_attention(keys, shape: LayerShape, dtype, std=0.02) -> dict:
    """The random attention fields and norms every decoder layer has, from six keys (``wqkv``,
    ``wo``, then the four norms): ``{field: array}``."""
    d, dh = shape.hidden_size, shape.head_dim
    qkv_cols = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * dh
    return dict(wqkv=random_matrix(keys[0], (d, qkv_cols), dtype, std),
                wo=random_matrix(keys[1], (shape.num_attention_heads * dh, d), dtype, std),
                input_norm=random_norm(keys[2], d, dtype), q_norm=random_norm(keys[3], dh, dtype),
                k_norm=random_norm(keys[4], dh, dtype), post_norm=random_norm(keys[5], d, dtype))


def init_layer(key, shape: LayerShape, dtype, std=0.02) -> DecoderLayer:
    """Random decoder-layer params (normal(0, std) matrices, norm weights near 1)."""
    d, inter = shape.hidden_size, shape.intermediate_size
    k = jax.random.split(key, 8)
    return DecoderLayer(**init_attention(k[np.array([0, 1, 4, 5, 6, 7])], shape, dtype, std),
                        w_gate_up=random_matrix(k[2], (d, 2 * inter), dtype, std),
                        w_down=random_matrix(k[3], (inter, d), dtype, std))
