"""DFlash drafter: an independent NumPy reference, the context cache across rounds, input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from ddtree_jax.checkpoint import save_drafter, save_target
from ddtree_jax.models import (
    DFlashConfig,
    Qwen3Config,
    check_capacity,
    drafter_forward,
    drafter_head,
    drafter_hidden,
    drafter_logits,
    init_cache,
    init_drafter,
    init_target,
    target_forward_nocache,
)

VOCAB, BLOCK = 61, 5


def make_pair(tied=False, seed=0, head_dim=8):
    target_cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                             rope_theta=10000.0)
    drafter_cfg = DFlashConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, block_size=BLOCK,
                               target_layer_ids=(0, 2), mask_token_id=VOCAB - 1, num_target_layers=3,
                               rope_theta=10000.0)
    key_t, key_d = jax.random.split(jax.random.key(seed))
    return (init_drafter(drafter_cfg, key_d, jnp.float32, std=0.15),
            init_target(target_cfg, key_t, jnp.float32, std=0.15))


def hf_tensors(tmp_path, drafter, target):
    """The HF-named float64 tensors of both models (torch [out, in] layout), read back from disk."""
    save_drafter(tmp_path / "d", drafter)
    save_target(tmp_path / "t", target)
    def load(p):
        return {k: v.astype(np.float64) for k, v in load_file(p / "model.safetensors").items()}
    return load(tmp_path / "d"), load(tmp_path / "t")


def reference_draft_logits(dw, tw, cfg: DFlashConfig, tied, ctx_taps_CF, ctx_pos_C, root, root_pos):
    """One DFlash forward written from the formulas: unfused HF weights, float64, explicit heads."""
    eps = cfg.rms_norm_eps

    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rotary(x_THD, pos_T):
        dim = x_THD.shape[-1]
        freq = cfg.rope_theta ** (-np.arange(0, dim, 2) / dim)
        ang = pos_T[:, None, None] * freq
        x1, x2 = x_THD[..., :dim // 2], x_THD[..., dim // 2:]
        return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1)

    def heads(x, n):
        return x.reshape(x.shape[0], n, cfg.head_dim)

    feat = rms(ctx_taps_CF @ dw["fc.weight"].T, dw["hidden_norm.weight"])
    x = tw["model.embed_tokens.weight"][[root] + [cfg.mask_token_id] * (cfg.block_size - 1)]
    block_pos = root_pos + np.arange(cfg.block_size)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        w = {n[len(f"layers.{i}."):]: t for n, t in dw.items() if n.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])
        q = rotary(rms(heads(h @ w["self_attn.q_proj.weight"].T, cfg.num_attention_heads),
                       w["self_attn.q_norm.weight"]), block_pos)
        k_norm, k_proj = w["self_attn.k_norm.weight"], w["self_attn.k_proj.weight"]
        k = np.concatenate([rotary(rms(heads(src @ k_proj.T, cfg.num_key_value_heads), k_norm), pos)
                            for src, pos in ((feat, ctx_pos_C), (h, block_pos))])
        v = heads(np.concatenate([feat, h]) @ w["self_attn.v_proj.weight"].T, cfg.num_key_value_heads)
        out = np.zeros_like(q)
        for head in range(cfg.num_attention_heads):
            s = q[:, head] @ k[:, head // group].T / np.sqrt(cfg.head_dim)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, head // group]
        x = x + out.reshape(cfg.block_size, -1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        gate = h @ w["mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    head = tw["model.embed_tokens.weight"] if tied else tw["lm_head.weight"]
    return rms(x, dw["norm.weight"])[1:] @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_drafter_matches_numpy_reference(tmp_path, tied):
    drafter, target = make_pair(tied)
    dw, tw = hf_tensors(tmp_path, drafter, target)
    rng = np.random.default_rng(0)
    batch, num_ctx = 2, 6
    taps = rng.normal(size=(batch, num_ctx, drafter.config.num_features)).astype(np.float32)
    ctx_pos = np.array([np.arange(num_ctx), np.arange(num_ctx) + 3], np.int32)
    roots, root_pos = np.array([4, 17], np.int32), np.array([num_ctx, num_ctx + 3], np.int32)
    cache = init_cache(2, batch, 1, 16, 8, jnp.float32)
    logits, cache = drafter_forward(drafter, target, cache, jnp.asarray(taps), jnp.asarray(ctx_pos),
                                    jnp.full((batch,), num_ctx, jnp.int32), jnp.asarray(roots), jnp.asarray(root_pos))
    assert logits.shape == (batch, BLOCK - 1, VOCAB) and logits.dtype == jnp.float32
    np.testing.assert_array_equal(cache.lengths, [num_ctx, num_ctx])
    for b in range(batch):
        ref = reference_draft_logits(dw, tw, drafter.config, tied, taps[b].astype(np.float64), ctx_pos[b], roots[b],
                                     root_pos[b])
        assert np.abs(ref).max() > 0.5
        np.testing.assert_allclose(logits[b], ref, atol=1e-5, rtol=0)

    ids = rng.integers(0, VOCAB - 1, (1, 7)).astype(np.int32)
    _, target_taps = target_forward_nocache(target, jnp.asarray(ids), tap_layers=drafter.config.target_layer_ids)
    ref = reference_draft_logits(dw, tw, drafter.config, tied, np.asarray(target_taps, np.float64)[0, :-1],
                                 np.arange(6), ids[0, -1], 6)
    np.testing.assert_allclose(drafter_logits(drafter, target, jnp.asarray(ids))[0], ref, atol=1e-5, rtol=0)


def test_context_cache_over_rounds_equals_recomputation():
    drafter, target = make_pair()
    rng = np.random.default_rng(1)
    counts = np.array([[3, 1, 4], [2, 4, 1]], np.int32)  # per request, per round
    pad = 4
    total = counts.sum(1)
    taps_all = rng.normal(size=(2, total.max(), drafter.config.num_features)).astype(np.float32)
    step = jax.jit(drafter_forward, donate_argnums=2)
    cache = init_cache(2, 2, 1, 20, 8, jnp.float32)
    check_capacity(cache, pad + BLOCK + total)
    done = np.zeros(2, np.int32)
    for r in range(counts.shape[1]):
        taps = rng.normal(size=(2, pad, drafter.config.num_features)).astype(np.float32)  # garbage past count
        for b in range(2):
            taps[b, :counts[b, r]] = taps_all[b, done[b]:done[b] + counts[b, r]]
        positions = done[:, None] + np.arange(pad, dtype=np.int32)
        done = done + counts[:, r]
        roots = rng.integers(0, VOCAB, 2).astype(np.int32)
        logits, cache = step(drafter, target, cache, jnp.asarray(taps), jnp.asarray(positions),
                             jnp.asarray(counts[:, r]), jnp.asarray(roots), jnp.asarray(done))
    np.testing.assert_array_equal(cache.lengths, total)

    fresh = init_cache(2, 2, 1, 20, 8, jnp.float32)
    positions = np.broadcast_to(np.arange(total.max(), dtype=np.int32), (2, total.max()))
    fresh_logits, fresh = drafter_forward(drafter, target, fresh, jnp.asarray(taps_all), jnp.asarray(positions),
                                          jnp.asarray(total), jnp.asarray(roots), jnp.asarray(done))
    np.testing.assert_allclose(logits, fresh_logits, atol=1e-5, rtol=0)
    for b in range(2):
        np.testing.assert_allclose(cache.k[:, b, :, :total[b]], fresh.k[:, b, :, :total[b]], atol=1e-6)
        np.testing.assert_allclose(cache.v[:, b, :, :total[b]], fresh.v[:, b, :, :total[b]], atol=1e-6)

    # The same round without a cache: context b sees exactly its first total[b] features.
    block = np.concatenate([roots[:, None], np.full((2, BLOCK - 1), VOCAB - 1)], 1).astype(np.int32)
    mask = np.ones((2, BLOCK, total.max() + BLOCK), bool)
    mask[1, :, total[1]:total.max()] = False
    hidden = drafter_hidden(drafter, target, jnp.asarray(taps_all), jnp.asarray(positions), jnp.asarray(block),
                            jnp.asarray(done[:, None] + np.arange(BLOCK, dtype=np.int32)), jnp.asarray(mask))
    np.testing.assert_allclose(drafter_head(drafter, target, hidden[:, 1:]), logits, atol=1e-5, rtol=0)


def test_drafter_hidden_mask_hides_context():
    drafter, target = make_pair()
    rng = np.random.default_rng(2)
    taps = jnp.asarray(rng.normal(size=(1, 6, drafter.config.num_features)), jnp.float32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    block = jnp.asarray([[5, 60, 60, 60, 60]], jnp.int32)
    block_pos = 3 + jnp.arange(BLOCK, dtype=jnp.int32)[None]
    mask = np.ones((1, BLOCK, 6 + BLOCK), bool)
    mask[:, :, 3:6] = False
    hidden = drafter_hidden(drafter, target, taps, positions, block, block_pos, jnp.asarray(mask))
    short = drafter_hidden(drafter, target, taps[:, :3], positions[:, :3], block, block_pos,
                           jnp.ones((1, BLOCK, 3 + BLOCK), bool))
    np.testing.assert_allclose(hidden, short, atol=1e-6)
    full = drafter_hidden(drafter, target, taps, positions, block, block_pos, jnp.ones((1, BLOCK, 6 + BLOCK), bool))
    assert np.abs(full - short).max() > 1e-3


def test_drafter_bad_inputs():
    drafter, target = make_pair()
    cache = init_cache(2, 1, 1, 12, 8, jnp.float32)
    taps = jnp.zeros((1, 2, drafter.config.num_features), jnp.float32)
    args = {"ctx_feats_BCF": taps, "ctx_positions_BC": jnp.zeros((1, 2), jnp.int32),
            "ctx_count_B": jnp.ones(1, jnp.int32), "root_tokens_B": jnp.zeros(1, jnp.int32),
            "root_positions_B": jnp.ones(1, jnp.int32)}
    drafter_forward(drafter, target, cache, **args)
    bad = [({"ctx_feats_BCF": taps[..., :-1]}, "ctx_feats_BCF must have shape"),
           ({"ctx_feats_BCF": taps.astype(jnp.int32)}, "ctx_feats_BCF must be floating"),
           ({"ctx_positions_BC": jnp.zeros((1, 3), jnp.int32)}, "ctx_positions_BC"),
           ({"ctx_count_B": jnp.ones(1, jnp.float32)}, "ctx_count_B"),
           ({"root_tokens_B": jnp.full(1, VOCAB, jnp.int32)}, "root_tokens_B"),
           ({"root_positions_B": jnp.ones((1, 1), jnp.int32)}, "root_positions_B")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            drafter_forward(drafter, target, cache, **{**args, **change})
    with pytest.raises(ValueError, match="cache"):
        drafter_forward(drafter, target, init_cache(3, 1, 1, 12, 8, jnp.float32), **args)
    other_cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="does not match the target"):
        drafter_logits(drafter, init_target(other_cfg, jax.random.key(0), jnp.float32), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="mask_BQK"):
        drafter_hidden(drafter, target, taps, args["ctx_positions_BC"], jnp.zeros((1, BLOCK), jnp.int32),
                       jnp.zeros((1, BLOCK), jnp.int32), jnp.ones((1, BLOCK, BLOCK), bool))
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlashConfig(**{**drafter.config.__dict__, "target_layer_ids": (0, 3)})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig(**{**drafter.config.__dict__, "mask_token_id": VOCAB})


def test_config_round_trip_and_published_layout():
    drafter, _ = make_pair()
    hf = drafter.config.to_hf()
    assert hf["dflash_config"] == {"target_layer_ids": [0, 2], "mask_token_id": VOCAB - 1}
    assert "target_layer_ids" not in hf and hf["block_size"] == BLOCK
    assert DFlashConfig.from_hf(hf) == drafter.config
    v4 = {k: v for k, v in hf.items() if k != "rope_parameters"}
    assert DFlashConfig.from_hf({**v4, "rope_theta": 10000.0}) == drafter.config


def test_matmul_kernel_drafter_equals_the_xla_drafter():
    """The drafting step with its projections (context features, context K/V in place, block layers,
    LM head) on the interpreted skinny-matmul kernel equals the XLA path."""
    drafter, target = make_pair()
    rng = np.random.default_rng(2)
    taps = jnp.asarray(rng.normal(size=(2, 4, drafter.config.num_features)).astype(np.float32))
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    args = (taps, positions, jnp.array([4, 2], jnp.int32), jnp.array([3, 5], jnp.int32), jnp.array([4, 2], jnp.int32))
    outs = {impl: drafter_forward(drafter, target, init_cache(2, 2, 1, 20, 8, jnp.float32), *args, matmul_impl=impl)
            for impl in ("xla", "interpret")}
    np.testing.assert_allclose(outs["interpret"][0], outs["xla"][0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(outs["interpret"][1].k, outs["xla"][1].k, atol=2e-5, rtol=2e-5)


def test_attention_kernels_drafter_equals_the_xla_drafter():
    """The drafting step with the interpreted attention kernels (the q/k norm + RoPE kernel and tree
    attention over the cache, both chosen by ``attention_impl``) equals the XLA path."""
    drafter, target = make_pair(head_dim=16)
    rng = np.random.default_rng(3)
    taps = jnp.asarray(rng.normal(size=(2, 4, drafter.config.num_features)).astype(np.float32))
    positions = jnp.broadcast_to(jnp.arange(4, dtype=jnp.int32), (2, 4))
    args = (taps, positions, jnp.array([4, 2], jnp.int32), jnp.array([3, 5], jnp.int32), jnp.array([4, 2], jnp.int32))
    outs = {impl: drafter_forward(drafter, target, init_cache(2, 2, 1, 20, 16, jnp.float32), *args,
                                  attention_impl=impl) for impl in ("xla", "interpret")}
    np.testing.assert_allclose(outs["interpret"][0], outs["xla"][0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(outs["interpret"][1].k, outs["xla"][1].k, atol=2e-5, rtol=2e-5)


def test_check_kernels_drafter_part_through_the_interpreter(monkeypatch):
    """`experiments/check_kernels.py`'s drafter_auto part on a small pair with the interpreted kernels
    (the block's queries over the context rows kept and the block): it passes, and a wrong projection
    on the checked path fails it."""
    from ddtree_jax import kernels
    from experiments.check_kernels import check_drafter

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    cases = [(1, (2,)), (2, (5, 1))]
    records = check_drafter(fields, cases=cases, layers=2, context=6, block_size=BLOCK, impl="interpret")
    assert [r["ok"] for r in records] == [True, True], records
    product = kernels.matmul_fn("xla")

    def scaled(x, w, **kw):  # a wrong projection (its pair's normalised rows, if any, left as they are)
        out = product(x, w, **kw)
        return (1.5 * out[0], out[1]) if isinstance(out, tuple) else 1.5 * out

    monkeypatch.setattr(kernels, "matmul_fn", lambda impl, mesh=None: scaled if impl == "interpret" else product)
    jax.clear_caches()
    wrong = check_drafter(fields, cases=cases[:1], layers=2, context=6, block_size=BLOCK, impl="interpret")
    assert not any(r["ok"] or "error" in r for r in wrong), wrong  # failed by its numbers, not by a crash


def test_drafter_with_the_residual_norm_kernel_equals_xla(monkeypatch):
    """Drafter passes of two requests (ten block rows) with every output and down product finished by the
    interpreted `residual_norm` kernel (the normalised rows handed to the next product, after the context
    rows in the q/k/v product) pass `check_kernels.py`'s drafter_auto comparison with the XLA pass."""
    from ddtree_jax import kernels
    from experiments.check_kernels import check_drafter
    from pallas_kernels.matmul_reference import matmul_reference

    fused, seen = kernels.residual_norm_product(matmul_reference, 4, lambda k: 2, interpret=True), []

    def counted(x, w, **kw):
        out = fused(x, w, **kw)
        seen.append(isinstance(out, tuple) and out[1] is not None)
        return out

    monkeypatch.setattr(kernels, "matmul_fn", lambda impl, mesh=None: counted if impl == "interpret" else
                        matmul_reference)
    jax.clear_caches()
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    records = check_drafter(fields, cases=[(2, (5, 1))], layers=2, context=6, block_size=BLOCK, impl="interpret")
    assert [r["ok"] for r in records] == [True], records
    assert sum(seen) == 3  # both layers' output products, the first layer's down product
    jax.clear_caches()
