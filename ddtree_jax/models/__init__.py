"""Models: the Qwen3 and Qwen3-MoE targets, the DFlash drafter and their KV cache."""

from ddtree_jax.models.cache import KVCache, check_capacity, commit, init_cache
from ddtree_jax.models.dflash import (
    DFlashConfig,
    Drafter,
    drafter_forward,
    drafter_head,
    drafter_hidden,
    drafter_logits,
    init_drafter,
    with_draft_vocab,
)
from ddtree_jax.models.params import DecoderLayer, DrafterParams, Model, MoeDecoderLayer, TargetParams
from ddtree_jax.models.qwen3 import (
    Qwen3Config,
    Target,
    init_target,
    target_forward,
    target_forward_nocache,
    target_logits,
)
from ddtree_jax.models.qwen3_moe import Qwen3MoeConfig, distinct_experts, expert_routes

__all__ = [
    "DFlashConfig",
    "DecoderLayer",
    "Drafter",
    "DrafterParams",
    "KVCache",
    "Model",
    "MoeDecoderLayer",
    "Qwen3Config",
    "Qwen3MoeConfig",
    "Target",
    "TargetParams",
    "check_capacity",
    "commit",
    "distinct_experts",
    "drafter_forward",
    "drafter_head",
    "drafter_hidden",
    "drafter_logits",
    "expert_routes",
    "init_cache",
    "init_drafter",
    "init_target",
    "target_forward",
    "target_forward_nocache",
    "target_logits",
    "with_draft_vocab",
]
