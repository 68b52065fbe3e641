"""HF-format checkpoints (config.json + safetensors) for Qwen3 targets and DFlash drafters.

Reads single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
directories with the safetensors numpy API (never pickle). Torch ``Linear`` weights are
``[out, in]``; ours are ``[in, out]`` with q/k/v and gate/up fused, so loading transposes and
concatenates and saving splits and transposes back. Every tensor's name, shape and dtype is
checked against the config before use. Targets use the ``model.`` prefix and ``lm_head.weight``
(absent when ``tie_word_embeddings``); drafters have no prefix, plus ``fc`` and ``hidden_norm``.

Qwen3-MoE targets (``model_type: qwen3_moe``): a sparse layer has the router ``mlp.gate.weight
[E, D]`` and its experts either as the published checkpoints and ``save_pretrained`` store them,
one tensor per expert and projection (``mlp.experts.{e}.{gate,up,down}_proj.weight``), or fused as
transformers 5 holds them in memory (``mlp.experts.gate_up_proj [E, 2I, D]``, gate rows first, and
``mlp.experts.down_proj [E, D, I]``). Both load; saving writes the per-expert names.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax.models.dflash import DFlashConfig, Drafter
from ddtree_jax.models.layers import LayerShape, layer_shape
from ddtree_jax.models.params import DecoderLayer, DrafterParams, MoeDecoderLayer, TargetParams
from ddtree_jax.models.qwen3 import Qwen3Config, Target
from ddtree_jax.models.qwen3_moe import Qwen3MoeConfig

_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16)}
_DTYPE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                np.dtype(ml_dtypes.bfloat16): "bfloat16"}
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_FUSED_EXPERTS = ".mlp.experts.gate_up_proj"


# ---- per-layer name map ------------------------------------------------------------------

def _attention_hf_shapes(s: LayerShape) -> dict[str, tuple[int, ...]]:
    d, dh = s.hidden_size, s.head_dim
    hq, hkv = s.num_attention_heads, s.num_key_value_heads
    return {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
            "self_attn.q_proj.weight": (hq * dh, d), "self_attn.k_proj.weight": (hkv * dh, d),
            "self_attn.v_proj.weight": (hkv * dh, d), "self_attn.o_proj.weight": (d, hq * dh),
            "self_attn.q_norm.weight": (dh,), "self_attn.k_norm.weight": (dh,)}


def _layer_hf_shapes(s: LayerShape) -> dict[str, tuple[int, ...]]:
    d, inter = s.hidden_size, s.intermediate_size
    return {**_attention_hf_shapes(s), "mlp.gate_proj.weight": (inter, d), "mlp.up_proj.weight": (inter, d),
            "mlp.down_proj.weight": (d, inter)}


def _moe_layer_hf_shapes(s: LayerShape, num_experts: int, width: int, fused: bool) -> dict[str, tuple[int, ...]]:
    d = s.hidden_size
    shapes = {**_attention_hf_shapes(s), "mlp.gate.weight": (num_experts, d)}
    if fused:
        return shapes | {"mlp.experts.gate_up_proj": (num_experts, 2 * width, d),
                         "mlp.experts.down_proj": (num_experts, d, width)}
    for e in range(num_experts):
        shapes.update({f"mlp.experts.{e}.gate_proj.weight": (width, d), f"mlp.experts.{e}.up_proj.weight": (width, d),
                       f"mlp.experts.{e}.down_proj.weight": (d, width)})
    return shapes


def _attention_from_hf(get) -> dict:
    return dict(input_norm=get("input_layernorm.weight"), post_norm=get("post_attention_layernorm.weight"),
                wqkv=np.concatenate([get(f"self_attn.{n}_proj.weight").T for n in "qkv"], axis=1),
                q_norm=get("self_attn.q_norm.weight"), k_norm=get("self_attn.k_norm.weight"),
                wo=get("self_attn.o_proj.weight").T)


def _layer_from_hf(get, s: LayerShape) -> DecoderLayer:
    return DecoderLayer(
        **_attention_from_hf(get),
        w_gate_up=np.concatenate([get("mlp.gate_proj.weight").T, get("mlp.up_proj.weight").T], axis=1),
        w_down=get("mlp.down_proj.weight").T)


def _moe_layer_from_hf(get, num_experts: int, fused: bool) -> MoeDecoderLayer:
    if fused:
        gate_up = get("mlp.experts.gate_up_proj").transpose(0, 2, 1)
        down = get("mlp.experts.down_proj").transpose(0, 2, 1)
    else:
        gate_up = np.stack([np.concatenate([get(f"mlp.experts.{e}.gate_proj.weight").T,
                                            get(f"mlp.experts.{e}.up_proj.weight").T], axis=1)
                            for e in range(num_experts)])
        down = np.stack([get(f"mlp.experts.{e}.down_proj.weight").T for e in range(num_experts)])
    return MoeDecoderLayer(**_attention_from_hf(get), router=get("mlp.gate.weight").T, experts_gate_up=gate_up,
                           experts_down=down)


def _attention_to_hf(layer, s: LayerShape) -> dict:
    q_cols, kv_cols = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    wq, wk, wv = np.split(layer.wqkv, [q_cols, q_cols + kv_cols], axis=1)
    return {"input_layernorm.weight": layer.input_norm, "post_attention_layernorm.weight": layer.post_norm,
            "self_attn.q_proj.weight": wq.T, "self_attn.k_proj.weight": wk.T, "self_attn.v_proj.weight": wv.T,
            "self_attn.o_proj.weight": layer.wo.T, "self_attn.q_norm.weight": layer.q_norm,
            "self_attn.k_norm.weight": layer.k_norm}


def _layer_to_hf(layer: DecoderLayer | MoeDecoderLayer, s: LayerShape) -> dict:
    tensors = _attention_to_hf(layer, s)
    if isinstance(layer, MoeDecoderLayer):
        tensors["mlp.gate.weight"] = layer.router.T
        for e, (gate_up, down) in enumerate(zip(layer.experts_gate_up, layer.experts_down)):
            w_gate, w_up = np.split(gate_up, 2, axis=1)
            tensors.update({f"mlp.experts.{e}.gate_proj.weight": w_gate.T, f"mlp.experts.{e}.up_proj.weight": w_up.T,
                            f"mlp.experts.{e}.down_proj.weight": down.T})
        return tensors
    w_gate, w_up = np.split(layer.w_gate_up, 2, axis=1)
    return tensors | {"mlp.gate_proj.weight": w_gate.T, "mlp.up_proj.weight": w_up.T,
                      "mlp.down_proj.weight": layer.w_down.T}


# ---- whole-model name maps ---------------------------------------------------------------

def _target_hf_shapes(cfg: Qwen3Config, fused: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    dense = _layer_hf_shapes(layer_shape(cfg))
    sparse = (_moe_layer_hf_shapes(layer_shape(cfg), cfg.num_experts, cfg.moe_intermediate_size, fused)
              if cfg.sparse_layers else {})
    for i in range(cfg.num_hidden_layers):
        layer = sparse if i in cfg.sparse_layers else dense
        shapes.update({f"model.layers.{i}.{n}": s for n, s in layer.items()})
    return shapes


def _drafter_hf_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"fc.weight": (cfg.hidden_size, cfg.num_features), "hidden_norm.weight": (cfg.hidden_size,),
              "norm.weight": (cfg.hidden_size,)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"layers.{i}.{n}": s for n, s in _layer_hf_shapes(layer_shape(cfg)).items()})
    return shapes


def _target_params(cfg: Qwen3Config, get, fused: bool) -> TargetParams:
    def layer(i):
        get_i = lambda n: get(f"model.layers.{i}.{n}")  # noqa: E731
        if i in cfg.sparse_layers:
            return _moe_layer_from_hf(get_i, cfg.num_experts, fused)
        return _layer_from_hf(get_i, layer_shape(cfg))

    return TargetParams(
        embed=get("model.embed_tokens.weight"), final_norm=get("model.norm.weight"),
        layers=[layer(i) for i in range(cfg.num_hidden_layers)],
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight").T)


def _drafter_params(cfg: DFlashConfig, get) -> DrafterParams:
    return DrafterParams(
        fc=get("fc.weight").T, hidden_norm=get("hidden_norm.weight"), final_norm=get("norm.weight"),
        layers=[_layer_from_hf(lambda n, i=i: get(f"layers.{i}.{n}"), layer_shape(cfg))
                for i in range(cfg.num_hidden_layers)])


def _target_tensors(target: Target) -> dict:
    cfg, p = target.config, jax.tree.map(np.asarray, target.params)
    tensors = {"model.embed_tokens.weight": p.embed, "model.norm.weight": p.final_norm}
    if p.lm_head is not None:
        tensors["lm_head.weight"] = p.lm_head.T
    for i, layer in enumerate(p.layers):
        tensors.update({f"model.layers.{i}.{n}": w for n, w in _layer_to_hf(layer, layer_shape(cfg)).items()})
    return tensors


def _drafter_tensors(drafter: Drafter) -> dict:
    cfg, p = drafter.config, jax.tree.map(np.asarray, drafter.params)
    tensors = {"fc.weight": p.fc.T, "hidden_norm.weight": p.hidden_norm, "norm.weight": p.final_norm}
    for i, layer in enumerate(p.layers):
        tensors.update({f"layers.{i}.{n}": w for n, w in _layer_to_hf(layer, layer_shape(cfg)).items()})
    return tensors


# ---- public API --------------------------------------------------------------------------

def load_target(path, dtype=None) -> Target:
    """Load a Qwen3 target, or a Qwen3-MoE one (``model_type: qwen3_moe``; per-expert or fused
    expert tensors, see the module docstring), from an HF directory. ``dtype``: float32, float16 or
    bfloat16; ``None`` keeps the stored dtype."""
    dtype = _compute_dtype(dtype)
    config = _read_config(path, _TargetConfig)
    fused = bool(config.sparse_layers) and any(
        name.endswith(_FUSED_EXPERTS) for names in _weight_files(path).values() for name in names)
    # Tied checkpoints may still carry a copy of the embedding as lm_head.weight; it is unused.
    optional = {"lm_head.weight": (config.vocab_size, config.hidden_size)} if config.tie_word_embeddings else {}
    get, stored = _open_checked(path, _target_hf_shapes(config, fused), optional)
    return Target(config=config, params=_as_jax(_target_params(config, get, fused), dtype or stored))


def load_drafter(path, dtype=None) -> Drafter:
    """Load a DFlash drafter from an HF directory. ``dtype``: float32, float16 or bfloat16; ``None`` keeps
    the stored dtype."""
    dtype = _compute_dtype(dtype)
    config = _read_config(path, DFlashConfig)
    get, stored = _open_checked(path, _drafter_hf_shapes(config), {})
    return Drafter(config=config, params=_as_jax(_drafter_params(config, get), dtype or stored))


def save_target(path, target: Target, *, max_shard_bytes=None) -> None:
    """Write ``target`` as an HF directory that ``transformers.Qwen3ForCausalLM`` (or, for a
    Qwen3-MoE target, ``Qwen3MoeForCausalLM``) opens.

    With ``max_shard_bytes``, tensors are split over several files with an index json.
    """
    _check_model("target", target, (Qwen3Config, Qwen3MoeConfig))
    _save(path, target.config.to_hf(), _target_tensors(target), max_shard_bytes)


def save_drafter(path, drafter: Drafter, *, max_shard_bytes=None) -> None:
    """Write ``drafter`` as a DFlash HF directory (names without the ``model.`` prefix). A draft
    vocabulary (`dflash.with_draft_vocab`) is a setting of inference, not a weight: ``ValueError``."""
    _check_model("drafter", drafter, (DFlashConfig,))
    if drafter.params.draft_ids is not None:
        raise ValueError("the drafter has a draft vocabulary (with_draft_vocab), which a DFlash checkpoint does not "
                         "hold: save the drafter without it (with_draft_vocab(drafter, target, None))")
    _save(path, drafter.config.to_hf(), _drafter_tensors(drafter), max_shard_bytes)


# ---- files -------------------------------------------------------------------------------

class _TargetConfig:
    """The target config class a ``config.json`` names: Qwen3-MoE for ``model_type: qwen3_moe``."""

    @staticmethod
    def from_hf(hf):
        return (Qwen3MoeConfig if hf.get("model_type") == "qwen3_moe" else Qwen3Config).from_hf(hf)


def _read_config(path, cls):
    """``cls.from_hf`` of ``path/config.json``; every problem with the file is a ``ValueError`` naming it."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"no config.json in {str(path)!r}")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(hf).__name__}")
    try:
        return cls.from_hf(hf)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{config_path}: {str(err).removeprefix('config.json: ')}") from None


def _weight_files(path) -> dict[str, list[str]]:
    """``{file: [tensor names]}`` from the index json, or the single file's own names."""
    index_path = os.path.join(path, _INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if not os.path.isfile(os.path.join(path, _SINGLE)):
        raise ValueError(f"no {_SINGLE} or {_INDEX} in {path!r}")
    with safe_open(os.path.join(path, _SINGLE), framework="np") as f:
        return {_SINGLE: list(f.keys())}


def _open_checked(path, expected, optional):
    """Check names, shapes and dtypes of all tensors; return ``get(name) -> np.ndarray`` and the
    common stored dtype."""
    files = _weight_files(path)
    location, dtypes = {}, set()
    for file, names in files.items():
        with safe_open(os.path.join(path, file), framework="np") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"tensor {name!r} is listed in the index but missing from {file}")
                if name not in expected and name not in optional:
                    raise ValueError(f"unexpected tensor {name!r} in {file}")
                if name in location:
                    raise ValueError(f"tensor {name!r} appears in both {location[name]} and {file}")
                tensor = f.get_slice(name)
                want = expected.get(name, optional.get(name))
                if tuple(tensor.get_shape()) != want:
                    raise ValueError(f"tensor {name!r} has shape {tuple(tensor.get_shape())}, expected {want} by "
                                     f"{os.path.join(path, 'config.json')} (in {os.path.join(path, file)})")
                if tensor.get_dtype() not in _DTYPES:
                    raise ValueError(f"tensor {name!r} has dtype {tensor.get_dtype()}, "
                                     f"expected one of {sorted(_DTYPES)}")
                location[name] = file
                dtypes.add(_DTYPES[tensor.get_dtype()])
    missing = sorted(set(expected) - set(location))
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all) in {path!r}")

    def get(name):
        with safe_open(os.path.join(path, location[name]), framework="np") as f:
            return f.get_tensor(name)

    return get, jnp.result_type(*dtypes)


def _check_model(name, model, configs) -> None:
    """``ValueError`` unless ``model`` is a model whose config is one of ``configs``."""
    if not isinstance(getattr(model, "config", None), configs):
        raise ValueError(f"{name} must be a model with a {' or '.join(c.__name__ for c in configs)}, got "
                         f"{type(model).__name__}")


def _compute_dtype(dtype):
    """``None`` or one of the checkpoint dtypes (`_DTYPE_NAMES`), else a ``ValueError`` naming it: an integer
    dtype would round the weights, a float64 one is float32 in JAX unless x64 is on."""
    if dtype is None:
        return None
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES.values())} or None, got {dtype!r}") from None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_NAMES.values())} or None, got {dtype}")
    return dtype


def _as_jax(params, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x.astype(dtype)), params)


def _save(path, hf_config, tensors, max_shard_bytes) -> None:
    dtype_names = {_DTYPE_NAMES.get(t.dtype) for t in tensors.values()}
    if None in dtype_names or len(dtype_names) != 1:
        raise ValueError(f"can only save one of {sorted(_DTYPE_NAMES.values())} for all tensors, "
                         f"got {sorted({str(t.dtype) for t in tensors.values()})}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"path must be a directory (new or existing) for the checkpoint, got the file {path}")
    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    shards = _shard(tensors, max_shard_bytes)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**hf_config, "dtype": dtype_names.pop()}, f, indent=2, sort_keys=True)
    if len(shards) == 1:
        if os.path.exists(os.path.join(path, _INDEX)):  # a stale index would shadow the new file
            os.remove(os.path.join(path, _INDEX))
        save_file(tensors, os.path.join(path, _SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, names in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(path, _INDEX), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


def _shard(tensors, max_shard_bytes) -> list[list[str]]:
    """Greedy split of tensor names (in order) into groups of at most ``max_shard_bytes``
    (a larger tensor gets a group of its own)."""
    if max_shard_bytes is None:
        return [list(tensors)]
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards, size = [[]], 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensor.nbytes
    return shards
