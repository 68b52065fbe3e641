import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_jax.assets import TOKENIZER_PATH
from ddtree_jax.checkpoint import load_drafter, load_target
from ddtree_jax.models.dflash import DFlashConfig, drafter_logits, init_drafter
from ddtree_jax.models.qwen3 import Qwen3Config, init_target, target_logits
from ddtree_jax.tokenizer import Tokenizer
from experiments import common, train_drafter, train_target

V, MASK = 64, 1


@functools.cache  # random init runs op by op and costs seconds; tests copy params before donating them
def tiny_pair(block_size=4, dtype=jnp.float32):
    tcfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                       tie_word_embeddings=True)
    dcfg = DFlashConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=block_size,
                        target_layer_ids=(0, 2), mask_token_id=MASK, num_target_layers=3, rope_theta=10000.0)
    target = init_target(tcfg, jax.random.key(0), dtype, std=0.2)
    return target, init_drafter(dcfg, jax.random.key(1), dtype, std=0.2)


def test_block_batch_labels_and_mask():
    seq_len, block = 12, 4
    tokens_BS = 100 + np.arange(2 * seq_len).reshape(2, seq_len)
    anchors_BA = np.array([[1, 5, 8], [2, 3, 8]])
    got = train_drafter.block_batch(jnp.asarray(tokens_BS), jnp.asarray(anchors_BA), block, MASK)
    tokens, positions, mask, labels = map(np.asarray, (got.block_tokens, got.block_positions, got.mask, got.labels))
    assert mask.shape == (2, 3 * block, seq_len + 3 * block) and labels.shape == (2, 3, block - 1)
    for b in range(2):
        for i, a in enumerate(anchors_BA[b]):
            for s in range(block):
                q = i * block + s
                assert tokens[b, q] == (tokens_BS[b, a] if s == 0 else MASK)
                assert positions[b, q] == a + s
                assert mask[b, q, a - 1] and not mask[b, q, a]  # context strictly before the anchor
                np.testing.assert_array_equal(mask[b, q, :seq_len], np.arange(seq_len) < a)
                np.testing.assert_array_equal(mask[b, q, seq_len:], np.arange(3 * block) // block == i)
                if s >= 1:
                    assert labels[b, i, s - 1] == tokens_BS[b, a + s]


def test_training_blocks_equal_inference_drafts():
    """Each anchor block of one training forward gives the logits of `drafter_logits` on the prefix
    ending at its anchor (so masks and positions match inference)."""
    target, drafter = tiny_pair()
    tokens_BS = jax.random.randint(jax.random.key(2), (2, 12), 2, V)
    anchors_BA = np.array([[4, 6], [6, 4]])  # overlapping positions; two distinct anchors: two compiles
    logits_BALV, labels_BAL = jax.jit(train_drafter.draft_logits)(drafter, target, tokens_BS, jnp.asarray(anchors_BA))
    for a in np.unique(anchors_BA):
        want_BLV = drafter_logits(drafter, target, tokens_BS[:, : a + 1])
        for b, i in zip(*np.nonzero(anchors_BA == a)):
            np.testing.assert_allclose(logits_BALV[b, i], want_BLV[b], atol=2e-5, rtol=1e-5)
            np.testing.assert_array_equal(labels_BAL[b, i], tokens_BS[b, a + 1: a + 4])


def test_sample_anchors_and_weights():
    rng = np.random.default_rng(0)
    anchors = train_drafter.sample_anchors(rng, 8, 40, 20, 16)
    assert anchors.shape == (8, 20) and anchors.min() >= 1 and anchors.max() <= 40 - 16
    assert all(len(set(row)) == 20 and list(row) == sorted(row) for row in anchors)
    np.testing.assert_array_equal(anchors, train_drafter.sample_anchors(np.random.default_rng(0), 8, 40, 20, 16))
    w = train_drafter.slot_weights(16, 7.0)
    assert w.shape == (15,) and w[0] == 1.0
    np.testing.assert_allclose(w[1:] / w[:-1], np.exp(-1 / 7.0), rtol=1e-6)


def test_sample_continuations_match_cache_free_sampling():
    target, _ = tiny_pair()
    prompt_len, num_new = 5, 6
    seq_BT = jnp.zeros((3, prompt_len + num_new), jnp.int32)
    seq_BT = seq_BT.at[:, :prompt_len].set(jax.random.randint(jax.random.key(3), (3, prompt_len), 0, V))
    key = jax.random.key(4)
    got = np.asarray(train_drafter.sample_continuations(target, seq_BT[:, :prompt_len], key, num_new))
    for t, key_t in enumerate(jax.random.split(key, num_new)):
        # Causal: the not-yet-sampled zeros after position prompt_len + t - 1 do not matter.
        logits_BV = target_logits(target, seq_BT)[:, prompt_len + t - 1]
        seq_BT = seq_BT.at[:, prompt_len + t].set(jax.random.categorical(key_t, logits_BV))
    np.testing.assert_array_equal(got, np.asarray(seq_BT[:, prompt_len:]))


def _losses(step, params, opt_state, *batch, steps=30):
    out = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, *batch)
        out.append(float(loss))
    return out


def test_target_loss_decreases_on_fixed_batch():
    target, _ = tiny_pair()
    optimizer = common.make_optimizer(1e-2, 30, 3, 0.0)
    step = train_target.make_train_step(target.config, optimizer, jnp.bfloat16)
    tokens_BT = jax.random.randint(jax.random.key(5), (4, 24), 0, V)
    params = jax.tree.map(jnp.array, target.params)
    losses = _losses(step, params, optimizer.init(params), tokens_BT)
    assert losses[-1] < 0.5 * losses[0], losses


def test_drafter_loss_decreases_on_fixed_batch():
    target, drafter = tiny_pair()
    params = jax.tree.map(jnp.array, drafter.params)
    optimizer = common.make_optimizer(1e-2, 30, 3, 0.0)
    step = train_drafter.make_train_step(drafter.config, optimizer,
                                         jnp.asarray(train_drafter.slot_weights(4, 7.0)), jnp.bfloat16)
    tokens_BS = jax.random.randint(jax.random.key(6), (4, 24), 2, V)
    anchors_BA = jnp.asarray(train_drafter.sample_anchors(np.random.default_rng(0), 4, 24, 6, 4))
    losses = _losses(step, params, optimizer.init(params), target, tokens_BS, anchors_BA)
    assert losses[-1] < 0.5 * losses[0], losses


def test_scripts_end_to_end(tmp_path):
    tok = Tokenizer.default()
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    metrics = train_target.main(["--tiny", "--out", str(target_dir)])
    target = load_target(target_dir)
    assert target.config.vocab_size == tok.vocab_size and target.config.hidden_size == train_target.TINY["hidden"]
    assert np.isfinite(metrics["heldout_loss"]) and metrics["heldout_perplexity"] == pytest.approx(
        np.exp(metrics["heldout_loss"]))
    assert json.loads((target_dir / "metrics.json").read_text())["heldout_loss"] == metrics["heldout_loss"]
    assert (target_dir / "loss.png").stat().st_size > 0
    assert (target_dir / "tokenizer.json").read_bytes() == TOKENIZER_PATH.read_bytes()

    metrics = train_drafter.main(["--tiny", "--data", "generations", "--target", str(target_dir),
                                  "--out", str(drafter_dir)])
    drafter = load_drafter(drafter_dir)
    cfg = drafter.config
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (4, (0, 1), tok.mask_id)
    assert len(metrics["top1_per_slot"]) == cfg.block_size - 1 and np.isfinite(metrics["heldout_loss"])
    assert (drafter_dir / "loss.png").stat().st_size > 0
    logits = drafter_logits(drafter, target, jnp.asarray([tok.encode("def f(x):\n    return")]))
    assert logits.shape == (1, cfg.block_size - 1, tok.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_bad_flags(tmp_path):
    with pytest.raises(ValueError, match="--anchors"):
        train_drafter.parse_args(["--target", "t", "--out", "o", "--seq-len", "20", "--anchors", "8"])
    with pytest.raises(ValueError, match="--steps"):
        train_target.parse_args(["--out", "o", "--steps", "0"])
    with pytest.raises(ValueError, match="--warmup"):
        common.make_optimizer(1e-3, 10, 10, 0.0)
