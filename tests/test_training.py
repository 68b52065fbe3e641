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
from ddtree_jax.experiments.flags import non_negative_int_list
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
    logits_BALV, labels_BAL, target_BALV = jax.jit(train_drafter.draft_logits)(drafter, target, tokens_BS,
                                                                                jnp.asarray(anchors_BA))
    full_BTV = target_logits(target, tokens_BS)
    for a in np.unique(anchors_BA):
        want_BLV = drafter_logits(drafter, target, tokens_BS[:, : a + 1])
        for b, i in zip(*np.nonzero(anchors_BA == a)):
            np.testing.assert_allclose(logits_BALV[b, i], want_BLV[b], atol=2e-5, rtol=1e-5)
            np.testing.assert_array_equal(labels_BAL[b, i], tokens_BS[b, a + 1: a + 4])
            # The soft label of slot k: the target's logits at a + k - 1, i.e. for token a + k.
            np.testing.assert_allclose(target_BALV[b, i], full_BTV[b, a: a + 3], atol=1e-5, rtol=1e-5)


def test_drafter_loss_is_kl_and_cross_entropy_mix():
    """`drafter_loss` against a NumPy computation of the weighted KL / cross-entropy mix."""
    target, drafter = tiny_pair()
    tokens_BS = jax.random.randint(jax.random.key(7), (2, 12), 2, V)
    anchors_BA = jnp.asarray([[2, 5], [3, 7]])
    weights_L = jnp.asarray(train_drafter.slot_weights(4, 2.0))
    logits, labels, target_logits_ = map(np.asarray, train_drafter.draft_logits(drafter, target, tokens_BS,
                                                                                anchors_BA))

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    logq, logp = log_softmax(logits), log_softmax(target_logits_)
    kl = (np.exp(logp) * (logp - logq)).sum(-1)
    ce = -np.take_along_axis(logq, labels[..., None], -1)[..., 0]
    w = np.asarray(weights_L, np.float64)
    for soft in (0.0, 0.3, 1.0):
        want = ((soft * kl + (1 - soft) * ce) * w).sum(-1).mean() / w.sum()
        got, (correct, agree) = train_drafter.drafter_loss(drafter.params, drafter.config, target, tokens_BS,
                                                           anchors_BA, weights_L, soft, jnp.float32)
        np.testing.assert_allclose(float(got), want, rtol=1e-4)
    np.testing.assert_array_equal(correct, logits.argmax(-1) == labels)
    np.testing.assert_array_equal(agree, logits.argmax(-1) == target_logits_.argmax(-1))
    assert kl.min() >= -1e-9 and not np.allclose(kl, ce)


def test_sample_anchors_and_weights():
    rng = np.random.default_rng(0)
    anchors = train_drafter.sample_anchors(rng, 8, 40, 20, 16)
    assert anchors.shape == (8, 20) and anchors.min() >= 1 and anchors.max() <= 40 - 16
    assert all(len(set(row)) == 20 and list(row) == sorted(row) for row in anchors)
    high = train_drafter.sample_anchors(rng, 8, 40, 10, 16, low=13)
    assert high.min() >= 13 and high.max() <= 40 - 16 and all(len(set(row)) == 10 for row in high)
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


def test_greedy_continuations_follow_the_argmax():
    target, _ = tiny_pair()
    seq_BT = jax.random.randint(jax.random.key(8), (3, 5), 0, V)
    got = np.asarray(train_drafter.sample_continuations(target, seq_BT, jax.random.key(9), 6, jnp.float32(0.0)))
    for _ in range(6):
        seq_BT = jnp.concatenate([seq_BT, jnp.argmax(target_logits(target, seq_BT)[:, -1], -1)[:, None]], axis=1)
    np.testing.assert_array_equal(got, np.asarray(seq_BT[:, 5:]))
    cold = train_drafter.sample_continuations(target, seq_BT[:, :5], jax.random.key(9), 6, jnp.float32(1e-4))
    np.testing.assert_array_equal(np.asarray(cold), got)  # a temperature near 0 samples the argmax too


def _losses(step, params, opt_state, *batch, steps=30):
    out = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, *batch)
        out.append(float(loss))
    return out


def test_target_loss_decreases_on_fixed_batch():
    target, _ = tiny_pair()
    optimizer = common.make_optimizer(0.0)
    step = train_target.make_train_step(target.config, optimizer, jnp.bfloat16, rate=0.1)
    tokens_BT = jax.random.randint(jax.random.key(5), (4, 24), 0, V)
    params = jax.tree.map(jnp.array, target.params)
    losses = _losses(step, params, optimizer.init(params), jnp.float32(1e-2), tokens_BT, jax.random.key(0))
    assert losses[-1] < 0.5 * losses[0], losses


def test_dropout_forward():
    """Rate 0 is the inference forward (up to float32 rounding: compiled differently); a positive rate
    changes the logits, reproducibly per key, and keeps about 1 - rate of the entries, scaled by 1 / (1 - rate)."""
    target, _ = tiny_pair()
    tokens_BT = jax.random.randint(jax.random.key(10), (2, 9), 0, V)
    key = jax.random.key(11)
    np.testing.assert_allclose(train_target.dropout_logits(target, tokens_BT, key, 0.0),
                               target_logits(target, tokens_BT), atol=1e-5, rtol=1e-5)
    a, b = (np.asarray(train_target.dropout_logits(target, tokens_BT, k, 0.3)) for k in (key, key))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, target_logits(target, tokens_BT), atol=1e-3)
    x = jnp.ones((200, 500))
    y = np.asarray(train_target.dropout(key, x, 0.3))
    assert set(np.unique(y).tolist()) == {0.0, np.float32(1 / 0.7)}
    assert abs((y == 0).mean() - 0.3) < 0.01  # 100,000 draws: 6 standard deviations


def test_drafter_loss_decreases_on_fixed_batch():
    target, drafter = tiny_pair()
    params = jax.tree.map(jnp.array, drafter.params)
    optimizer = common.make_optimizer(0.0)
    step = train_drafter.make_train_step(drafter.config, optimizer,
                                         jnp.asarray(train_drafter.slot_weights(4, 7.0)), 0.5, jnp.bfloat16)
    tokens_BS = jax.random.randint(jax.random.key(6), (4, 24), 2, V)
    anchors_BA = jnp.asarray(train_drafter.sample_anchors(np.random.default_rng(0), 4, 24, 6, 4))
    losses = _losses(step, params, optimizer.init(params), jnp.float32(1e-2), target, tokens_BS, anchors_BA)
    assert losses[-1] < 0.5 * losses[0], losses


def test_schedule():
    s = common.Schedule(1.0, steps=110, warmup=10)
    assert s(1, 0.0) == pytest.approx(0.1) and s(10, 0.0) == pytest.approx(1.0)
    assert s(11, 0.0) == pytest.approx(1.0) and s(110, 0.0) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(
        np.pi * 99 / 100)))
    assert s(61, 0.0) == pytest.approx(0.55) and not s.done(109, 0.0) and s.done(110, 0.0)  # step 61: 50 done
    timed = common.Schedule(1.0, steps=110, warmup=10, seconds=100.0)
    assert timed(61, 50.0) == pytest.approx(0.55) and timed(20, 50.0) == pytest.approx(0.55)  # half the time
    assert timed(20, 100.0) == pytest.approx(0.1) and timed.done(20, 100.0) and not timed.done(20, 99.0)


def test_scripts_end_to_end(tmp_path):
    tok = Tokenizer.default()
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    metrics = train_target.main(["--tiny", "--out", str(target_dir)])
    target = load_target(target_dir)
    assert metrics["kept_step"] in metrics["heldout_curve"]["step"] and not metrics["capped_by_time"]
    kept = metrics["heldout_curve"]["loss"][metrics["heldout_curve"]["step"].index(metrics["kept_step"])]
    assert kept == metrics["heldout_loss"] == min(metrics["heldout_curve"]["loss"])
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
    for name in ("T0", "T1"):
        held = metrics["heldout"][name]
        assert len(held["agree_per_slot"]) == len(held["top1_per_slot"]) == cfg.block_size - 1
        assert 0 <= held["mean_agree_prefix"] <= cfg.block_size - 1 and np.isfinite(held["loss"])
    # On greedy text the sequence's token is the target's argmax (ties aside): the two rates agree.
    np.testing.assert_allclose(metrics["heldout"]["T0"]["top1_per_slot"], metrics["heldout"]["T0"]["agree_per_slot"])
    assert (drafter_dir / "loss.png").stat().st_size > 0
    logits = drafter_logits(drafter, target, jnp.asarray([tok.encode("def f(x):\n    return")]))
    assert logits.shape == (1, cfg.block_size - 1, tok.vocab_size) and np.isfinite(np.asarray(logits)).all()


def test_bad_flags(tmp_path):
    with pytest.raises(ValueError, match="--anchors"):
        train_drafter.parse_args(["--target", "t", "--out", "o", "--data", "corpus", "--seq-len", "20",
                                  "--anchors", "8"])
    with pytest.raises(ValueError, match="--steps"):
        train_target.parse_args(["--out", "o", "--steps", "0"])
    with pytest.raises(ValueError, match="--warmup"):
        common.Schedule(1e-3, 10, 10)
    with pytest.raises(ValueError, match="--warmup"):
        train_target.parse_args(["--out", "o", "--steps", "10", "--warmup", "10"])
    with pytest.raises(ValueError, match="--dropout"):
        train_target.parse_args(["--out", "o", "--dropout", "1"])
    with pytest.raises(ValueError, match="--soft-weight"):
        train_drafter.parse_args(["--target", "t", "--out", "o", "--soft-weight", "1.5"])
    with pytest.raises(ValueError, match="--max-minutes"):
        train_drafter.parse_args(["--target", "t", "--out", "o", "--max-minutes", "0"])
    with pytest.raises(ValueError, match="--anchors"):  # generations: anchors after the prompt only
        train_drafter.parse_args(["--target", "t", "--out", "o", "--seq-len", "100", "--gen-prompt-len", "64",
                                  "--anchors", "30"])


def test_time_cap_stops_training_and_still_writes(tmp_path):
    """A cap that leaves a few seconds for the loop: it stops early and writes the model within the cap.
    (Two seconds were too few: on a loaded 2-core machine start-up and data took three.)"""
    metrics = train_target.main(["--tiny", "--steps", "100000", "--out", str(tmp_path), "--max-minutes", "0.5",
                                 "--reserve-seconds", "22"])
    assert metrics["capped_by_time"] and metrics["steps_run"] < 100000 and metrics["wall_seconds"] < 30
    assert load_target(tmp_path).config.hidden_size == train_target.TINY["hidden"]


def test_eval_acceptance_methods(capsys):
    from experiments import eval_acceptance

    assert eval_acceptance.parse_methods("ar,chain,ddtree16,ddtree16cap4", default_cap=8) == [
        ("ar", "ar", 1, 0), ("chain", "chain", 1, 0), ("ddtree16", "ddtree", 16, 8), ("ddtree16cap4", "ddtree", 16, 4)]
    for bad in ("ddtreex", "ddtree16capx", "tree", "ddtree0"):
        with pytest.raises(ValueError, match="--methods"):
            eval_acceptance.parse_methods(bad)
    methods = eval_acceptance.parse_methods("ar,chain,ddtree8")
    assert eval_acceptance.grid(methods, [0.0, 1.0], [0.5, 1.0]) == [
        (label, method, budget, 0, t, dt, 0) for t in (0.0, 1.0) for label, method, budget, dt in (
            ("ar", "ar", 1, 0.5), ("chain dt0.5", "chain", 1, 0.5), ("chain dt1", "chain", 1, 1.0),
            ("ddtree8 dt0.5", "ddtree", 8, 0.5), ("ddtree8 dt1", "ddtree", 8, 1.0))]
    assert [cell[0] for cell in eval_acceptance.grid(methods, [0.0], [0.6])] == ["ar", "chain", "ddtree8"]
    for flag, value in (("--new-tokens", "0"), ("--temperatures", "1,-1"), ("--methods", "ddtree0"),
                        ("--temperatures", "a"), ("--draft-temperature", "0.5,0"), ("--draft-temperature", "nan"),
                        ("--draft-vocabs", "-1"), ("--draft-vocabs", "1,x")):
        with pytest.raises(SystemExit):  # before the models load: no such directory is read
            eval_acceptance.main([flag, value, "--target", "/nonexistent"])
        assert flag in capsys.readouterr().err
    assert non_negative_int_list("0,2048") == [0, 2048]  # eval_acceptance's --draft-vocabs
    assert [(cell[0], cell[-1]) for cell in eval_acceptance.grid(methods, [0.0], [0.6], [0, 512])] == [
        ("ar", 0), ("chain", 0), ("chain v512", 512), ("ddtree8", 0), ("ddtree8 v512", 512)]


def test_generation_stops_at_its_deadline():
    """Past the deadline only one batch per temperature is written; the batches take the temperatures in turn."""
    target, _ = tiny_pair()
    args = train_drafter.parse_args(["--target", "t", "--out", "o", "--seq-len", "12", "--gen-prompt-len", "4",
                                     "--anchors", "2", "--block-size", "4", "--gen-batch", "3"])
    prompts = iter(np.random.default_rng(0).integers(0, V, (30, 4)))
    late = train_drafter.generated_sequences(target, prompts, 30, (0.0, 1.0), args, seed=0, deadline=0.0)
    assert late.shape == (6, 12)
    full = train_drafter.generated_sequences(target, iter(late[:, :4]), 6, (0.0, 1.0), args, seed=0)
    np.testing.assert_array_equal(full, late)
    greedy = train_drafter.sample_continuations(target, jnp.asarray(late[:3, :4]), jax.random.key(0), 8,
                                                jnp.float32(0.0))
    np.testing.assert_array_equal(late[:3, 4:], np.asarray(greedy))
