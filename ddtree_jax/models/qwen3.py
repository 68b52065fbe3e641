"""Qwen3 target model (HF ``Qwen3ForCausalLM`` architecture) with a tree-verify KV cache.

One forward serves prefill, decode and tree verify: N new tokens at given positions attend to
the request's committed cache slots and to each other through a mask ``[B, N, N]``.
Params: `params.TargetParams` (layers unrolled as a list; ``lm_head`` is ``None`` when
``tie_word_embeddings``: the head is ``embed.T``). The same functions run a Qwen3-MoE target
(`qwen3_moe.Qwen3MoeConfig`): its sparse layers are `params.MoeDecoderLayer`s, whose MLP block is
`moe.moe_mlp`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import checks, kernels
from ddtree_jax.models import layers as L
from ddtree_jax.models import moe
from ddtree_jax.models.cache import KVCache, check_cache_shape
from ddtree_jax.models.params import Model, TargetParams
from ddtree_jax.sharding import check_mesh
from pallas_kernels.matmul_reference import matmul_reference, rms_norm

_UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                "mlp_bias": False}
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 hyper-parameters, with HF ``config.json`` field names."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Ids of the layers whose MLP is routed experts: none in a dense Qwen3."""
        return ()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]):
        """From a transformers ``config.json`` dict (4.x top-level ``rope_theta`` or 5.x
        ``rope_parameters``). Raises ``ValueError`` for features this implementation lacks, and
        for a mixture-of-experts config (`qwen3_moe.Qwen3MoeConfig` reads Qwen3-MoE ones)."""
        for key in _EXPERT_COUNTS:
            if hf.get(key):
                raise ValueError(f"config.json: {key}={hf[key]!r}: a mixture-of-experts model is not a dense Qwen3 "
                                 f"(model_type {hf.get('model_type')!r}; Qwen3-MoE loads as Qwen3MoeConfig)")
        return cls(**config_fields_from_hf(cls, hf))

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.Qwen3ForCausalLM`` loads."""
        hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
              "attention_bias": False, "use_sliding_window": False}
        hf.update(config_fields_to_hf(self))
        return hf


def config_fields_from_hf(cls, hf):
    """The dataclass fields of ``cls`` read from an HF config dict (shared with DFlashConfig)."""
    hf = dict(hf)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json: only default RoPE is supported, got rope parameters {rope}")
    if "rope_theta" not in hf and "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]
    for key, supported in _UNSUPPORTED.items():
        if hf.get(key, supported) != supported:
            raise ValueError(f"config.json: {key}={hf[key]!r} is not supported (need {supported!r})")
    if hf.get("head_dim") is None and "hidden_size" in hf and "num_attention_heads" in hf:
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = required - hf.keys()
    if missing:
        raise ValueError(f"config.json: missing fields {sorted(missing)}")
    return {k: v for k, v in hf.items() if k in names}


def config_fields_to_hf(config):
    """The dataclass fields of ``config`` as HF config entries (5.x ``rope_parameters`` added)."""
    hf = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(config).items()}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    return {k: v for k, v in hf.items() if v is not None}


Target = Model[Qwen3Config, TargetParams]


def init_target(config: Qwen3Config, key, dtype=jnp.bfloat16, *, std=0.02) -> Target:
    """Random params: normal(0, std) matrices, norm weights near 1; a Qwen3-MoE config's sparse
    layers get routed experts (`moe.init_moe_layer`)."""
    shape = L.layer_shape(config)
    key_embed, key_head, key_norm, *layer_keys = jax.random.split(key, 3 + config.num_hidden_layers)
    d, v = config.hidden_size, config.vocab_size

    def layer(i, k):
        if i in config.sparse_layers:
            return moe.init_moe_layer(k, shape, config.num_experts, config.moe_intermediate_size, dtype, std)
        return L.init_layer(k, shape, dtype, std)

    params = TargetParams(
        embed=L.random_matrix(key_embed, (v, d), dtype, std),
        layers=[layer(i, k) for i, k in enumerate(layer_keys)],
        final_norm=L.random_norm(key_norm, d, dtype),
        lm_head=None if config.tie_word_embeddings else L.random_matrix(key_head, (d, v), dtype, std))
    return Target(config=config, params=params)


def project_vocab(target: Target, h_BND, matmul=matmul_reference):
    """The LM head (``lm_head`` through ``matmul``, a `kernels.matmul_fn`; or ``embed.T`` when tied,
    through XLA) without the final norm: float32 ``[B, N, V]``. The DFlash drafter applies it after
    its own final norm."""
    if target.params.lm_head is None:
        return jnp.einsum("bnd,vd->bnv", h_BND, target.params.embed, preferred_element_type=jnp.float32)
    return L.project(matmul, h_BND, target.params.lm_head, out_dtype=jnp.float32)


def run_layers(target: Target, tokens_BN, positions_BN, attend, state, tap_layers, logits_at_BK=None,
               matmul=matmul_reference, mlp=None):
    """The body of every target forward: embedding, `layers.run_decoder` (``attend``, ``state``,
    ``matmul`` and ``mlp`` as there; ``mlp`` default `moe.decoder_mlp()`), final
    norm, taps and LM head.
    Returns ``(logits, taps_BNF, state)`` as `target_forward`."""
    cfg = target.config
    mlp = moe.decoder_mlp() if mlp is None else mlp
    x_BND, taps, state = L.run_decoder(target.params.layers, L.layer_shape(cfg), target.params.embed[tokens_BN],
                                       positions_BN, attend, state, tap_layers, matmul, mlp)
    h_BND = rms_norm(x_BND, target.params.final_norm, cfg.rms_norm_eps)
    # As HF's hidden_states[id + 1], the last layer's tap is taken after the final norm.
    taps = [h_BND if i == cfg.num_hidden_layers - 1 else tap for i, tap in zip(tap_layers, taps)]
    taps_BNF = jnp.concatenate(taps, axis=-1) if taps else x_BND[..., :0]
    if logits_at_BK is not None:
        h_BND = jnp.take_along_axis(h_BND, logits_at_BK[:, :, None], axis=1)
    return project_vocab(target, h_BND, matmul), taps_BNF, state


@functools.partial(jax.jit, static_argnames=("tap_layers", "attention_impl", "matmul_impl", "mesh"))
def _target_forward(target, tokens_BN, positions_BN, mask_BNN, cache, logits_at_BK, tap_layers, attention_impl,
                    matmul_impl, mesh):
    attend = L.cached_attend(mask_BNN, target.config.head_dim ** -0.5, attention_impl, mesh)
    return run_layers(target, tokens_BN, positions_BN, attend, cache, tap_layers, logits_at_BK,
                      kernels.matmul_fn(matmul_impl, mesh), moe.decoder_mlp(mesh))


def target_forward(target: Target, tokens_BN, positions_BN, mask_BNN, cache: KVCache, *, tap_layers=(),
                   logits_at_BK=None, attention_impl="xla", matmul_impl="xla", mesh=None):
    """Forward of N new tokens per request over the cache (prefill, decode and tree verify).

    ``tokens_BN`` int, ``positions_BN`` int (RoPE positions), ``mask_BNN`` bool: new token i
    attends to every committed slot ``< cache.lengths[b]`` and to new token j iff
    ``mask[b, i, j]``. The new K/V are written to the scratch slots
    ``[lengths[b], lengths[b] + N)``; ``lengths`` is not advanced (use `commit`).
    Returns ``logits_BNV`` float32, ``taps_BNF`` (the hidden states after each layer in
    ``tap_layers``, concatenated in that order, ``F = len * D``: HF ``hidden_states[id + 1]``,
    so the last layer's tap is after the final norm) and the cache.
    With ``logits_at_BK`` (int ``[B, K]``, indices into the N new tokens), only those rows'
    logits are computed: ``[B, K, V]`` (e.g. the last prompt token of a long prefill).
    ``attention_impl``, ``matmul_impl``: each one of `kernels.IMPLS` (see `ddtree_jax.kernels`).
    ``mesh``: the ``("dp", "tp")`` mesh the target and cache are placed on (`ddtree_jax.sharding`),
    for the kernels and a Qwen3-MoE target's experts to run per device inside ``shard_map`` (static;
    ``None``: one device).
    """
    tap_layers = _check_taps(target.config, tap_layers)
    kernels.check_impl("attention_impl", attention_impl)
    kernels.check_impl("matmul_impl", matmul_impl)
    check_forward_args(target, tokens_BN, positions_BN, mask_BNN, cache, mesh)
    if logits_at_BK is not None:
        _check_rows(logits_at_BK, np.shape(tokens_BN))
    return _target_forward(target, tokens_BN, positions_BN, mask_BNN, cache, logits_at_BK, tap_layers,
                           attention_impl, matmul_impl, mesh)


@functools.partial(jax.jit, static_argnames=("tap_layers", "attention_impl", "matmul_impl", "mesh"))
def target_forward_packed(target: Target, tokens_1M, positions_1M, row_M, slot_M, mask_BNN, cache: KVCache, *,
                          tap_layers=(), attention_impl="xla", matmul_impl="xla", mesh=None):
    """`target_forward` over nodes packed across requests (no validation; for the engine's round).

    ``tokens_1M``, ``positions_1M``: ``[1, M]``, row ``m`` node ``slot_M[m]`` of request ``row_M[m]``
    (``row_M = B``: unused); ``mask_BNN`` and ``cache`` are per request, as in `target_forward`. The
    projections, MLPs and LM head run over the ``M`` packed rows; the attention and the scratch
    writes over the per-request layout (`layers.packed_attend`). Returns ``logits [1, M, V]``,
    ``taps [1, M, F]`` and the cache with each node's K/V at its request's scratch slot
    ``lengths + slot``.
    """
    attend = L.packed_attend(mask_BNN, row_M, slot_M, target.config.head_dim ** -0.5, attention_impl, mesh)
    return run_layers(target, tokens_1M, positions_1M, attend, cache, tuple(tap_layers), None,
                      kernels.matmul_fn(matmul_impl, mesh), moe.decoder_mlp(mesh))


@functools.partial(jax.jit, static_argnames="tap_layers")
def _target_forward_nocache(target, tokens_BN, positions_BN, mask_BNN, tap_layers):
    scale = target.config.head_dim ** -0.5
    no_prefix_B = jnp.zeros(tokens_BN.shape[:1], jnp.int32)

    attention = kernels.attention_fn("xla")

    def attend(i, inputs, state):
        q_BNHD, k_BNKD, v_BNKD = inputs.split()
        out = attention(q_BNHD, k_BNKD.transpose(0, 2, 1, 3), v_BNKD.transpose(0, 2, 1, 3),
                        no_prefix_B, mask_BNN, scale=scale)
        return out, state

    logits_BNV, taps_BNF, _ = run_layers(target, tokens_BN, positions_BN, attend, None, tap_layers)
    return logits_BNV, taps_BNF


def check_forward_args(target: Target, tokens_BN, positions_BN, mask_BNN, cache: KVCache, mesh=None):
    """Raise ``ValueError`` unless the arguments of `target_forward` fit ``target`` (shapes,
    dtypes, token ids, the cache's shape and, when given, the mesh)."""
    cfg = target.config
    _check_tokens(cfg, tokens_BN, positions_BN, mask_BNN)
    if mesh is not None:
        check_mesh(mesh, cfg, np.shape(tokens_BN)[0])
    check_cache_shape(cache, num_layers=cfg.num_hidden_layers, batch=np.shape(tokens_BN)[0],
                      kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)


def target_forward_nocache(target: Target, tokens_BN, positions_BN=None, mask_BNN=None, *, tap_layers=()):
    """Differentiable cache-free forward: token i attends to token j iff ``mask[b, i, j]``.

    Defaults: ``positions = arange(N)``, causal mask. Returns ``(logits_BNV float32, taps_BNF)``
    with the same meaning as `target_forward`.
    """
    tokens_BN = checks.as_array(tokens_BN)
    batch, num = _batch_and_length(tokens_BN)
    if positions_BN is None:
        positions_BN = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    if mask_BNN is None:
        mask_BNN = jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))
    positions_BN, mask_BNN = checks.as_array(positions_BN), checks.as_array(mask_BNN)
    tap_layers = _check_taps(target.config, tap_layers)
    _check_tokens(target.config, tokens_BN, positions_BN, mask_BNN)
    return _target_forward_nocache(target, tokens_BN, positions_BN, mask_BNN, tap_layers)


def target_logits(target: Target, token_ids_BT):
    """Causal logits ``[B, T, V]`` (float32) of full sequences ``[B, T]``, no cache."""
    return target_forward_nocache(target, token_ids_BT)[0]


def _check_taps(config, tap_layers):
    tap_layers = tuple(int(i) for i in tap_layers)
    bad = [i for i in tap_layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"tap_layers {tap_layers}: ids {bad} outside [0, {config.num_hidden_layers})")
    return tap_layers


def check_token_ids(name, tokens, vocab_size):
    """Raise ``ValueError`` unless ``tokens`` is an int array with ids in ``[0, vocab_size)``
    (values are checked only when concrete, i.e. outside jit)."""
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {jnp.result_type(tokens)}")
    checks.token_range(name, tokens, vocab_size)


def _check_rows(logits_at_BK, tokens_shape):
    batch, num = tokens_shape
    if np.ndim(logits_at_BK) != 2 or np.shape(logits_at_BK)[0] != batch \
            or not jnp.issubdtype(jnp.result_type(logits_at_BK), jnp.integer):
        raise ValueError(f"logits_at_BK must be an int array of shape [{batch}, K], got "
                         f"{jnp.result_type(logits_at_BK)} {np.shape(logits_at_BK)}")
    if checks.is_concrete(logits_at_BK):
        rows = np.asarray(logits_at_BK)
        if rows.size and (rows.min() < 0 or rows.max() >= num):
            raise ValueError(f"logits_at_BK must hold indices in [0, {num}), got min {rows.min()}, max {rows.max()}")


def _batch_and_length(tokens_BN):
    if np.ndim(tokens_BN) != 2:
        raise ValueError(f"tokens_BN must have shape [batch, N], got {np.shape(tokens_BN)}")
    return np.shape(tokens_BN)


def _check_tokens(config, tokens_BN, positions_BN, mask_BNN):
    batch, num = _batch_and_length(tokens_BN)
    if np.shape(positions_BN) != (batch, num):
        raise ValueError(f"positions_BN must have shape {(batch, num)}, got {np.shape(positions_BN)}")
    if np.shape(mask_BNN) != (batch, num, num):
        raise ValueError(f"mask_BNN must have shape {(batch, num, num)}, got {np.shape(mask_BNN)}")
    if jnp.result_type(mask_BNN) != jnp.bool_:
        raise ValueError(f"mask_BNN must be boolean, got dtype {jnp.result_type(mask_BNN)}")
    if not jnp.issubdtype(jnp.result_type(positions_BN), jnp.integer):
        raise ValueError(f"positions_BN must be an integer array, got dtype {jnp.result_type(positions_BN)}")
    check_token_ids("tokens_BN", tokens_BN, config.vocab_size)
