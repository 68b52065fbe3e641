"""Sharding: the target tensor-parallel over "tp" and requests split over "dp" give the unsharded results.

The sharded runs need 8 devices, so they run in two subprocesses started with
``--xla_force_host_platform_device_count=8`` (`sharded_check.py`) while this process computes the
unsharded references on its own device. Cases are ``MODEL:TP:DP``; model "a" has 8 KV heads and a
vocabulary of 8 (cache and vocabulary split at every tp), model "b" 2 KV heads and a vocabulary of 10
(both replicated at tp = 4). ``MODEL:TP:DP:interpret`` cases run the Pallas attention kernel (interpreted)
inside ``shard_map`` on models "c" and "d", "a" and "b" with head_dim 16, against the unsharded XLA path.
Model "e" is a Qwen3-MoE target: its 16 experts are split over "tp" (2 per device at tp = 8).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import sharded_check
from ddtree_jax import engine, sharding
from ddtree_jax.cli import main as cli_main
from ddtree_jax.models import Qwen3Config, drafter_forward, init_cache, target_forward

KERNEL_CASES = ("c:2:1:interpret", "d:4:1:interpret", "c:2:2:interpret")  # d:4:1: 2 KV heads over tp = 4
CASES = ("a:1:1", "a:2:1", "a:4:1", "a:8:1", "b:4:2", "e:8:1", "e:4:2", *KERNEL_CASES)
WORKERS = (("a:1:1", "a:4:1", "b:4:2", "d:4:1:interpret", "e:8:1", "attention"),
           ("a:2:1", "a:8:1", "c:2:1:interpret", "c:2:2:interpret", "e:4:2", "batch_policy", "draft_vocab"))
ROW_SPLIT = {"wqkv", "wo", "w_gate_up", "w_down"}
EXPERT_SPLIT = {"experts_gate_up", "experts_down"}


def parse(case):
    model, tp, dp = case.split(":")[:3]
    return model, int(tp), int(dp)


def start_background():
    """The two worker processes of `sharded_check.py` (8 CPU devices each, the cases of `WORKERS`), started
    now and writing ``{i}.json`` and ``{i}.log`` into a fresh directory: ``(processes, directory)``.

    conftest.py starts them as soon as the tests are collected (see its ``background`` fixture), so that
    their minutes of compilation overlap the modules that run before this one.
    """
    out = Path(tempfile.mkdtemp(prefix="sharded_check_"))
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    # the workers import the same checkout as this process, not whichever one is installed
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    script = str(Path(__file__).with_name("sharded_check.py"))
    procs = []
    for i, cases in enumerate(WORKERS):
        with open(out / f"{i}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, script, str(out / f"{i}.json"), *cases], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs, out


def stop_background(started) -> None:
    procs, out = started
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def runs(background):
    """``(unsharded reference per model, sharded results per case)``, see `sharded_check.run_case`."""
    procs, out = background
    reference = {model: sharded_check.run_case(model, None) for model in sharded_check.MODELS}
    results = {}
    for i, proc in enumerate(procs):
        proc.wait(timeout=900)
        assert proc.returncode == 0, (out / f"{i}.log").read_text()[-4000:]
        results.update(json.loads((out / f"{i}.json").read_text()))
    return reference, results


def test_all_cases_ran(runs):
    assert set(runs[1]) >= {*CASES, "attention"}
    assert all(r["tau"] > 1.5 for r in runs[0].values())  # trees are accepted: commits of several tokens


def test_batch_budget_policy_under_tensor_parallelism(runs):
    """The packed verify rows of budget_policy="batch" (a Qwen3-MoE target, experts over tp = 4) give the
    unsharded tokens; a dp > 1 mesh is refused before anything runs."""
    sharded = runs[1]["batch_policy"]
    assert sharded["tokens"] == sharded_check.batch_policy()["tokens"]
    assert "does not run with the requests split over dp=2" in sharded["dp_error"]


def test_draft_vocabulary_under_tensor_and_data_parallelism(runs):
    """A drafter drafting from 5 of the 8 tokens, its head cut from an LM head split over tp = 4, with the
    requests over dp = 2: the unsharded tokens."""
    sharded = runs[1]["draft_vocab"]
    assert sharded["tokens"] == sharded_check.draft_vocab()["tokens"] and sharded["tau"] > 1.0


@pytest.mark.parametrize("case", CASES)
def test_kernel_runs_inside_shard_map_only_when_asked(runs, case):
    """Interpret cases: one Pallas call per target layer in the verify forward, plus one per drafter layer in
    a round, each inside a shard_map; the XLA cases and the unsharded references have none."""
    reference, results = runs
    layers = (2, 3) if case.endswith(":interpret") else (0, 0)
    for key, count in zip(("verify_kernels", "round_kernels"), layers):
        assert results[case][key] == {"pallas_calls": count, "in_shard_map": count}, key
    assert reference[parse(case)[0]]["verify_kernels"] == {"pallas_calls": 0, "in_shard_map": 0}


def test_sharded_kernel_attention_matches_xla(runs):
    """Every head layout of `kernels.shard_attention` (sharded_check.ATTENTION_SHAPES) on random operands."""
    errors = runs[1]["attention"]
    assert len(errors) == len(sharded_check.ATTENTION_SHAPES)
    assert max(errors) < 1e-5, errors


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_verify_logits_match_unsharded(runs, case):
    """float32 logits within rounding. The Qwen3-MoE target ("e") sums its experts' outputs across devices
    (a psum of per-device partial sums) in another order than the unsharded sum: on some CPUs that moved a
    few of 256 logits by 1.6-1.7e-5, so its bound is 5e-5 (a wrong expert split or a missing sum moves them
    by 1e-2 and more)."""
    reference, results = runs
    atol = 5e-5 if parse(case)[0] == "e" else 1e-5
    for key in ("prefill_logits", "verify_logits"):
        np.testing.assert_allclose(results[case][key], reference[parse(case)[0]][key], rtol=1e-5, atol=atol,
                                   err_msg=key)


@pytest.mark.parametrize("case", CASES)
def test_generated_tokens_match_unsharded(runs, case):
    """Request 0 is greedy; requests 1-3 sample (plain, top-k, top-p) from the same key."""
    reference, results = runs
    tokens = np.asarray(results[case]["tokens"])
    np.testing.assert_array_equal(tokens, reference[parse(case)[0]]["tokens"])
    assert (tokens >= 0).all()


def expected_target_shard(path, shape, tp, vocab):
    """The partition rules, stated on shard shapes."""
    name = path.rsplit(".", 1)[-1]
    if name in ROW_SPLIT or (name == "embed" and vocab % tp == 0):
        return [shape[0] // tp, shape[1]]
    if name in EXPERT_SPLIT:  # whole experts per device
        return [shape[0] // tp, *shape[1:]]
    if name == "lm_head" and vocab % tp == 0:
        return [shape[0], shape[1] // tp]
    return list(shape)


@pytest.mark.parametrize("case", CASES)
def test_parameter_shardings(runs, case):
    model, tp, dp = parse(case)
    target, drafter = sharded_check.tiny_models(model)
    results = runs[1][case]
    for params, placed, rule in ((target.params, results["target_params"], expected_target_shard),
                                 (drafter.params, results["drafter_params"], lambda path, shape, *_: list(shape))):
        shapes = {jax.tree_util.keystr(path): x.shape for path, x in jax.tree_util.tree_leaves_with_path(params)}
        assert set(placed) == set(shapes)
        for path, (shard, devices) in placed.items():
            assert shard == rule(path, shapes[path], tp, target.config.vocab_size), path
            assert devices == tp * dp, path
    qkv_columns = (8 + 2 * sharded_check.MODELS[model]["num_key_value_heads"]) * sharded_check.MODELS[model]["head_dim"]
    assert results["target_params"][".layers[0].wqkv"][0] == [64 // tp, qkv_columns]
    tied = sharded_check.MODELS[model]["tie_word_embeddings"]
    assert (".lm_head" in results["target_params"]) == (not tied)
    if "moe" in sharded_check.MODELS[model]:  # 16 experts of width 32: whole experts per device, router everywhere
        assert results["target_params"][".layers[0].experts_gate_up"][0] == [16 // tp, 64, 64]
        assert results["target_params"][".layers[0].experts_down"][0] == [16 // tp, 32, 64]
        assert results["target_params"][".layers[0].router"][0] == [64, 16]
        assert results["target_params"][".layers[1].w_down"][0] == [128 // tp, 64]  # the dense layer


@pytest.mark.parametrize("case", CASES)
def test_cache_and_state_shardings(runs, case):
    model, tp, dp = parse(case)
    results, devices = runs[1][case], tp * dp
    kv_heads, head_dim = (sharded_check.MODELS[model][k] for k in ("num_key_value_heads", "head_dim"))
    heads, batch = (kv_heads // tp if kv_heads % tp == 0 else kv_heads), len(sharded_check.PROMPTS) // dp
    assert results["forward_cache"][".k"] == [[2, batch, heads, 24, head_dim], devices]
    for key in ("state_after_prefill", "state_after_round"):
        state = results[key]
        for name in (".k", ".v"):
            assert state[".target_cache" + name] == [[2, batch, heads, 40, head_dim], devices]
            # replicated over tp; block_size (4) more slots than the target's
            assert state[".drafter_cache" + name] == [[1, batch, 2, 44, 16], devices]
        for name, (shard, placed_on) in state.items():
            assert placed_on == devices, name
            if name != ".round" and not name.endswith((".k", ".v")):
                assert shard[0] == batch, name
    assert results["state_after_round"] == results["state_after_prefill"]
    assert results["round_keeps_layout"]


def test_batch_not_divisible_by_dp(runs):
    assert runs[1]["odd_batch_error"] == "dp=2 does not divide the batch size 3"


def test_ar_on_a_one_device_mesh_matches_unsharded():
    """AR has no drafter cache in its state; the mesh path must place the rest."""
    target, _ = sharded_check.tiny_models("b")
    kwargs = dict(method="ar", temperature=[0.0, 1.0, 1.0, 0.0], max_new_tokens=5, key=jax.random.key(1))
    plain = engine.generate(target, None, sharded_check.PROMPTS, **kwargs)
    meshed = engine.generate(target, None, sharded_check.PROMPTS, **kwargs, mesh=sharding.make_mesh())
    np.testing.assert_array_equal(meshed.tokens, plain.tokens)


def test_make_mesh():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("dp", "tp") and dict(mesh.shape) == {"dp": 1, "tp": 1}
    with pytest.raises(ValueError, match=r"tp=8 x dp=64 needs 512 devices, but only \d+ are available"):
        sharding.make_mesh(8, 64)
    with pytest.raises(ValueError, match="tp must be"):
        sharding.make_mesh(0)
    with pytest.raises(ValueError, match="dp must be"):
        sharding.make_mesh(1, 1.5)


@pytest.mark.parametrize("field,value,tp", [("num_attention_heads", 8, 3), ("hidden_size", 36, 8),
                                            ("intermediate_size", 100, 8)])
def test_check_tp_names_the_size_it_does_not_divide(field, value, tp):
    sizes = dict(num_attention_heads=8, hidden_size=64, intermediate_size=128) | {field: value}
    config = Qwen3Config(vocab_size=8, num_hidden_layers=1, num_key_value_heads=2, head_dim=8, **sizes)
    with pytest.raises(ValueError, match=f"tp={tp} does not divide the target's {field}={value}"):
        sharding.check_tp(config, tp)


def test_check_mesh_wants_dp_tp_axes():
    config = Qwen3Config(vocab_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    mesh = sharding.make_mesh()
    sharding.check_mesh(mesh, config, batch=3)
    with pytest.raises(ValueError, match="axes"):
        sharding.check_mesh(Mesh(mesh.devices.reshape(-1), ("x",)), config)


def test_forwards_validate_the_mesh_before_tracing():
    target, drafter = sharded_check.tiny_models("c")
    cfg, dc, batch = target.config, drafter.config, 3
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, 8, cfg.head_dim, jnp.float32)
    tokens = jnp.zeros((batch, 2), jnp.int32)
    args = (target, tokens, tokens, jnp.ones((batch, 2, 2), bool), cache)
    flat = Mesh(sharding.make_mesh().devices.reshape(-1), ("x",))
    with pytest.raises(ValueError, match="axes"):
        target_forward(*args, attention_impl="interpret", mesh=flat)
    drafter_cache = init_cache(dc.num_hidden_layers, batch, dc.num_key_value_heads, 8, dc.head_dim, jnp.float32)
    feats = jnp.zeros((batch, 1, dc.num_features), jnp.float32)
    zeros = jnp.zeros((batch,), jnp.int32)
    with pytest.raises(ValueError, match="axes"):
        drafter_forward(drafter, target, drafter_cache, feats, zeros[:, None], zeros, zeros, zeros,
                        attention_impl="interpret", mesh=flat)


@pytest.mark.parametrize("argv,message", [
    (["--tp", "3"], "tp=3 does not divide the target's num_attention_heads=8"),
    (["--tp", "8", "--dp", "64"], "needs 512 devices"),
])
def test_cli_tp_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli_main(["generate", "--max-new-tokens", "4", "--json", *argv])
