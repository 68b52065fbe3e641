"""The routed-experts MLP of a Qwen3-MoE sparse layer (docs/design.md, "The Qwen3-MoE target").

Per token (rows of ``h = rms_norm(x, post_norm)``, M = B N tokens, k = ``num_experts_per_tok``):

1. **Route.** Router logits ``h @ router`` accumulated in float32, softmax over the E experts in
   float32, the k most probable experts (ties to the smaller id) and their probabilities,
   renormalised to sum 1 when ``norm_topk_prob``.
2. **Dispatch.** The ``M k`` (token, expert) assignments are sorted by expert (stably), so each
   expert's rows are contiguous and one grouped matmul (``jax.lax.ragged_dot``, group sizes = the
   rows per expert) multiplies every group by its own expert only: ``[gate | up]``, SwiGLU, down.
3. **Combine.** The rows go back to assignment order and each token sums its k outputs weighted by
   the routing probabilities (float32), then the residual.

Expert parallelism: with a ``("dp", "tp")`` mesh, experts are split over ``"tp"`` (device j holds
experts ``[j E/tp, (j + 1) E/tp)``, `sharding.target_specs`) and step 2 runs per device inside
``shard_map``: every device has its ``"dp"`` block of the tokens and their routes (replicated over
``"tp"``, as the activations of the tensor-parallel attention are), computes the assignments of
the experts it holds (the others are sorted past its groups and masked) and the partial sums are
all-reduced over ``"tp"``, as after a row-split ``w_down``. No expert weight moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ddtree_jax.models import layers as L
from ddtree_jax.models.params import MoeDecoderLayer
from pallas_kernels.matmul_reference import rms_norm, swiglu


def route(h_MD, router_DE, top_k: int, normalize: bool):
    """Routing of tokens ``h [M, D]``: ``(weights_MK float32, experts_MK int32)``, the ``top_k``
    experts of each token in descending probability (softmax of ``h @ router`` in float32) and
    their probabilities, renormalised over the k when ``normalize``."""
    logits_ME = jnp.matmul(h_MD, router_DE, preferred_element_type=jnp.float32)
    weights_MK, experts_MK = jax.lax.top_k(jax.nn.softmax(logits_ME, axis=-1), top_k)
    if normalize:
        weights_MK = weights_MK / jnp.sum(weights_MK, axis=-1, keepdims=True)
    return weights_MK, experts_MK.astype(jnp.int32)


def grouped_experts(h_MD, weights_MK, experts_MK, gate_up_EDJ, down_EID, first_expert=0):
    """``sum_k weights[m, k] * expert_{experts[m, k]}(h[m])`` over the experts held here, ids
    ``[first_expert, first_expert + E)`` (``gate_up [E, D, 2I]``, ``down [E, I, D]``); an assignment
    to an expert held elsewhere adds nothing. float32 ``[M, D]``.

    An expert is ``swiglu(h @ gate_up) @ down``; its product is rounded to ``h``'s dtype before the
    SwiGLU, as the dense MLP's is (`matmul_reference`)."""
    num_tokens, top_k = experts_MK.shape
    num_experts = gate_up_EDJ.shape[0]
    local_A = experts_MK.reshape(-1) - first_expert
    held_A = (local_A >= 0) & (local_A < num_experts)
    group_A = jnp.where(held_A, local_A, num_experts)  # not held: sorted after every group
    order_A = jnp.argsort(group_A, stable=True)
    sizes_E = jnp.zeros((num_experts,), jnp.int32).at[group_A].add(1, mode="drop")
    x_AD = h_MD[order_A // top_k]
    gate_up_AJ = jax.lax.ragged_dot(x_AD, gate_up_EDJ, sizes_E, preferred_element_type=jnp.float32)
    out_AD = jax.lax.ragged_dot(swiglu(gate_up_AJ.astype(h_MD.dtype)), down_EID, sizes_E,
                                preferred_element_type=jnp.float32)
    inverse_A = jnp.zeros_like(order_A).at[order_A].set(jnp.arange(order_A.shape[0], dtype=order_A.dtype))
    out_MKD = out_AD[inverse_A].reshape(num_tokens, top_k, -1)
    held_MK = held_A.reshape(num_tokens, top_k)
    out_MKD = jnp.where(held_MK[..., None], out_MKD, 0.0)  # rows past the groups are not defined
    return jnp.einsum("mk,mkd->md", jnp.where(held_MK, weights_MK, 0.0), out_MKD)


def expert_parallel(mesh: Mesh):
    """`grouped_experts` with the experts split over ``"tp"`` of ``mesh`` and the tokens over
    ``"dp"``, inside ``shard_map`` (see the module docstring); the same signature less
    ``first_expert``."""
    def body(h_MD, weights_MK, experts_MK, gate_up_EDJ, down_EID):
        first = jax.lax.axis_index("tp") * gate_up_EDJ.shape[0]
        partial_MD = grouped_experts(h_MD, weights_MK, experts_MK, gate_up_EDJ, down_EID, first)
        return jax.lax.psum(partial_MD, "tp")

    tokens, experts = P("dp", None), P("tp", None, None)
    return jax.shard_map(body, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts), out_specs=tokens)


def moe_mlp(layer: MoeDecoderLayer, x_BND, shape: L.LayerShape, mesh: Mesh | None = None, routes=None,
            h_BND=None):
    """The sparse MLP block and its residual: ``x + experts(h)``, ``h = rms_norm(x, post_norm)`` (or
    ``h [B, N, D]`` given, computed already), routed by `route`, computed by `grouped_experts`
    (expert-parallel over ``mesh`` when given). With a list ``routes``, the expert ids ``[B, N, k]`` are
    appended to it (while tracing)."""
    batch, num, dim = x_BND.shape
    h_BND = rms_norm(x_BND, layer.post_norm, shape.rms_norm_eps) if h_BND is None else h_BND
    h_MD = h_BND.reshape(batch * num, dim)
    weights_MK, experts_MK = route(h_MD, layer.router, shape.num_experts_per_tok, shape.norm_topk_prob)
    if routes is not None:
        routes.append(experts_MK.reshape(batch, num, -1))
    experts = grouped_experts if mesh is None else expert_parallel(mesh)
    y_MD = experts(h_MD, weights_MK, experts_MK, layer.experts_gate_up, layer.experts_down)
    return x_BND + y_MD.astype(x_BND.dtype).reshape(batch, num, dim)


def decoder_mlp(mesh: Mesh | None = None, routes=None):
    """The ``mlp`` of `layers.run_decoder` for a target: `moe_mlp` for a `MoeDecoderLayer`
    (``mesh``, ``routes``: see there; the next layer's input norm is left to its q/k/v product),
    `layers.dense_mlp` for a dense layer."""
    def mlp(layer, x_BND, shape, matmul, h_BND=None, then_norm_D=None):
        if isinstance(layer, MoeDecoderLayer):
            return moe_mlp(layer, x_BND, shape, mesh, routes, h_BND), None
        return L.dense_mlp(layer, x_BND, shape, matmul, h_BND, then_norm_D)

    return mlp


def init_moe_layer(key, shape: L.LayerShape, num_experts: int, expert_size: int, dtype, std=0.02) -> MoeDecoderLayer:
    """Random sparse-layer params: the attention of `layers.init_attention`, a normal(0, std)
    router and experts of width ``expert_size``."""
    d = shape.hidden_size
    k = jax.random.split(key, 9)
    return MoeDecoderLayer(**L.init_attention(k[:6], shape, dtype, std),
                           router=L.random_matrix(k[6], (d, num_experts), dtype, std),
                           experts_gate_up=L.random_matrix(k[7], (num_experts, d, 2 * expert_size), dtype, std),
                           experts_down=L.random_matrix(k[8], (num_experts, expert_size, d), dtype, std))
