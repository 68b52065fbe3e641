"""Sharded runs of tiny models, for `test_sharding.py`, in a process with 8 CPU devices.

Usage: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_check.py OUT.json CASE...``
with ``CASE = MODEL:TP:DP`` (e.g. ``a:4:2``). `run_case` with ``mesh=None`` gives the unsharded
reference; the test compares the two. JSON output: ``{case: {key: value}}``.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine, sharding
from ddtree_jax.models import DFlashConfig, Qwen3Config, commit, init_cache, init_drafter, init_target, target_forward
from ddtree_jax.tree import build_tree, tree_attention_mask, tree_positions

# a: kv heads divisible by 8 (cache over heads), untied head, vocab divisible by 8.
# b: 2 kv heads (cache replicated for tp > 2), tied head, vocab 10 (replicated for tp = 4, 8).
MODELS = {
    "a": dict(vocab_size=8, num_key_value_heads=8, tie_word_embeddings=False),
    "b": dict(vocab_size=10, num_key_value_heads=2, tie_word_embeddings=True),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 1], [3, 3, 3, 2, 1, 0, 5, 6], [4]]
KEY_SEED = 3
SAMPLING = dict(temperature=[0.0, 1.0, 0.8, 1.0], top_k=[0, 0, 3, 0], top_p=[1.0, 1.0, 1.0, 0.7])
GENERATE = dict(method="ddtree", budget=10, topk_cap=None, draft_temperature=8.0, max_new_tokens=12, max_len=40,
                attention_impl="xla", sampler_impl="xla", with_expected=True)


def tiny_models(name: str):
    """A tiny fp32 target (8 query heads) and drafter of model ``name`` (see ``MODELS``)."""
    m = MODELS[name]
    tc = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                     head_dim=8, **m)
    dc = DFlashConfig(vocab_size=m["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                      target_layer_ids=(0, 1), mask_token_id=m["vocab_size"] - 1, num_target_layers=2)
    return (init_target(tc, jax.random.key(0), jnp.float32, std=0.4),
            init_drafter(dc, jax.random.key(1), jnp.float32, std=0.4))


def forward_logits(target, mesh):
    """Prefill logits of the padded prompts, then tree-verify logits of a 7-node tree over the
    committed prompts, through `target_forward` on the (sharded) target and cache."""
    prompt_BT, prompt_len_B = engine._pad_prompts(PROMPTS, target.config.vocab_size)
    batch, length = prompt_BT.shape
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, 24, cfg.head_dim, jnp.float32)
    if mesh is not None:
        target = sharding.shard_target(target, mesh)
        cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    prefill_logits, _, cache = target_forward(target, jnp.asarray(prompt_BT), positions, causal, cache)
    cache = commit(cache, positions, jnp.asarray(prompt_len_B))
    draft_logits = jax.random.normal(jax.random.key(5), (batch, 3, cfg.vocab_size))
    tree = build_tree(draft_logits, jnp.asarray(prompt_BT[:, 0]), budget=6, topk_cap=2)
    verify_logits, _, cache = target_forward(target, tree.tokens, tree_positions(tree, cache.lengths),
                                             tree_attention_mask(tree), cache)
    return prefill_logits, verify_logits, cache


def shard_shapes(tree) -> dict[str, list]:
    """``{path: [shard shape, number of devices holding the array]}`` for every array leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): [list(x.addressable_shards[0].data.shape), len(x.sharding.device_set)]
            for path, x in leaves}


def round_layouts(target, drafter, mesh) -> dict:
    """Shard shapes of the decode state after `engine.prefill` and after one `engine.decode_round`
    (the same compiled functions as `engine.generate`), and whether the round kept the layout."""
    spec = engine.make_spec(target, drafter, *(GENERATE[k] for k in ("method", "budget", "topk_cap", "attention_impl",
                                                                     "sampler_impl")))
    prompt_BT, prompt_len_B = engine._pad_prompts(PROMPTS, target.config.vocab_size)
    target, drafter = sharding.shard_target(target, mesh), sharding.shard_drafter(drafter, mesh)
    t, k, p, request_ids = sharding.shard_batch(
        (jnp.asarray(SAMPLING["temperature"]), jnp.asarray(SAMPLING["top_k"]), jnp.asarray(SAMPLING["top_p"]),
         jnp.arange(len(PROMPTS), dtype=jnp.int32)), mesh)
    prompt_BT, prompt_len_B = sharding.shard_batch((jnp.asarray(prompt_BT), jnp.asarray(prompt_len_B)), mesh)
    state = engine.prefill(target, drafter, prompt_BT, prompt_len_B, spec=spec, max_len=GENERATE["max_len"],
                           max_new_tokens=GENERATE["max_new_tokens"], mesh=mesh)
    before = shard_shapes(state)
    layout = jax.tree.map(lambda x: x.sharding, state)
    args = (engine.SamplingParams(t, k, p), jax.random.key(KEY_SEED), request_ids,
            jnp.float32(GENERATE["draft_temperature"]), jnp.asarray([-2], jnp.int32))
    state, _ = engine.decode_round(target, drafter, state, *args, spec=spec, max_new_tokens=GENERATE["max_new_tokens"],
                                   with_expected=True, mesh=mesh)
    kept = all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, layout)))
    return {"state_after_prefill": before, "state_after_round": shard_shapes(state), "round_keeps_layout": kept}


def run_case(model: str, mesh) -> dict:
    """Logits, generated tokens (mixed greedy and sampled requests) and, with a mesh, layouts."""
    target, drafter = tiny_models(model)
    prefill_logits, verify_logits, cache = forward_logits(target, mesh)
    res = engine.generate(target, drafter, PROMPTS, **SAMPLING, **GENERATE, key=jax.random.key(KEY_SEED), mesh=mesh)
    out = {"prefill_logits": np.asarray(prefill_logits).tolist(), "verify_logits": np.asarray(verify_logits).tolist(),
           "tokens": res.tokens.tolist(), "tau": res.tau}
    if mesh is not None:
        out["target_params"] = shard_shapes(sharding.shard_target(target, mesh).params)
        out["drafter_params"] = shard_shapes(sharding.shard_drafter(drafter, mesh).params)
        out["forward_cache"] = shard_shapes(cache)
        out.update(round_layouts(target, drafter, mesh))
    return out


def main(path: str, cases: list[str]) -> None:
    if jax.device_count() != 8:
        raise SystemExit(f"sharded_check needs 8 devices (XLA_FLAGS), got {jax.device_count()}")
    results = {}
    for case in cases:
        model, tp, dp = case.split(":")
        results[case] = run_case(model, sharding.make_mesh(int(tp), int(dp)))
    try:
        engine.generate(*tiny_models("a"), PROMPTS[:3], mesh=sharding.make_mesh(2, 2))
    except ValueError as err:
        results["odd_batch_error"] = str(err)
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
