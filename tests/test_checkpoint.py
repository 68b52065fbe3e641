"""HF checkpoints: round trips (single file, sharded, bf16, tied) and errors naming the tensor."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from ddtree_jax.checkpoint import load_drafter, load_target, save_drafter, save_target
from ddtree_jax.models import DFlashConfig, Qwen3Config, init_drafter, init_target


def tiny_target(tied=False, dtype=jnp.float32):
    config = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied)
    return init_target(config, jax.random.key(0), dtype)


def tiny_drafter(dtype=jnp.float32):
    config = DFlashConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, block_size=4,
                          target_layer_ids=(0, 1), mask_token_id=49, num_target_layers=2)
    return init_drafter(config, jax.random.key(1), dtype)


def assert_same(a, b):
    assert a.config == b.config
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shard", [None, 2000])
def test_round_trips_are_identical(tmp_path, dtype, shard):
    for tied in (False, True):
        target = tiny_target(tied, dtype)
        save_target(tmp_path / f"t{tied}", target, max_shard_bytes=shard)
        assert_same(load_target(tmp_path / f"t{tied}"), target)
    drafter = tiny_drafter(dtype)
    save_drafter(tmp_path / "d", drafter, max_shard_bytes=shard)
    assert_same(load_drafter(tmp_path / "d"), drafter)
    sharded = (tmp_path / "d" / "model.safetensors.index.json").exists()
    assert sharded == (shard is not None) and len(list((tmp_path / "d").glob("*.safetensors"))) > int(sharded)
    assert load_drafter(tmp_path / "d", dtype=jnp.float32).params.fc.dtype == jnp.float32


def test_file_layout_uses_hf_names(tmp_path):
    save_target(tmp_path / "t", tiny_target(tied=True))
    names = set(load_file(tmp_path / "t" / "model.safetensors"))
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert load_file(tmp_path / "t" / "model.safetensors")["model.layers.1.self_attn.q_proj.weight"].shape == (16, 16)
    save_drafter(tmp_path / "d", tiny_drafter())
    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert tensors["fc.weight"].shape == (16, 32) and "layers.0.mlp.gate_proj.weight" in tensors
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in tensors)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": 49}


def test_loads_transformers_sharded_checkpoint(tmp_path):
    config = transformers.Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert_same(load_target(tmp_path / "sharded"), load_target(tmp_path / "single"))
    w = load_target(tmp_path / "single").params.layers[1].wqkv
    np.testing.assert_array_equal(w[:, 16:24], model.model.layers[1].self_attn.k_proj.weight.detach().numpy().T)


def corrupt(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((24, 16), np.float32)}),
     "unexpected tensor 'model.layers.2.mlp.up_proj.weight'"),
    (lambda t: t.update({"model.norm.weight": np.zeros((15,), np.float32)}),
     r"tensor 'model.norm.weight' has shape \(15,\), expected \(16,\)"),
    (lambda t: t.update({"lm_head.weight": np.zeros((50, 16), np.int32)}), "tensor 'lm_head.weight' has dtype I32"),
])
def test_bad_target_checkpoints_name_the_tensor(tmp_path, change, message):
    save_target(tmp_path, tiny_target())
    corrupt(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path)


@pytest.mark.parametrize("dtype", [jnp.int32, "float64", "fp8"])
def test_a_load_dtype_other_than_the_checkpoint_dtypes_is_refused(tmp_path, dtype):
    save_target(tmp_path, tiny_target())
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\] or None"):
        load_target(tmp_path, dtype)
    assert load_target(tmp_path, "float16").params.embed.dtype == jnp.float16


def test_saving_something_else_than_a_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="target must be a model with a Qwen3Config or Qwen3MoeConfig, got dict"):
        save_target(tmp_path, {"config": None})
    with pytest.raises(ValueError, match="drafter must be a model with a DFlashConfig, got Model"):
        save_drafter(tmp_path, tiny_target())


def test_saving_into_a_file_or_with_bad_shards_writes_nothing(tmp_path):
    (tmp_path / "weights").write_text("not a directory")
    with pytest.raises(ValueError, match="path must be a directory .* got the file"):
        save_target(tmp_path / "weights", tiny_target())
    with pytest.raises(ValueError, match="max_shard_bytes must be positive, got 0"):
        save_drafter(tmp_path / "d", tiny_drafter(), max_shard_bytes=0)
    assert not (tmp_path / "d").exists() and (tmp_path / "weights").read_text() == "not a directory"


def test_bad_drafter_checkpoints_and_directories(tmp_path):
    save_drafter(tmp_path / "d", tiny_drafter())
    corrupt(tmp_path / "d", lambda t: t.update({"fc.weight": np.zeros((16, 16), np.float32)}))
    with pytest.raises(ValueError, match=r"tensor 'fc.weight' has shape \(16, 16\), expected \(16, 32\)"):
        load_drafter(tmp_path / "d")
    with pytest.raises(ValueError, match="no config.json"):
        load_target(tmp_path / "missing")
    (tmp_path / "d" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_drafter(tmp_path / "d")
    save_target(tmp_path / "t", tiny_target(), max_shard_bytes=2000)
    index_path = tmp_path / "t" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'model.layers.0.extra.weight' is listed in the index but missing"):
        load_target(tmp_path / "t")


@pytest.mark.parametrize("text,message", [
    ('{"vocab_size": 50,', "config.json is not valid JSON"),
    ("[1, 2]", "config.json must hold a JSON object, got list"),
    ('{"vocab_size": 50}', r"config.json: missing fields \['head_dim', 'hidden_size'"),
])
def test_bad_config_files_are_named(tmp_path, text, message):
    save_target(tmp_path, tiny_target())
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_target(tmp_path)
    assert str(error.value).startswith(str(tmp_path / "config.json"))


def test_a_config_that_disagrees_with_the_weights_names_both_files(tmp_path):
    save_drafter(tmp_path, tiny_drafter())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 20}))
    with pytest.raises(ValueError, match="expected .* by " + str(tmp_path / "config.json")
                       + r" \(in " + str(tmp_path / "model.safetensors") + r"\)"):
        load_drafter(tmp_path)


def test_tied_checkpoint_with_a_stored_lm_head_loads_without_it(tmp_path):
    target = tiny_target(tied=True)
    save_target(tmp_path, target)
    corrupt(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    loaded = load_target(tmp_path)
    assert loaded.params.lm_head is None
    assert_same(loaded, target)
