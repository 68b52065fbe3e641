"""Building blocks shared by the Qwen3 target and the DFlash drafter.

Conventions: weights are in ``x @ W`` orientation; per-layer params are a dict with
``input_norm [D]``, ``wqkv [D, (Hq + 2 Hkv) Dh]`` (q, k, v columns in that order, head-major),
``q_norm [Dh]``, ``k_norm [Dh]``, ``wo [Hq Dh, D]``, ``post_norm [D]``,
``w_gate_up [D, 2 I]`` (gate columns first) and ``w_down [I, D]``. Norms, RoPE and softmax
run in float32; matmuls accumulate in float32 and return the activation dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models.cache import KVCache, write_scratch


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The shape fields of a Qwen3 decoder layer (shared by target and drafter configs)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


def layer_shape(config) -> LayerShape:
    """The `LayerShape` of any config carrying the Qwen3 layer fields."""
    return LayerShape(**{f.name: getattr(config, f.name) for f in dataclasses.fields(LayerShape)})


def matmul(x, w):
    """``x @ w`` accumulated in float32, returned in ``x``'s dtype."""
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x, weight, eps):
    """RMSNorm over the last axis, computed in float32 (as HF Qwen3): ``w * x / rms(x)``."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope(x_BNHD, positions_BN, theta):
    """Rotate-half (NeoX) rotary embedding of ``x [B, N, H, D]`` at integer ``positions [B, N]``.

    Pair ``(x[i], x[i + D/2])`` is rotated by angle ``pos * theta ** (-2i / D)``.
    """
    half = x_BNHD.shape[-1] // 2
    inv_freq_F = 1.0 / (theta ** (np.arange(half, dtype=np.float32) * 2.0 / x_BNHD.shape[-1]))
    angle_BNF = positions_BN.astype(jnp.float32)[..., None] * inv_freq_F
    cos_BN1F, sin_BN1F = jnp.cos(angle_BNF)[:, :, None], jnp.sin(angle_BNF)[:, :, None]
    x32 = x_BNHD.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos_BN1F - x2 * sin_BN1F, x2 * cos_BN1F + x1 * sin_BN1F], -1)
    return rotated.astype(x_BNHD.dtype)


def key_value(layer, x_BND, positions_BN, shape: LayerShape):
    """Keys and values of inputs ``x [B, N, D]`` from the k/v columns of ``wqkv``.

    Returns ``k_BNKD`` (k_norm then RoPE at ``positions``) and ``v_BNKD``. The DFlash drafter
    uses this alone for its context features, which have no queries.
    """
    q_cols = shape.num_attention_heads * shape.head_dim
    kv_cols = shape.num_key_value_heads * shape.head_dim
    kv_BNC = matmul(x_BND, layer["wqkv"][:, q_cols:])
    k_BNKD = kv_BNC[..., :kv_cols].reshape(*x_BND.shape[:2], -1, shape.head_dim)
    v_BNKD = kv_BNC[..., kv_cols:].reshape(*x_BND.shape[:2], -1, shape.head_dim)
    k_BNKD = rope(rms_norm(k_BNKD, layer["k_norm"], shape.rms_norm_eps), positions_BN, shape.rope_theta)
    return k_BNKD, v_BNKD


def attention_inputs(layer, x_BND, positions_BN, shape: LayerShape):
    """Input norm and q/k/v projections of a decoder layer, with q/k RMSNorm then RoPE.

    Returns ``q_BNHD, k_BNKD, v_BNKD`` (H query heads, K key/value heads).
    """
    h_BND = rms_norm(x_BND, layer["input_norm"], shape.rms_norm_eps)
    q_cols = shape.num_attention_heads * shape.head_dim
    q_BNHD = matmul(h_BND, layer["wqkv"][:, :q_cols]).reshape(*x_BND.shape[:2], -1, shape.head_dim)
    q_BNHD = rope(rms_norm(q_BNHD, layer["q_norm"], shape.rms_norm_eps), positions_BN, shape.rope_theta)
    k_BNKD, v_BNKD = key_value(layer, h_BND, positions_BN, shape)
    return q_BNHD, k_BNKD, v_BNKD


def layer_output(layer, x_BND, attn_BNHD, shape: LayerShape):
    """The rest of a decoder layer after attention: output projection, residual, SwiGLU MLP."""
    x_BND = x_BND + matmul(attn_BNHD.reshape(*x_BND.shape[:2], -1), layer["wo"])
    h_BND = rms_norm(x_BND, layer["post_norm"], shape.rms_norm_eps)
    gate_up_BNI = matmul(h_BND, layer["w_gate_up"])
    gate_BNI, up_BNI = jnp.split(gate_up_BNI, 2, axis=-1)
    return x_BND + matmul(jax.nn.silu(gate_BNI) * up_BNI, layer["w_down"])


def attention(q_BNHD, k_BKSD, v_BKSD, lengths_B, mask_BNM, *, scale, layer=None):
    """Masked GQA attention of N new queries over one layer's cache.

    ``k_BKSD, v_BKSD`` hold S slots per request; the first ``lengths[b]`` are the committed
    prefix, the M slots ``[lengths[b], lengths[b] + M)`` are new keys (M = N for a target
    forward). Slot s is visible to query i iff ``s < lengths[b]`` or ``mask[b, i, s - lengths[b]]``
    for a new slot. Query head h uses kv head ``h // (H // K)``. Softmax in float32.
    Returns ``[B, N, H, D]`` in ``q``'s dtype. A query that sees no slot gets a finite
    average of all slots (never NaN). With ``layer`` (an int), ``k, v`` are the stacked caches
    ``[L, B, K, S, D]`` of all layers and layer ``layer`` is attended.
    """
    if layer is not None:
        k_BKSD, v_BKSD = k_BKSD[layer], v_BKSD[layer]
    batch, num_q, num_heads, head_dim = q_BNHD.shape
    num_kv, num_slots = k_BKSD.shape[1], k_BKSD.shape[2]
    q_BKGND = q_BNHD.reshape(batch, num_q, num_kv, num_heads // num_kv, head_dim).transpose(0, 2, 3, 1, 4)
    scores_BKGNS = jnp.einsum("bkgnd,bksd->bkgns", q_BKGND, k_BKSD, preferred_element_type=jnp.float32)
    rel_BS = jnp.arange(num_slots)[None, :] - lengths_B[:, None]
    is_new_BS = (rel_BS >= 0) & (rel_BS < mask_BNM.shape[-1])
    new_idx_BNS = jnp.broadcast_to(jnp.clip(rel_BS, 0, mask_BNM.shape[-1] - 1)[:, None], (batch, num_q, num_slots))
    new_visible_BNS = jnp.take_along_axis(mask_BNM, new_idx_BNS, axis=2) & is_new_BS[:, None]
    visible_BNS = (rel_BS < 0)[:, None] | new_visible_BNS
    scores_BKGNS = jnp.where(visible_BNS[:, None, None], scores_BKGNS * scale, jnp.finfo(jnp.float32).min)
    probs_BKGNS = jax.nn.softmax(scores_BKGNS, axis=-1)
    out_BKGND = jnp.einsum("bkgns,bksd->bkgnd", probs_BKGNS.astype(v_BKSD.dtype), v_BKSD,
                           preferred_element_type=jnp.float32)
    return out_BKGND.transpose(0, 3, 1, 2, 4).reshape(batch, num_q, num_heads, head_dim).astype(q_BNHD.dtype)


ATTENTION_IMPLS = ("auto", "xla", "pallas", "interpret")
_KERNEL_BACKEND = {"pallas": "triton", "interpret": "interpret", "auto": "auto"}


def attention_impl_fn(impl: str, mesh=None, *, split_heads: bool = True):
    """The attention function behind the ``attention_impl`` switch (same signature as `attention`,
    ``layer`` included: the kernel reads a layer of the stacked cache in place).

    ``"xla"``: `attention`; ``"pallas"``: the Pallas Triton tree-attention kernel (CUDA GPUs);
    ``"auto"``: the kernel where it runs (a CUDA GPU of compute capability >= 8.0 and a
    power-of-two head_dim >= 16), `attention` elsewhere; ``"interpret"``: the kernel run by the
    Pallas interpreter (any backend; slow, for tests).

    With a ``("dp", "tp")`` ``mesh`` (a `jax.sharding.Mesh`), the kernel runs per device inside
    ``shard_map`` (`ddtree_jax.sharding.shard_attention`): batch over ``"dp"`` and, with
    ``split_heads`` (the tensor-parallel target), query heads and their KV heads over ``"tp"``;
    without it (the replicated drafter) every ``"tp"`` device attends with all heads. ``"xla"``
    ignores the mesh: XLA partitions `attention` itself.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "xla":
        return attention
    from pallas_kernels.tree_attention import tree_attention  # the kernels import this module

    kernel = functools.partial(tree_attention, backend=_KERNEL_BACKEND[impl])
    if mesh is None:
        return kernel
    from ddtree_jax.sharding import shard_attention  # the sharding rules import the models

    return shard_attention(kernel, mesh, split_heads=split_heads)


def cached_attend(mask_BNM, scale, impl: str = "xla", mesh=None, *, split_heads: bool = True):
    """The `run_decoder` attention step over a `KVCache` state: write layer i's new K/V to the
    scratch slots ``[lengths, lengths + N)``, then attention (``impl``, ``mesh`` and
    ``split_heads``: see `attention_impl_fn`) over the cache with ``mask``."""
    attend_fn = attention_impl_fn(impl, mesh, split_heads=split_heads)

    def attend(i, q_BNHD, k_BNKD, v_BNKD, cache: KVCache):
        cache = KVCache(k=write_scratch(cache.k, i, k_BNKD, cache.lengths),
                        v=write_scratch(cache.v, i, v_BNKD, cache.lengths), lengths=cache.lengths)
        return attend_fn(q_BNHD, cache.k, cache.v, cache.lengths, mask_BNM, scale=scale, layer=i), cache

    return attend


def run_decoder(layers, shape: LayerShape, x_BND, positions_BN, attend, state, tap_layers=()):
    """Run decoder layers on ``x [B, N, D]``; only the attention differs between callers.

    ``attend(i, q_BNHD, k_BNKD, v_BNKD, state) -> (out_BNHD, state)`` does layer i's attention
    (and any cache writes, threaded through ``state``). Returns the final hidden ``[B, N, D]``
    (before the final norm), the list of hidden states after each layer id in ``tap_layers``
    (in that order) and the state.
    """
    taps = {}
    for i, layer in enumerate(layers):
        with jax.named_scope(f"layer_{i}"):
            q_BNHD, k_BNKD, v_BNKD = attention_inputs(layer, x_BND, positions_BN, shape)
            attn_BNHD, state = attend(i, q_BNHD, k_BNKD, v_BNKD, state)
            x_BND = layer_output(layer, x_BND, attn_BNHD, shape)
        taps[i] = x_BND
    return x_BND, [taps[i] for i in tap_layers], state


def init_layer(key, shape: LayerShape, dtype, std=0.02):
    """Random decoder-layer params (normal(0, std) matrices, norm weights near 1)."""
    d, dh, inter = shape.hidden_size, shape.head_dim, shape.intermediate_size
    qkv_cols = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * dh
    mats = {"wqkv": (d, qkv_cols), "wo": (shape.num_attention_heads * dh, d),
            "w_gate_up": (d, 2 * inter), "w_down": (inter, d)}
    norms = {"input_norm": d, "q_norm": dh, "k_norm": dh, "post_norm": d}
    keys = jax.random.split(key, len(mats) + len(norms))
    layer = {name: (std * jax.random.normal(k, s)).astype(dtype) for k, (name, s) in zip(keys, mats.items())}
    layer.update({name: (1.0 + 0.1 * jax.random.normal(k, (n,))).astype(dtype)
                  for k, (name, n) in zip(keys[len(mats):], norms.items())})
    return layer
