"""DFlash block-diffusion drafter conditioned on target hidden features (docs/design.md, "The
DFlash drafter").

Params: `params.DrafterParams` (``fc [len(target_layer_ids) * D, D]``, ``hidden_norm [D]``,
Qwen3 decoder ``layers``, ``final_norm [D]``). The drafter has no embedding or LM head: it uses
the target's. Context tokens contribute keys and values only:
their feature ``hidden_norm(taps @ fc)`` goes through each layer's ``k_proj`` (+ ``k_norm`` and
RoPE at the token's position) and ``v_proj``; block tokens attend to them and to each other.
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
from ddtree_jax.models.cache import KVCache, check_cache_shape
from ddtree_jax.models.params import DrafterParams, Model
from ddtree_jax.models.qwen3 import (
    Target,
    check_token_ids,
    config_fields_from_hf,
    config_fields_to_hf,
    project_vocab,
    target_forward_nocache,
)
from ddtree_jax.sharding import check_mesh
from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.matmul_reference import matmul_reference, rms_norm
from pallas_kernels.qk_norm_rope_reference import rope_tables


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """DFlash drafter hyper-parameters: the Qwen3 layer fields (HF names) plus the DFlash ones.

    ``target_layer_ids``: target layers whose output hidden states (HF ``hidden_states[id + 1]``)
    form the context features; ``mask_token_id``: the token filling block slots 1..;
    ``block_size``: root + ``block_size - 1`` drafted slots.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 40960

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "num_target_layers"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"DFlashConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.block_size, (int, np.integer)) or self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be an int >= 2, got {self.block_size!r}")
        if not self.target_layer_ids or not all(0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"DFlashConfig.target_layer_ids {self.target_layer_ids} must be non-empty ids "
                             f"in [0, num_target_layers={self.num_target_layers})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id={self.mask_token_id} outside [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads or self.head_dim % 2:
            raise ValueError(f"DFlashConfig: need num_attention_heads ({self.num_attention_heads}) a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads}) and an even head_dim "
                             f"({self.head_dim})")

    @property
    def num_features(self) -> int:
        """Width F of the concatenated target taps."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]):
        """From a DFlash ``config.json`` (``dflash_config: {target_layer_ids, mask_token_id}``)."""
        hf = dict(hf)
        hf.update(hf.get("dflash_config") or {})
        return cls(**config_fields_from_hf(cls, hf))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of a DFlash checkpoint."""
        hf = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
              "attention_bias": False}
        hf.update(config_fields_to_hf(self))
        hf["dflash_config"] = {"target_layer_ids": hf.pop("target_layer_ids"),
                               "mask_token_id": hf.pop("mask_token_id")}
        return hf


Drafter = Model[DFlashConfig, DrafterParams]


def init_drafter(config: DFlashConfig, key, dtype=jnp.bfloat16, *, std=0.02) -> Drafter:
    """Random params: normal(0, std) matrices, norm weights near 1."""
    key_fc, key_hn, key_fn, *layer_keys = jax.random.split(key, 3 + config.num_hidden_layers)
    d = config.hidden_size
    params = DrafterParams(
        fc=L.random_matrix(key_fc, (config.num_features, d), dtype, std),
        hidden_norm=L.random_norm(key_hn, d, dtype),
        layers=[L.init_layer(k, L.layer_shape(config), dtype, std) for k in layer_keys],
        final_norm=L.random_norm(key_fn, d, dtype))
    return Drafter(config=config, params=params)


def context_features(drafter: Drafter, ctx_feats_BCF, matmul=matmul_reference):
    """``hidden_norm(taps @ fc)``: one ``[D]`` feature per context token, ``[B, C, D]``."""
    feat_BCD = L.project(matmul, ctx_feats_BCF.astype(drafter.dtype), drafter.params.fc)
    return rms_norm(feat_BCD, drafter.params.hidden_norm, drafter.config.rms_norm_eps)


def drafter_head(drafter: Drafter, target: Target, hidden_BQD, matmul=matmul_reference):
    """Drafter final norm then the target's LM head: float32 logits ``[B, Q, V]``; with a draft
    vocabulary (`with_draft_vocab`), its columns only: ``[B, Q, W]``, column j for token
    ``draft_ids[j]``."""
    h_BQD = rms_norm(hidden_BQD, drafter.params.final_norm, drafter.config.rms_norm_eps).astype(target.dtype)
    if drafter.params.draft_head is not None:
        return L.project(matmul, h_BQD, drafter.params.draft_head, out_dtype=jnp.float32)
    return project_vocab(target, h_BQD, matmul)


def with_draft_vocab(drafter: Drafter, target: Target, token_ids) -> Drafter:
    """The drafter drafting from the tokens ``token_ids`` only (a draft vocabulary: W distinct ids in
    ``[0, V)``, any order; stored ascending): its head is the target LM head's W columns for them,
    so the head streams ``W / V`` of the LM head's bytes. Verification is unchanged, so the output
    keeps the target's law; a draft outside the W tokens is never proposed. ``token_ids=None``: the
    whole vocabulary again."""
    check_pair(drafter, target)
    if token_ids is None:
        return dataclasses.replace(drafter, params=dataclasses.replace(drafter.params, draft_ids=None,
                                                                       draft_head=None))
    ids = np.asarray(token_ids)
    vocab = target.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty 1-D int array, got {ids.dtype} {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab or np.unique(ids).size != ids.size:
        raise ValueError(f"token_ids must be distinct ids in [0, {vocab}), got {ids.size} ids in "
                         f"[{ids.min()}, {ids.max()}] ({ids.size - np.unique(ids).size} repeated)")
    ids = jnp.asarray(np.sort(ids), jnp.int32)
    head = target.params.embed[ids].T if target.params.lm_head is None else target.params.lm_head[:, ids]
    return dataclasses.replace(drafter, params=dataclasses.replace(drafter.params, draft_ids=ids, draft_head=head))


def _block_tokens(cfg: DFlashConfig, root_tokens_B):
    """``[root, MASK x (block_size - 1)]`` per request: int32 ``[B, block_size]``."""
    masks_BL = jnp.full((root_tokens_B.shape[0], cfg.block_size - 1), cfg.mask_token_id, jnp.int32)
    return jnp.concatenate([root_tokens_B[:, None].astype(jnp.int32), masks_BL], axis=1)


def _run_block(drafter, target, feat_BCD, block_tokens_BQ, positions_BX, attend, state, matmul=matmul_reference):
    """The block through the drafter's layers, the context features ``feat [B, C, D]`` joining every
    layer's keys and values as the first ``C`` of its ``X = C + Q`` attention rows (`L.run_decoder`)."""
    x_BQD = target.params.embed[block_tokens_BQ].astype(drafter.dtype)
    x_BQD, _, state = L.run_decoder(drafter.params.layers, L.layer_shape(drafter.config), x_BQD, positions_BX, attend,
                                    state, matmul=matmul, context_BCD=feat_BCD.astype(drafter.dtype))
    return x_BQD, state


@jax.jit
def _drafter_hidden(drafter, target, ctx_feats_BCF, ctx_positions_BC, block_tokens_BQ, block_positions_BQ, mask_BQK):
    shape = L.layer_shape(drafter.config)
    feat_BCD = context_features(drafter, ctx_feats_BCF)
    no_prefix_B = jnp.zeros(block_tokens_BQ.shape[:1], jnp.int32)
    attention = kernels.attention_fn("xla")

    def attend(i, inputs, state):  # the block's queries over the context's and the block's keys
        q_BXHD, k_BXKD, v_BXKD = inputs.split()
        return attention(q_BXHD[:, ctx_positions_BC.shape[1]:], k_BXKD.transpose(0, 2, 1, 3),
                         v_BXKD.transpose(0, 2, 1, 3), no_prefix_B, mask_BQK, scale=shape.head_dim ** -0.5), state

    positions_BX = jnp.concatenate([ctx_positions_BC, block_positions_BQ], axis=1)
    return _run_block(drafter, target, feat_BCD, block_tokens_BQ, positions_BX, attend, None)[0]


def drafter_hidden(drafter: Drafter, target: Target, ctx_feats_BCF, ctx_positions_BC, block_tokens_BQ,
                   block_positions_BQ, mask_BQK):
    """Cache-free drafter forward with an arbitrary mask (differentiable; used for training).

    ``ctx_feats [B, C, F]`` are raw target taps (``F = len(target_layer_ids) * D``) at
    ``ctx_positions [B, C]``; ``block_tokens [B, Q]`` at ``block_positions [B, Q]``;
    ``mask [B, Q, C + Q]``: block query q sees context c iff ``mask[b, q, c]`` and block
    slot q' iff ``mask[b, q, C + q']``. Returns the last layer's hidden ``[B, Q, D]``
    (before the final norm; see `drafter_head`).
    """
    check_pair(drafter, target)
    batch, num_ctx = _check_context(drafter, ctx_feats_BCF, ctx_positions_BC)
    if np.ndim(block_tokens_BQ) != 2 or np.shape(block_tokens_BQ)[0] != batch:
        raise ValueError(f"block_tokens_BQ must have shape [{batch}, Q], got {np.shape(block_tokens_BQ)}")
    num_block = np.shape(block_tokens_BQ)[1]
    check_token_ids("block_tokens_BQ", block_tokens_BQ, target.config.vocab_size)
    _check_int("block_positions_BQ", block_positions_BQ, (batch, num_block))
    want = (batch, num_block, num_ctx + num_block)
    if np.shape(mask_BQK) != want or jnp.result_type(mask_BQK) != jnp.bool_:
        raise ValueError(f"mask_BQK must be a bool array of shape {want}, got "
                         f"{jnp.result_type(mask_BQK)} {np.shape(mask_BQK)}")
    return _drafter_hidden(drafter, target, ctx_feats_BCF, ctx_positions_BC, block_tokens_BQ,
                           block_positions_BQ, mask_BQK)


def append_context(drafter: Drafter, cache: KVCache, ctx_feats_BCF, ctx_positions_BC, ctx_count_B,
                   matmul=matmul_reference, kv_write=kv_write_reference) -> KVCache:
    """Project the first ``ctx_count[b]`` rows of the raw target taps ``ctx_feats [B, C, F]`` (at
    ``ctx_positions [B, C]``) to every layer's context K/V, write them after the committed slots and
    advance ``lengths`` (no validation; `drafter_forward` does this as its first step). ``matmul``:
    a `kernels.matmul_fn` for the projections; ``kv_write``: a `kernels.kv_write_fn` for the writes."""
    shape = L.layer_shape(drafter.config)
    feat_BCD = context_features(drafter, ctx_feats_BCF, matmul)
    k_LBKSD, v_LBKSD = cache.k, cache.v
    rope_BCF = rope_tables(ctx_positions_BC, shape.head_dim, shape.rope_theta)
    for i, layer in enumerate(drafter.params.layers):
        k_BCKD, v_BCKD = L.key_value(layer, feat_BCD, rope_BCF, shape, matmul)
        k_LBKSD, v_LBKSD = kv_write(k_LBKSD, v_LBKSD, k_BCKD, v_BCKD, cache.lengths, layer=i)
    lengths_B = jnp.minimum(cache.lengths + ctx_count_B.astype(jnp.int32), cache.max_len)
    return KVCache(k=k_LBKSD, v=v_LBKSD, lengths=lengths_B)


@functools.partial(jax.jit, static_argnames=("attention_impl", "matmul_impl", "mesh"))
def _drafter_forward(drafter, target, cache, ctx_feats_BCF, ctx_positions_BC, ctx_count_B,
                     root_tokens_B, root_positions_B, attention_impl, matmul_impl, mesh):
    cfg = drafter.config
    matmul = kernels.matmul_fn(matmul_impl, mesh)
    batch, num_ctx = ctx_positions_BC.shape
    feat_BCD = context_features(drafter, ctx_feats_BCF, matmul)
    block_tokens_BQ = _block_tokens(cfg, root_tokens_B)
    block_positions_BQ = root_positions_B[:, None] + jnp.arange(cfg.block_size)[None, :]
    positions_BX = jnp.concatenate([ctx_positions_BC, block_positions_BQ], axis=1)
    # Each layer writes the context rows' K/V at [lengths, lengths + C) and the block's after them; the
    # block sees the committed cache, the first ctx_count context rows and itself.
    visible_BX = jnp.concatenate([jnp.arange(num_ctx)[None, :] < ctx_count_B[:, None],
                                  jnp.ones((batch, cfg.block_size), bool)], axis=1)
    mask_BQX = jnp.broadcast_to(visible_BX[:, None, :], (batch, cfg.block_size, visible_BX.shape[1]))
    attend = L.cached_attend(mask_BQX, cfg.head_dim ** -0.5, attention_impl, mesh, split_heads=False)
    hidden_BQD, cache = _run_block(drafter, target, feat_BCD, block_tokens_BQ, positions_BX, attend, cache, matmul)
    lengths_B = jnp.minimum(cache.lengths + ctx_count_B.astype(jnp.int32), cache.max_len)
    return drafter_head(drafter, target, hidden_BQD[:, 1:], matmul), KVCache(k=cache.k, v=cache.v, lengths=lengths_B)


def drafter_forward(drafter: Drafter, target: Target, cache: KVCache, ctx_feats_BCF, ctx_positions_BC,
                    ctx_count_B, root_tokens_B, root_positions_B, *, attention_impl="xla", matmul_impl="xla",
                    mesh=None):
    """One drafting step with the drafter's context cache.

    Appends context: the first ``ctx_count[b]`` of the C rows of ``ctx_feats [B, C, F]`` (raw
    target taps at ``ctx_positions [B, C]``) are projected to each layer's K/V and written at slots
    ``[lengths, lengths + ctx_count)``, then ``lengths += ctx_count`` (later rows are ignored). The
    block ``[root, MASK x (block_size - 1)]`` at positions ``root_positions + arange(block_size)``
    attends non-causally to all committed context and to itself (its K/V go to the slots after the C
    context rows' and are never committed). Each layer projects the context rows and the block in one
    product.
    Returns ``draft_logits [B, block_size - 1, V]`` float32 (slot k predicts position
    ``root_position + k``; ``[B, block_size - 1, W]`` with a draft vocabulary, see `drafter_head`)
    and the cache. Needs ``lengths + C + block_size`` within ``max_len`` (see `check_capacity`).
    ``attention_impl``, ``matmul_impl``: each one of `kernels.IMPLS` (see `ddtree_jax.kernels`).
    ``mesh``: the ``("dp", "tp")`` mesh the drafter (replicated) and its cache (batch over ``"dp"``)
    are placed on, for the kernels to run per device inside ``shard_map`` with whole heads
    (static; ``None``: one device).
    """
    check_pair(drafter, target)
    kernels.check_impl("attention_impl", attention_impl)
    kernels.check_impl("matmul_impl", matmul_impl)
    batch, _ = _check_context(drafter, ctx_feats_BCF, ctx_positions_BC)
    if mesh is not None:
        check_mesh(mesh, None, batch)
    _check_int("ctx_count_B", ctx_count_B, (batch,))
    check_token_ids("root_tokens_B", root_tokens_B, target.config.vocab_size)
    if np.shape(root_tokens_B) != (batch,):
        raise ValueError(f"root_tokens_B must have shape {(batch,)}, got {np.shape(root_tokens_B)}")
    _check_int("root_positions_B", root_positions_B, (batch,))
    cfg = drafter.config
    check_cache_shape(cache, num_layers=cfg.num_hidden_layers, batch=batch, kv_heads=cfg.num_key_value_heads,
                      head_dim=cfg.head_dim)
    return _drafter_forward(drafter, target, cache, ctx_feats_BCF, ctx_positions_BC, ctx_count_B,
                            root_tokens_B, root_positions_B, attention_impl, matmul_impl, mesh)


def drafter_logits(drafter: Drafter, target: Target, token_ids_BT):
    """Draft logits ``[B, block_size - 1, V]`` (``W`` with a draft vocabulary) for sequences ``[B, T]``, no cache.

    Context = the first T - 1 tokens (their target taps, at positions ``0 .. T-2``); root =
    the last token at position T - 1; the block sees all context and itself.
    """
    cfg = drafter.config
    check_pair(drafter, target)
    token_ids_BT = checks.as_array(token_ids_BT)
    _, taps_BTF = target_forward_nocache(target, token_ids_BT, tap_layers=cfg.target_layer_ids)
    batch, num = np.shape(token_ids_BT)
    block_tokens_BQ = _block_tokens(cfg, jnp.asarray(token_ids_BT)[:, -1])
    total = num - 1 + cfg.block_size
    positions_BT = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (batch, total))
    mask_BQK = jnp.ones((batch, cfg.block_size, total), bool)
    hidden_BQD = drafter_hidden(drafter, target, taps_BTF[:, :-1], positions_BT[:, :num - 1], block_tokens_BQ,
                                positions_BT[:, num - 1:], mask_BQK)
    return drafter_head(drafter, target, hidden_BQD[:, 1:])


def check_pair(drafter: Drafter, target: Target):
    """``ValueError`` unless the drafter fits the target: same hidden size and vocabulary, its
    ``num_target_layers`` the target's depth, and a draft vocabulary, if any, of W ids with a
    ``[D, W]`` head in the target's dtype."""
    d, t = drafter.config, target.config
    if d.hidden_size != t.hidden_size or d.vocab_size != t.vocab_size or d.num_target_layers != t.num_hidden_layers:
        raise ValueError(f"drafter (hidden_size={d.hidden_size}, vocab_size={d.vocab_size}, num_target_layers="
                         f"{d.num_target_layers}) does not match the target (hidden_size={t.hidden_size}, "
                         f"vocab_size={t.vocab_size}, num_hidden_layers={t.num_hidden_layers})")
    ids, head = drafter.params.draft_ids, drafter.params.draft_head
    if (ids is None) != (head is None):
        raise ValueError("drafter.params.draft_ids and draft_head must be set together (with_draft_vocab)")
    if ids is not None and (np.ndim(ids) != 1 or np.shape(head) != (t.hidden_size, np.shape(ids)[0])
                            or jnp.result_type(ids) != jnp.int32 or jnp.result_type(head) != target.dtype):
        raise ValueError(f"a draft vocabulary is int32 ids [W] and a {target.dtype} head [{t.hidden_size}, W], got "
                         f"{jnp.result_type(ids)} {np.shape(ids)} and {jnp.result_type(head)} {np.shape(head)}")


def _check_context(drafter, ctx_feats_BCF, ctx_positions_BC):
    if np.ndim(ctx_feats_BCF) != 3 or np.shape(ctx_feats_BCF)[2] != drafter.config.num_features:
        raise ValueError(f"ctx_feats_BCF must have shape [batch, C, {drafter.config.num_features}], "
                         f"got {np.shape(ctx_feats_BCF)}")
    if not jnp.issubdtype(jnp.result_type(ctx_feats_BCF), jnp.floating):
        raise ValueError(f"ctx_feats_BCF must be floating, got dtype {jnp.result_type(ctx_feats_BCF)}")
    batch, num_ctx = np.shape(ctx_feats_BCF)[:2]
    _check_int("ctx_positions_BC", ctx_positions_BC, (batch, num_ctx))
    return batch, num_ctx


def _check_int(name, x, shape):
    if np.shape(x) != shape or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name} must be an int array of shape {shape}, got {jnp.result_type(x)} {np.shape(x)}")
