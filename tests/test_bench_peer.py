"""The PyTorch forward that experiments/bench_peer.py times computes what our target forward does."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.models import Qwen3Config, init_cache, init_target, target_forward  # noqa: E402
from experiments.bench_peer import TorchQwen3, weights_from  # noqa: E402


def test_torch_peer_equals_our_forward_after_a_prefix():
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    target = init_target(cfg, jax.random.key(3), jnp.float32, std=0.2)
    tokens = np.random.default_rng(0).integers(0, 64, (2, 7))
    peer = TorchQwen3(cfg, weights_from(target), batch=2, slots=12)
    with torch.no_grad():
        peer(torch.from_numpy(tokens[:, :4]), torch.tensor(0))
        theirs = peer(torch.from_numpy(tokens[:, 4:]), torch.tensor(4)).numpy()
    cache = init_cache(2, 2, 2, 12, 8, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((7, 7), bool)), (2, 7, 7))
    ours = np.asarray(target_forward(target, jnp.asarray(tokens, jnp.int32), positions, causal, cache)[0])[:, 4:]
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    assert np.abs(ours).max() > 0.1
