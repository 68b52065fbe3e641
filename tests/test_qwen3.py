"""Qwen3 target: equivalence with transformers, tree verify == sequential decoding, input checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from ddtree_jax.checkpoint import load_target, save_target
from ddtree_jax.models import (
    Qwen3Config,
    Qwen3MoeConfig,
    check_capacity,
    commit,
    init_cache,
    init_target,
    target_forward,
    target_forward_nocache,
    target_logits,
)
from ddtree_jax.tree import build_tree, tree_attention_mask, tree_positions

VOCAB = 97


def hf_model(*, tied, kv_heads, head_dim, seed=0):
    """A tiny random fp32 Qwen3ForCausalLM with non-trivial norm weights."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=head_dim, tie_word_embeddings=tied, initializer_range=0.2,
        max_position_embeddings=64, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()


def causal(batch, num):
    return jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))


def prefill(target, prompts, max_len):
    """Right-padded prefill of a list of prompts, then commit. Returns (logits_BNV, cache)."""
    batch, num = len(prompts), max(map(len, prompts))
    tokens = np.zeros((batch, num), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, target.dtype)
    positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    logits, _, cache = target_forward(target, jnp.asarray(tokens), positions, causal(batch, num), cache)
    keep = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    return logits, commit(cache, keep, jnp.asarray([len(p) for p in prompts], jnp.int32))


def decode(target, cache, tokens_B, num_keep_B=None):
    """One-token decode at position ``lengths`` then commit (``num_keep`` 1 by default)."""
    batch = len(tokens_B)
    logits, _, cache = target_forward(target, jnp.asarray(tokens_B, jnp.int32)[:, None], cache.lengths[:, None],
                                      jnp.ones((batch, 1, 1), bool), cache)
    num_keep_B = jnp.ones(batch, jnp.int32) if num_keep_B is None else jnp.asarray(num_keep_B, jnp.int32)
    return logits[:, 0], commit(cache, jnp.zeros((batch, 1), jnp.int32), num_keep_B)


@pytest.mark.parametrize("tied,kv_heads,head_dim", [(False, 1, 16), (True, 2, 32), (False, 4, 64), (True, 4, 48)])
def test_prefill_decode_taps_match_transformers(tmp_path, tied, kv_heads, head_dim):
    model = hf_model(tied=tied, kv_heads=kv_heads, head_dim=head_dim)
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    assert target.params.embed.dtype == jnp.float32 and (target.params.lm_head is None) == tied
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, 5), rng.integers(0, VOCAB, 8)]
    next_tokens = rng.integers(0, VOCAB, 2)

    logits, cache = prefill(target, prompts, max_len=16)
    last, _, _ = target_forward(target, jnp.zeros((2, 8), jnp.int32).at[0, :5].set(prompts[0]).at[1].set(prompts[1]),
                                jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)), causal(2, 8),
                                init_cache(2, 2, kv_heads, 16, head_dim, jnp.float32),
                                logits_at_BK=jnp.asarray([[4], [7]], jnp.int32))
    np.testing.assert_allclose(last[:, 0], logits[np.arange(2), [4, 7]], atol=1e-6)
    decode_logits, cache = decode(target, cache, next_tokens)
    for b, prompt in enumerate(prompts):
        ref = hf_logits(model, np.append(prompt, next_tokens[b]))
        np.testing.assert_allclose(logits[b, :len(prompt)], ref[:-1], atol=1e-4, rtol=0)
        np.testing.assert_allclose(decode_logits[b], ref[-1], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(cache.lengths, [6, 9])

    ids = rng.integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    logits_full, taps = target_forward_nocache(target, jnp.asarray(ids, jnp.int32), tap_layers=(1, 0))
    np.testing.assert_allclose(logits_full, out.logits.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(taps, np.concatenate([out.hidden_states[2], out.hidden_states[1]], -1), atol=1e-4)
    np.testing.assert_allclose(target_logits(target, jnp.asarray(ids, jnp.int32)), out.logits.numpy(), atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_saved_target_opens_in_transformers(tmp_path, tied):
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
                         rope_theta=10000.0)
    target = init_target(config, jax.random.key(0), jnp.float32, std=0.2)
    save_target(tmp_path, target)
    model = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.tie_word_embeddings == tied
    ids = np.random.default_rng(2).integers(0, VOCAB, (1, 6))
    np.testing.assert_allclose(target_logits(target, jnp.asarray(ids, jnp.int32))[0], hf_logits(model, ids[0]),
                               atol=1e-4, rtol=0)


def small_target(seed=0, dtype=jnp.float32, moe=False):
    """A tiny random target; ``moe``: a Qwen3-MoE one whose first layer is sparse (8 experts, 2 per token)."""
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    config = (Qwen3MoeConfig(**shape, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             norm_topk_prob=True, mlp_only_layers=(1,)) if moe else Qwen3Config(**shape))
    return init_target(config, jax.random.key(seed), dtype, std=0.2)


def path_to(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("moe", [False, True])
def test_tree_verify_equals_sequential_decoding_and_commit(moe):
    target = small_target(moe=moe)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, 3), rng.integers(0, VOCAB, 6)]
    _, prefix_cache = prefill(target, prompts, max_len=20)
    draft_logits = jnp.asarray(rng.normal(size=(2, 3, VOCAB)) * 2, jnp.float32)
    tree = build_tree(draft_logits, jnp.asarray([p[-1] for p in prompts], jnp.int32), budget=9)
    parents, tree_tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    assert np.asarray(tree.depths).max() >= 2

    tree_logits, _, tree_cache = target_forward(target, tree.tokens, tree_positions(tree, prefix_cache.lengths),
                                                tree_attention_mask(tree), prefix_cache)
    for node in range(parents.shape[1]):
        paths = [path_to(parents[b], node) for b in range(2)]
        cache, steps = prefix_cache, max(map(len, paths))
        logits = [None, None]
        for step in range(steps):
            live = np.array([step < len(p) for p in paths])
            tokens = [tree_tokens[b, paths[b][step]] if live[b] else 0 for b in range(2)]
            step_logits, cache = decode(target, cache, tokens, num_keep_B=live)
            logits = [step_logits[b] if live[b] else logits[b] for b in range(2)]
        np.testing.assert_allclose(tree_logits[:, node], np.stack(logits), atol=1e-4, rtol=0, err_msg=f"node {node}")

    deepest = int(np.argmax(np.asarray(tree.depths)[0]))
    accepted = [path_to(parents[0], deepest), [0]]
    accept = np.full((2, 4), -1, np.int32)
    for b, path in enumerate(accepted):
        accept[b, :len(path)] = path
    num_keep = np.array([len(p) for p in accepted], np.int32)
    committed = jax.jit(commit, donate_argnums=0)(tree_cache, jnp.asarray(accept), jnp.asarray(num_keep))
    sequential = prefix_cache
    for step in range(accept.shape[1]):
        tokens = np.where(accept[:, step] >= 0, tree_tokens[np.arange(2), accept[:, step]], 0)
        _, sequential = decode(target, sequential, tokens, num_keep_B=step < num_keep)
    np.testing.assert_array_equal(committed.lengths, [3, 6] + num_keep)
    np.testing.assert_array_equal(sequential.lengths, committed.lengths)
    for b, length in enumerate(np.asarray(committed.lengths)):
        np.testing.assert_allclose(committed.k[:, b, :, :length], sequential.k[:, b, :, :length], atol=1e-5)
        np.testing.assert_allclose(committed.v[:, b, :, :length], sequential.v[:, b, :, :length], atol=1e-5)


def kernel_operand_shapes(jaxpr, name) -> list[list[tuple]]:
    """The operand shapes of every Pallas call of kernel ``name`` in ``jaxpr`` (nested jaxprs walked)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            info = eqn.params.get("name", eqn.params.get("name_and_src_info"))  # the key differs across versions
            if getattr(info, "name", info) == name:
                found.append([tuple(v.aval.shape) for v in eqn.invars])
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += kernel_operand_shapes(sub, name)
    return found


def test_attention_kernel_reads_the_stacked_cache_in_place():
    """Each layer's kernel calls (the q/k norm + RoPE + K/V write, then the attention) take the whole
    ``[L, B, K, S, D]`` caches (the layer is a static index), not slices of them: on a GPU a sliced
    kernel operand is a copy of the layer's cache."""
    target = small_target()
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 16, cfg.head_dim, target.dtype)
    positions = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32), (2, 3))
    forward = lambda c: target_forward(target, jnp.zeros((2, 3), jnp.int32), positions, causal(2, 3), c,  # noqa: E731
                                       attention_impl="interpret")
    jaxpr = jax.make_jaxpr(forward)(cache).jaxpr
    calls = kernel_operand_shapes(jaxpr, "tree_attention")
    assert len(calls) == cfg.num_hidden_layers
    assert all(shapes.count(cache.k.shape) == 2 for shapes in calls), calls
    writes = kernel_operand_shapes(jaxpr, "qk_norm_rope_write")
    assert len(writes) == cfg.num_hidden_layers
    assert all(shapes.count(cache.k.shape) == 2 for shapes in writes), writes


def test_token_ids_may_be_nested_lists():
    target = small_target()
    ids = [[1, 2, 3], [4, 5, 6]]
    np.testing.assert_array_equal(target_logits(target, ids), target_logits(target, jnp.asarray(ids, jnp.int32)))
    with pytest.raises(ValueError, match="tokens_BN must be an integer array"):
        target_logits(target, [[1.0, 2.0]])


def test_forward_under_jit_and_bf16_close_to_fp32():
    target = small_target()
    ids = jnp.asarray(np.random.default_rng(4).integers(0, VOCAB, (2, 6)), jnp.int32)
    jitted = jax.jit(target_logits)(target, ids)
    np.testing.assert_allclose(jitted, target_logits(target, ids), atol=1e-5)
    target_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), target)
    logits_bf16 = target_logits(target_bf16, ids)
    assert logits_bf16.dtype == jnp.float32
    fp32 = target_logits(target, ids)
    assert np.abs(logits_bf16 - fp32).max() < 0.05 * np.abs(fp32).max()


def test_config_reads_transformers_4_and_5_layouts():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "max_position_embeddings": 32, "model_type": "qwen3", "sliding_window": None}
    v4 = Qwen3Config.from_hf({**base, "rope_theta": 5000.0, "rope_scaling": None})
    v5 = Qwen3Config.from_hf({**base, "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}})
    assert v4 == v5 and v4.rope_theta == 5000.0
    assert Qwen3Config.from_hf(v4.to_hf()) == v4
    with pytest.raises(ValueError, match="rope"):
        Qwen3Config.from_hf({**base, "rope_parameters": {"rope_theta": 1.0, "rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3Config.from_hf({**base, "rope_theta": 1.0, "use_sliding_window": True})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen3Config.from_hf({**base, "rope_theta": 1.0, "num_key_value_heads": 3})


def test_bad_inputs_raise_clear_errors():
    target = small_target()
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 8, cfg.head_dim, jnp.float32)
    tokens = jnp.zeros((2, 3), jnp.int32)
    positions = jnp.zeros((2, 3), jnp.int32)
    mask = causal(2, 3)
    with pytest.raises(ValueError, match="tokens_BN must be an integer"):
        target_forward(target, tokens.astype(jnp.float32), positions, mask, cache)
    with pytest.raises(ValueError, match=r"token ids in \[0, 97\)"):
        target_forward(target, tokens.at[1, 2].set(VOCAB), positions, mask, cache)
    with pytest.raises(ValueError, match=r"token ids in \[0, 97\)"):
        target_logits(target, -jnp.ones((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="mask_BNN must have shape"):
        target_forward(target, tokens, positions, mask[:, :2], cache)
    with pytest.raises(ValueError, match="mask_BNN must be boolean"):
        target_forward(target, tokens, positions, mask.astype(jnp.int32), cache)
    with pytest.raises(ValueError, match="positions_BN must have shape"):
        target_forward(target, tokens, positions[:1], mask, cache)
    with pytest.raises(ValueError, match="tokens_BN must have shape"):
        target_logits(target, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="tap_layers"):
        target_forward(target, tokens, positions, mask, cache, tap_layers=(2,))
    with pytest.raises(ValueError, match="cache"):
        target_forward(target, tokens[:1], positions[:1], mask[:1], cache)
    with pytest.raises(ValueError, match=r"logits_at_BK must hold indices in \[0, 3\)"):
        target_forward(target, tokens, positions, mask, cache, logits_at_BK=jnp.full((2, 1), 3, jnp.int32))
    with pytest.raises(ValueError, match="request 1 has length 6 .* max_len is 8"):
        check_capacity(cache.__class__(k=cache.k, v=cache.v, lengths=jnp.asarray([0, 6], jnp.int32)), 3)
    # Inside jit the ids are not concrete: no value check, and no error.
    out = jax.jit(lambda t: target_forward(target, t, positions, mask, cache)[0])(tokens)
    assert out.shape == (2, 3, VOCAB)


@pytest.mark.parametrize("switch", ["matmul_impl", "attention_impl"])
def test_kernel_forward_equals_the_xla_forward(switch):
    """A prefill with every projection (norm prologues, fused q/k/v, SwiGLU, LM head) on the interpreted
    skinny-matmul kernel, or with the attention kernels (q/k norm + RoPE, tree attention): the same
    logits, taps and cache as the XLA path."""
    target = small_target()
    cfg = target.config
    outs = {}
    for impl in ("xla", "interpret"):
        cache = init_cache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 16, cfg.head_dim, target.dtype)
        ids = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, (2, 5)), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        logits, taps, cache = target_forward(target, ids, positions, causal(2, 5), cache, tap_layers=(0, 1),
                                             **{switch: impl})
        outs[impl] = (logits, taps, cache.k, cache.v)
    for xla, kernel in zip(outs["xla"], outs["interpret"]):
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(xla), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="matmul_impl must be one of"):
        target_forward(target, ids, positions, causal(2, 5), cache, matmul_impl="cuda")


@pytest.fixture
def hopper_rows(monkeypatch):
    """Pretend to be an sm_90 GPU for the matmul dispatch (products of fewer than 16 rows padded), with
    traces of the pretence dropped before and after."""
    from pallas_kernels import configs

    jax.clear_caches()
    monkeypatch.setattr(configs, "device_capability", lambda: (9, 0))
    yield
    jax.clear_caches()


def test_check_kernels_forward_part_on_a_pretended_hopper(hopper_rows, monkeypatch):
    """`experiments/check_kernels.py`'s forward_auto part on a small target: the ``auto`` path (its
    products of fewer than 16 rows padded) passes, and a wrong projection on it fails."""
    from ddtree_jax import kernels
    from experiments.check_kernels import check_forward

    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0)
    records = check_forward(fields, cases=[(1, 1, 6), (2, 3, 6)], layers=2)
    assert [r["ok"] for r in records] == [True, True], records
    product = kernels.matmul_fn("auto")

    def scaled(x, w, **kw):  # a wrong projection (its pair's normalised rows, if any, left as they are)
        out = product(x, w, **kw)
        return (1.5 * out[0], out[1]) if isinstance(out, tuple) else 1.5 * out

    monkeypatch.setattr(kernels, "matmul_fn", lambda impl, mesh=None: scaled if impl == "auto" else product)
    jax.clear_caches()
    wrong = check_forward(fields, cases=[(1, 1, 6)], layers=2)
    assert not any(r["ok"] or "error" in r for r in wrong), wrong  # failed by its numbers, not by a crash
