"""Qwen3-MoE target (HF ``Qwen3MoeForCausalLM`` architecture, e.g. Qwen3-30B-A3B).

A Qwen3 decoder whose *sparse* layers replace the SwiGLU MLP by E SwiGLU experts behind a softmax
router: each token goes to its ``num_experts_per_tok`` most probable experts (`moe.route`) and sums
their outputs weighted by the router probabilities, renormalised over the chosen experts when
``norm_topk_prob``. Layer i is sparse unless ``i`` is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``, as in transformers; the other layers are dense Qwen3 layers
of width ``intermediate_size``.

Everything but the MLP block is the Qwen3 target's: the same `Target` container (sparse layers
are `params.MoeDecoderLayer`s), `qwen3.init_target`, `qwen3.target_forward` (prefill, decode and
tree verify over the same KV cache, the same hidden-state taps for a DFlash drafter),
`checkpoint.load_target` / `save_target` (which choose this config by ``model_type: qwen3_moe``)
and `sharding.shard_target` (experts split over ``"tp"``). Variants this implementation lacks
(shared experts, other routers) are rejected by name, never run as something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax.models import layers as L
from ddtree_jax.models import moe
from ddtree_jax.models.cache import KVCache
from ddtree_jax.models.qwen3 import (
    Qwen3Config,
    Target,
    check_forward_args,
    config_fields_from_hf,
    config_fields_to_hf,
    run_layers,
)

# Fields of mixture-of-experts configs (other families' names included) and the value plain
# Qwen3-MoE routing has; anything else is a variant this implementation does not compute.
_MOE_VARIANTS = {
    "shared_expert_intermediate_size": (0, "shared experts"),
    "n_shared_experts": (0, "shared experts"),
    "num_shared_experts": (0, "shared experts"),
    "scoring_func": ("softmax", "a non-softmax router"),
    "topk_method": ("greedy", "another top-k routing method"),
    "n_group": (1, "group-limited routing"),
    "topk_group": (1, "group-limited routing"),
    "routed_scaling_factor": (1.0, "scaled expert outputs"),
    "first_k_dense_replace": (0, "DeepSeek-style leading dense layers"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE hyper-parameters, with HF ``config.json`` field names: the Qwen3 fields
    (``intermediate_size`` is the width of the dense layers) plus the experts'."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"Qwen3MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"Qwen3MoeConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        layers = tuple(self.mlp_only_layers)
        if not all(isinstance(i, (int, np.integer)) and 0 <= i < self.num_hidden_layers for i in layers):
            raise ValueError(f"Qwen3MoeConfig.mlp_only_layers must hold layer ids in [0, {self.num_hidden_layers}), "
                             f"got {self.mlp_only_layers!r}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in layers))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """Ids of the layers whose MLP is routed experts (transformers' rule, see the module docstring)."""
        return tuple(i for i in range(self.num_hidden_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]):
        """From a transformers ``config.json`` dict (``num_experts`` or transformers 5's
        ``num_local_experts``). Raises ``ValueError`` naming the field for a variant this
        implementation lacks (shared experts, other routers) or a config without experts."""
        hf = dict(hf)
        if hf.get("model_type", "qwen3_moe") != "qwen3_moe":
            raise ValueError(f"config.json: model_type={hf['model_type']!r} is not supported by Qwen3MoeConfig "
                             f"(need 'qwen3_moe')")
        for key, (supported, what) in _MOE_VARIANTS.items():
            if hf.get(key) is not None and hf[key] != supported:
                raise ValueError(f"config.json: {key}={hf[key]!r} is not supported ({what}; need {supported!r})")
        if "num_local_experts" in hf:
            experts = hf.pop("num_local_experts")
            if hf.setdefault("num_experts", experts) != experts:
                raise ValueError(f"config.json: num_experts={hf['num_experts']!r} and num_local_experts={experts!r} "
                                 f"disagree")
        if hf.get("mlp_only_layers") is None:
            hf["mlp_only_layers"] = ()
        return cls(**config_fields_from_hf(cls, hf))

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.Qwen3MoeForCausalLM`` loads."""
        hf = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
              "attention_bias": False, "use_sliding_window": False}
        hf.update(config_fields_to_hf(self))
        return hf


def distinct_experts(experts_SBNK, num_experts: int):
    """How many distinct experts the N tokens of each request touch, per sparse layer: ``[S, B]``
    from the expert ids ``[S, B, N, k]`` (e.g. of `expert_routes`)."""
    touched_SBE = jnp.any(jax.nn.one_hot(experts_SBNK, num_experts, dtype=jnp.bool_), axis=(2, 3))
    return jnp.sum(touched_SBE, axis=-1)


@jax.jit
def _expert_routes(target, tokens_BN, positions_BN, mask_BNN, cache):
    routes = []
    attend = L.cached_attend(mask_BNN, target.config.head_dim ** -0.5)
    run_layers(target, tokens_BN, positions_BN, attend, cache, (), mlp=moe.decoder_mlp(routes=routes))
    return jnp.stack(routes)


def expert_routes(target: Target, tokens_BN, positions_BN, mask_BNN, cache: KVCache):
    """The experts each token is routed to in every sparse layer of `qwen3.target_forward` on the
    same arguments (XLA path, one device): int32 ``[S, B, N, k]``, ``S = len(sparse_layers)`` in
    layer order, each token's k experts in descending router probability."""
    if not target.config.sparse_layers:
        raise ValueError("expert_routes needs a target with sparse layers, got one without "
                         f"({type(target.config).__name__})")
    check_forward_args(target, tokens_BN, positions_BN, mask_BNN, cache)
    return _expert_routes(target, tokens_BN, positions_BN, mask_BNN, cache)

