"""Models: the Qwen3 target, the DFlash drafter and their KV cache."""

from ddtree_jax.models.cache import KVCache, check_capacity, commit, init_cache
from ddtree_jax.models.dflash import (
    DFlashConfig,
    Drafter,
    drafter_forward,
    drafter_head,
    drafter_hidden,
    drafter_logits,
    init_drafter,
)
from ddtree_jax.models.params import DecoderLayer, DrafterParams, Model, TargetParams
from ddtree_jax.models.qwen3 import (
    Qwen3Config,
    Target,
    init_target,
    target_forward,
    target_forward_nocache,
    target_logits,
)

__all__ = [
    "DFlashConfig",
    "DecoderLayer",
    "Drafter",
    "DrafterParams",
    "KVCache",
    "Model",
    "Qwen3Config",
    "Target",
    "TargetParams",
    "check_capacity",
    "commit",
    "drafter_forward",
    "drafter_head",
    "drafter_hidden",
    "drafter_logits",
    "init_cache",
    "init_drafter",
    "init_target",
    "target_forward",
    "target_forward_nocache",
    "target_logits",
]
