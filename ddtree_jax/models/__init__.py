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
from ddtree_jax.models.layers import attention
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
    "Drafter",
    "KVCache",
    "Qwen3Config",
    "Target",
    "attention",
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
