"""Typed parameter pytrees of the models and the model container they share.

Weights are in ``x @ W`` orientation (``[in, out]``); q/k/v and gate/up are fused into one matrix
each, so a decoder layer runs two matmuls before attention and after it instead of five. Shape
letters: D hidden, Dh head, Hq query heads, Hkv key/value heads, I MLP width (of one expert in a
sparse layer), E experts, V vocabulary, W a draft vocabulary, F = (number of target taps) x D.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Generic, TypeVar

import jax
from jaxtyping import Array, Float, Int


def _pytree(cls):
    """Register a frozen dataclass whose fields are all array leaves (or pytrees of them)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in dataclasses.fields(cls)],
                                            meta_fields=[])


@dataclasses.dataclass(frozen=True)
class _AttentionBlock:
    """The fields every decoder layer has: the attention block and the two norms."""

    input_norm: Float[Array, " D"]
    wqkv: Float[Array, "D C"]  # C = (Hq + 2 Hkv) Dh: q, k, v column blocks, head-major in each
    q_norm: Float[Array, " Dh"]
    k_norm: Float[Array, " Dh"]
    wo: Float[Array, "HqDh D"]
    post_norm: Float[Array, " D"]  # the MLP's input norm


@_pytree
class DecoderLayer(_AttentionBlock):
    """One Qwen3 decoder layer (the target's and the DFlash drafter's): attention, then a SwiGLU MLP."""

    w_gate_up: Float[Array, "D I2"]  # gate columns, then up columns
    w_down: Float[Array, "I D"]


@_pytree
class MoeDecoderLayer(_AttentionBlock):
    """A Qwen3-MoE sparse layer: the same attention, then E SwiGLU experts behind a router
    (`ddtree_jax.models.moe`). Expert weights are stacked along their first axis, each expert in
    the dense layer's orientation, so one grouped matmul (``jax.lax.ragged_dot``) takes them whole
    and the expert-parallel split is a split of that axis."""

    router: Float[Array, "D E"]
    experts_gate_up: Float[Array, "E D I2"]  # per expert: gate columns, then up columns
    experts_down: Float[Array, "E I D"]


@_pytree
class TargetParams:
    """A Qwen3 or Qwen3-MoE target (the latter's sparse layers are `MoeDecoderLayer`s). ``lm_head``
    is ``None`` when the embeddings are tied (the head is ``embed.T``)."""

    embed: Float[Array, "V D"]
    layers: list[DecoderLayer | MoeDecoderLayer]
    final_norm: Float[Array, " D"]
    lm_head: Float[Array, "D V"] | None

    @property
    def dtype(self):
        return self.embed.dtype


@_pytree
class DrafterParams:
    """A DFlash drafter: the projection of the target's taps to one context feature per token,
    its decoder layers and final norm (it borrows the target's embedding and LM head).

    ``draft_ids`` and ``draft_head`` (both or neither; `dflash.with_draft_vocab`): a draft vocabulary,
    W token ids in ascending order and the target LM head's columns for them, with which the drafter
    drafts from those W tokens only. ``None``: the whole vocabulary."""

    fc: Float[Array, "F D"]
    hidden_norm: Float[Array, " D"]
    layers: list[DecoderLayer]
    final_norm: Float[Array, " D"]
    draft_ids: Int[Array, " W"] | None = None
    draft_head: Float[Array, "D W"] | None = None

    @property
    def dtype(self):
        return self.fc.dtype


ConfigT = TypeVar("ConfigT")
ParamsT = TypeVar("ParamsT")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class Model(Generic[ConfigT, ParamsT]):
    """A model: its static ``config`` (hashable, part of every jit cache key) and its ``params``
    pytree. ``Target`` and ``Drafter`` are this container with their own config and params."""

    config: ConfigT
    params: ParamsT

    @property
    def dtype(self):
        """The dtype of the weights."""
        return self.params.dtype
