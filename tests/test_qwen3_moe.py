"""Qwen3-MoE target: equivalence with transformers (both norm_topk_prob, dense layers mixed in),
checkpoints (per-expert, fused, sharded), routing outputs, and configs it must refuse."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers

from ddtree_jax.checkpoint import load_target, save_target
from ddtree_jax.models import (
    MoeDecoderLayer,
    Qwen3Config,
    Qwen3MoeConfig,
    commit,
    distinct_experts,
    expert_routes,
    init_cache,
    init_target,
    target_forward,
    target_forward_nocache,
    target_logits,
)

VOCAB = 61


def hf_moe(*, norm, tied=False, mlp_only=(), sparse_step=1, layers=3, seed=0):
    """A tiny random fp32 Qwen3MoeForCausalLM with non-trivial norm weights."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=norm, mlp_only_layers=list(mlp_only), decoder_sparse_step=sparse_step, tie_word_embeddings=tied,
        initializer_range=0.2, max_position_embeddings=64, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def causal(batch, num):
    return jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))


def positions(batch, num):
    return jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))


def hf_sparse_layers(model):
    return tuple(i for i, layer in enumerate(model.model.layers)
                 if isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock))


@pytest.mark.parametrize("norm,tied,mlp_only,sparse_step", [
    (False, False, (1,), 1), (True, False, (1,), 1), (True, True, (), 2), (False, False, (0,), 2)])
def test_prefill_decode_taps_match_transformers(tmp_path, norm, tied, mlp_only, sparse_step):
    model = hf_moe(norm=norm, tied=tied, mlp_only=mlp_only, sparse_step=sparse_step)
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    cfg = target.config
    assert isinstance(cfg, Qwen3MoeConfig) and cfg.norm_topk_prob == norm and cfg.num_experts == 8
    assert cfg.sparse_layers == hf_sparse_layers(model) and 0 < len(cfg.sparse_layers) < 3  # dense layers mixed in
    assert [isinstance(layer, MoeDecoderLayer) for layer in target.params.layers] == [
        i in cfg.sparse_layers for i in range(3)]
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 9))
    with torch.no_grad():
        out = model(torch.tensor(ids), output_hidden_states=True)
    logits, taps = target_forward_nocache(target, jnp.asarray(ids, jnp.int32), tap_layers=(0, 1, 2))
    assert np.abs(np.asarray(logits) - out.logits.numpy()).max() <= 1e-4
    np.testing.assert_allclose(taps, np.concatenate(out.hidden_states[1:], -1), atol=1e-4, rtol=0)

    # prefill 6 tokens into the cache, then decode the other 3 one by one
    cache = init_cache(3, 2, 2, 16, 16, jnp.float32)
    prefill, _, cache = target_forward(target, jnp.asarray(ids[:, :6], jnp.int32), positions(2, 6), causal(2, 6), cache)
    rows, cache = [prefill], commit(cache, positions(2, 6), jnp.full((2,), 6, jnp.int32))
    for step in range(6, 9):
        step_logits, _, cache = target_forward(target, jnp.asarray(ids[:, step:step + 1], jnp.int32),
                                               cache.lengths[:, None], jnp.ones((2, 1, 1), bool), cache)
        rows.append(step_logits)
        cache = commit(cache, jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    np.testing.assert_array_equal(cache.lengths, [9, 9])
    assert np.abs(np.concatenate(rows, 1) - out.logits.numpy()).max() <= 1e-4


@pytest.mark.parametrize("norm", [False, True])
def test_saved_target_opens_in_transformers(tmp_path, norm):
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                            num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=norm,
                            mlp_only_layers=(2,))
    target = init_target(config, jax.random.key(0), jnp.float32, std=0.3)
    save_target(tmp_path, target)
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_sparse_layers(model) == (0, 1) and model.config.norm_topk_prob == norm
    ids = np.random.default_rng(2).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(target_logits(target, jnp.asarray(ids, jnp.int32))) - ref).max() <= 1e-4
    assert Qwen3MoeConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == config


def assert_same(a, b):
    assert a.config == b.config
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_checkpoint_layouts_per_expert_fused_and_sharded(tmp_path):
    """transformers writes one tensor per expert (single file and sharded); its in-memory fused layout
    (``mlp.experts.gate_up_proj``), saved as it is, loads to the same params; our round trips are exact."""
    model = hf_moe(norm=True, mlp_only=(1,))
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    names = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    fused = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    (tmp_path / "fused").mkdir()
    safetensors.torch.save_file(fused, tmp_path / "fused" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
    single = load_target(tmp_path / "single")
    assert_same(load_target(tmp_path / "sharded"), single)
    assert_same(load_target(tmp_path / "fused"), single)
    layer = single.params.layers[0]
    experts = model.model.layers[0].mlp.experts
    np.testing.assert_array_equal(layer.experts_gate_up[5], experts.gate_up_proj[5].detach().numpy().T)
    np.testing.assert_array_equal(layer.experts_down[5], experts.down_proj[5].detach().numpy().T)
    np.testing.assert_array_equal(layer.router, model.model.layers[0].mlp.gate.weight.detach().numpy().T)
    for dtype, shard in ((jnp.float32, None), (jnp.bfloat16, 3000)):
        target = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), single)
        save_target(tmp_path / f"ours{shard}", target, max_shard_bytes=shard)
        assert_same(load_target(tmp_path / f"ours{shard}"), target)


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
     "missing tensor 'model.layers.2.mlp.experts.3.up_proj.weight'"),
    (lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.weight": np.zeros((16, 32), np.float32)}),
     "unexpected tensor 'model.layers.1.mlp.experts.0.up_proj.weight'"),  # layer 1 is dense
    (lambda t: t.update({"model.layers.0.mlp.experts.8.up_proj.weight": np.zeros((16, 32), np.float32)}),
     "unexpected tensor 'model.layers.0.mlp.experts.8.up_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": np.zeros((7, 32), np.float32)}),
     r"tensor 'model.layers.0.mlp.gate.weight' has shape \(7, 32\), expected \(8, 32\)"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, change, message):
    hf_moe(norm=False, mlp_only=(1,)).save_pretrained(tmp_path)
    tensors = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    change(tensors)
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path)


def test_expert_routes_are_the_router_choices_of_transformers(tmp_path):
    model = hf_moe(norm=False, mlp_only=(1,))
    model.save_pretrained(tmp_path)
    target = load_target(tmp_path)
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, 7))
    with torch.no_grad():
        router_logits = model(torch.tensor(ids), output_router_logits=True).router_logits
    expected = np.stack([torch.topk(r, 3, dim=-1).indices.numpy().reshape(2, 7, 3) for r in router_logits])
    routes = expert_routes(target, jnp.asarray(ids, jnp.int32), positions(2, 7), causal(2, 7),
                           init_cache(3, 2, 2, 8, 16, jnp.float32))
    assert routes.shape == (2, 2, 7, 3) and routes.dtype == jnp.int32
    np.testing.assert_array_equal(routes, expected)
    counts = np.asarray(distinct_experts(routes, 8))
    np.testing.assert_array_equal(counts, [[len(set(expected[s, b].ravel())) for b in range(2)] for s in range(2)])
    assert counts.min() >= 3
    dense = init_target(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16),
                        jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="expert_routes needs a target with sparse layers"):
        expert_routes(dense, jnp.zeros((1, 2), jnp.int32), positions(1, 2), causal(1, 2),
                      init_cache(1, 1, 2, 4, 16, jnp.float32))


BASE = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=4, rope_theta=1e4, model_type="qwen3_moe", num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=4, norm_topk_prob=True, mlp_only_layers=[],
            decoder_sparse_step=1)


def test_config_reads_transformers_field_names():
    config = Qwen3MoeConfig.from_hf(BASE)
    assert config.sparse_layers == (0, 1) and config.mlp_only_layers == ()
    renamed = {k: v for k, v in BASE.items() if k != "num_experts"} | {"num_local_experts": 4}  # transformers 5
    assert Qwen3MoeConfig.from_hf(renamed) == config == Qwen3MoeConfig.from_hf(config.to_hf())
    assert Qwen3MoeConfig.from_hf(BASE | {"mlp_only_layers": None}).mlp_only_layers == ()
    assert Qwen3MoeConfig.from_hf(BASE | {"decoder_sparse_step": 2}).sparse_layers == (1,)
    assert hash(config) == hash(Qwen3MoeConfig.from_hf(BASE))


@pytest.mark.parametrize("field,value", [
    ("shared_expert_intermediate_size", 64), ("n_shared_experts", 1), ("num_shared_experts", 2),
    ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("n_group", 4), ("topk_group", 2),
    ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 1), ("hidden_act", "gelu"),
])
def test_unsupported_variants_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r} is not supported"):
        Qwen3MoeConfig.from_hf(BASE | {field: value})


@pytest.mark.parametrize("change,message", [
    ({"num_experts": 0}, "num_experts must be a positive int, got 0"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size must be a positive int"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive int"),
    ({"norm_topk_prob": 1}, "norm_topk_prob must be a bool"),
    ({"mlp_only_layers": [2]}, r"mlp_only_layers must hold layer ids in \[0, 2\)"),
    ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe' is not supported"),
    ({"num_local_experts": 8}, "num_experts=4 and num_local_experts=8 disagree"),
])
def test_bad_moe_configs_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        Qwen3MoeConfig.from_hf(BASE | change)


def test_a_moe_config_is_never_read_as_a_dense_qwen3(tmp_path):
    with pytest.raises(ValueError, match="num_experts=4: a mixture-of-experts model is not a dense Qwen3"):
        Qwen3Config.from_hf(BASE)
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"model_type": "qwen2_moe"}))
    with pytest.raises(ValueError, match="num_experts=4: a mixture-of-experts model is not a dense Qwen3"):
        load_target(tmp_path)


def test_the_mesh_must_split_the_experts_evenly():
    from ddtree_jax import sharding

    config = Qwen3MoeConfig.from_hf(BASE | {"num_experts": 6, "hidden_size": 16, "num_attention_heads": 4})
    with pytest.raises(ValueError, match="tp=4 does not divide the target's num_experts=6"):
        sharding.check_tp(config, 4)
    sharding.check_tp(config, 2)
