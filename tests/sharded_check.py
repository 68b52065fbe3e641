"""Sharded runs of tiny models, for `test_sharding.py`, in a process with 8 CPU devices.

Usage: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_check.py OUT.json CASE...``
with ``CASE = MODEL:TP:DP`` (e.g. ``a:4:2``), or ``MODEL:TP:DP:interpret`` for the Pallas attention
kernel (run by the interpreter) inside ``shard_map``. `run_case` with ``mesh=None`` gives the unsharded
XLA-path reference; the test compares the two. JSON output: ``{case: {key: value}}``, plus
``"attention"``: the largest error of the sharded kernel per `ATTENTION_SHAPES` entry.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import engine, sharding
from ddtree_jax.models import (
    DFlashConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    commit,
    init_cache,
    init_drafter,
    init_target,
    target_forward,
    with_draft_vocab,
)
from ddtree_jax.kernels import attention_fn
from pallas_kernels.tree_attention_reference import tree_attention_reference as attention
from ddtree_jax.tree import build_tree, tree_attention_mask, tree_positions

# a: kv heads divisible by 8 (cache over heads), untied head, vocab divisible by 8.
# b: 2 kv heads (cache replicated for tp > 2), tied head, vocab 10 (replicated for tp = 4, 8).
# c, d: a and b with the head_dim 16 the Pallas kernel needs.
# e: a Qwen3-MoE target (layer 0 sparse: 16 experts split over tp, 4 per token; layer 1 dense), else a.
MODELS = {
    "a": dict(vocab_size=8, num_key_value_heads=8, tie_word_embeddings=False, head_dim=8),
    "b": dict(vocab_size=10, num_key_value_heads=2, tie_word_embeddings=True, head_dim=8),
    "c": dict(vocab_size=8, num_key_value_heads=8, tie_word_embeddings=False, head_dim=16),
    "d": dict(vocab_size=10, num_key_value_heads=2, tie_word_embeddings=True, head_dim=16),
    "e": dict(vocab_size=8, num_key_value_heads=8, tie_word_embeddings=False, head_dim=8,
              moe=dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                       mlp_only_layers=(1,))),
}
# (query heads, kv heads, tp, dp, split_heads) of the kernel-in-shard_map check: cache over kv heads;
# replicated with one kv head per device (tp = 4, 8); replicated with one kv head per query head
# (tp = 2, 4 over 12 heads in groups of 4); batch over dp; heads unsplit (the drafter).
ATTENTION_SHAPES = ((8, 4, 2, 2, True), (8, 2, 4, 1, True), (8, 2, 8, 1, True), (12, 3, 2, 1, True),
                    (12, 3, 4, 2, True), (4, 2, 4, 2, False))
PROMPTS = [[1, 2, 3, 4, 5], [7, 1], [3, 3, 3, 2, 1, 0, 5, 6], [4]]
KEY_SEED = 3
SAMPLING = dict(temperature=[0.0, 1.0, 0.8, 1.0], top_k=[0, 0, 3, 0], top_p=[1.0, 1.0, 1.0, 0.7])
GENERATE = dict(method="ddtree", budget=10, topk_cap=None, draft_temperature=8.0, max_new_tokens=12, max_len=40,
                attention_impl="xla", sampler_impl="xla", with_expected=True, chunk_rounds=16)


def tiny_models(name: str):
    """A tiny fp32 target (8 query heads) and drafter of model ``name`` (see ``MODELS``)."""
    m = dict(MODELS[name])
    experts = m.pop("moe", None)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, **m)
    tc = Qwen3Config(**shape) if experts is None else Qwen3MoeConfig(**shape, **experts)
    dc = DFlashConfig(vocab_size=m["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=4,
                      target_layer_ids=(0, 1), mask_token_id=m["vocab_size"] - 1, num_target_layers=2)
    return (init_target(tc, jax.random.key(0), jnp.float32, std=0.4),
            init_drafter(dc, jax.random.key(1), jnp.float32, std=0.4))


def _count_primitives(jaxpr, counts, in_shard_map=False):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        counts[name] = counts.get(name, 0) + 1
        if name == "pallas_call":
            counts["pallas_call_in_shard_map"] = counts.get("pallas_call_in_shard_map", 0) + in_shard_map
            continue  # the kernel body is not part of the program around it
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(sub, "eqns"):
                    _count_primitives(sub, counts, in_shard_map or name == "shard_map")
    return counts


def count_kernels(fn, *args) -> dict:
    """How many Pallas calls ``fn(*args)`` runs, and how many of them inside a ``shard_map``
    (nested jaxprs walked)."""
    counts = _count_primitives(jax.make_jaxpr(fn)(*args).jaxpr, {})
    return {"pallas_calls": counts.get("pallas_call", 0), "in_shard_map": counts.get("pallas_call_in_shard_map", 0)}


def forward_logits(target, mesh, attention_impl="xla"):
    """Prefill logits of the padded prompts, then tree-verify logits of a 7-node tree over the
    committed prompts, through `target_forward` on the (sharded) target and cache; and the kernel
    counts of the verify forward (see `count_kernels`)."""
    prompt_BT, prompt_len_B = engine._pad_prompts(PROMPTS, target.config.vocab_size)
    batch, length = prompt_BT.shape
    cfg = target.config
    cache = init_cache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, 24, cfg.head_dim, jnp.float32)
    if mesh is not None:
        target = sharding.shard_target(target, mesh)
        cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    forward = functools.partial(target_forward, attention_impl=attention_impl, mesh=mesh)
    prefill_logits, _, cache = forward(target, jnp.asarray(prompt_BT), positions, causal, cache)
    cache = commit(cache, positions, jnp.asarray(prompt_len_B))
    draft_logits = jax.random.normal(jax.random.key(5), (batch, 3, cfg.vocab_size))
    tree = build_tree(draft_logits, jnp.asarray(prompt_BT[:, 0]), budget=6, topk_cap=2)
    verify_args = (target, tree.tokens, tree_positions(tree, cache.lengths), tree_attention_mask(tree), cache)
    kernels = count_kernels(forward, *verify_args)
    verify_logits, _, cache = forward(*verify_args)
    return prefill_logits, verify_logits, cache, kernels


def shard_shapes(tree) -> dict[str, list]:
    """``{path: [shard shape, number of devices holding the array]}`` for every array leaf."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(path): [list(x.addressable_shards[0].data.shape), len(x.sharding.device_set)]
            for path, x in leaves}


def round_layouts(target, drafter, mesh, attention_impl="xla") -> dict:
    """Shard shapes of the decode state after `engine.prefill` and after one round of `engine.decode_rounds`
    (the programs `engine.generate` ran in `run_case`, with the same arguments: loaded from the compilation
    cache, not compiled again), whether the round kept the layout, and the round's kernel counts (see
    `count_kernels`)."""
    spec = engine.make_spec(target, drafter, *(GENERATE[k] for k in ("method", "budget", "topk_cap")),
                            attention_impl, GENERATE["sampler_impl"])
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
    round_fn = functools.partial(engine.decode_rounds, spec=spec, max_new_tokens=GENERATE["max_new_tokens"],
                                 with_expected=GENERATE["with_expected"], mesh=mesh, chunk=GENERATE["chunk_rounds"])
    kernels = count_kernels(round_fn, target, drafter, state, *args, jnp.int32(1))
    state, _, count = round_fn(target, drafter, state, *args, jnp.int32(1))
    assert int(count) == 1
    kept = all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, layout)))
    return {"state_after_prefill": before, "state_after_round": shard_shapes(state), "round_keeps_layout": kept,
            "round_kernels": kernels}


def run_case(model: str, mesh, attention_impl: str = "xla") -> dict:
    """Logits, generated tokens (mixed greedy and sampled requests) and, with a mesh, layouts and
    kernel counts."""
    target, drafter = tiny_models(model)
    prefill_logits, verify_logits, cache, kernels = forward_logits(target, mesh, attention_impl)
    res = engine.generate(target, drafter, PROMPTS, **SAMPLING, **(GENERATE | {"attention_impl": attention_impl}),
                          key=jax.random.key(KEY_SEED), mesh=mesh)
    out = {"prefill_logits": np.asarray(prefill_logits).tolist(), "verify_logits": np.asarray(verify_logits).tolist(),
           "tokens": res.tokens.tolist(), "tau": res.tau, "verify_kernels": kernels}
    if mesh is not None:
        out["target_params"] = shard_shapes(sharding.shard_target(target, mesh).params)
        out["drafter_params"] = shard_shapes(sharding.shard_drafter(drafter, mesh).params)
        out["forward_cache"] = shard_shapes(cache)
        out.update(round_layouts(target, drafter, mesh, attention_impl))
    return out


def attention_errors() -> list[float]:
    """Largest difference between the interpreted kernel inside `kernels.shard_attention` and the
    unsharded XLA `attention`, per `ATTENTION_SHAPES` entry (random fp32 operands)."""
    errors = []
    for num_heads, num_kv, tp, dp, split_heads in ATTENTION_SHAPES:
        k1, k2, k3, k4 = jax.random.split(jax.random.key(num_heads * 100 + tp * 10 + dp), 4)
        batch, num_q, slots, head_dim = 4, 5, 24, 16
        q = jax.random.normal(k1, (batch, num_q, num_heads, head_dim))
        k, v = (jax.random.normal(key, (batch, num_kv, slots, head_dim)) for key in (k2, k3))
        lengths = jnp.asarray([3, 0, 10, 7], jnp.int32)
        mask = jax.random.bernoulli(k4, 0.5, (batch, num_q, num_q)) | jnp.eye(num_q, dtype=bool)
        kernel = attention_fn("interpret", sharding.make_mesh(tp, dp), split_heads=split_heads)
        out = jax.jit(functools.partial(kernel, scale=0.25))(q, k, v, lengths, mask)
        errors.append(float(jnp.abs(out - attention(q, k, v, lengths, mask, scale=0.25)).max()))
    return errors


def batch_policy(mesh=None) -> dict:
    """Tokens of the MoE model "e" under the batch-global budget policy (packed verify rows) with the
    target over ``mesh`` (``None``: unsharded), and the error of the same run over a ``dp = 2`` mesh."""
    target, drafter = tiny_models("e")
    # A request may keep up to BATCH_SPREAD x budget drafts: the cache needs more than GENERATE's max_len.
    kw = dict(SAMPLING, **dict(GENERATE, max_len=None), key=jax.random.key(KEY_SEED), budget_policy="batch")
    out = {"tokens": engine.generate(target, drafter, PROMPTS, **kw, mesh=mesh).tokens.tolist()}
    if mesh is not None:
        try:
            engine.generate(target, drafter, PROMPTS, **kw, mesh=sharding.make_mesh(2, 2))
        except ValueError as err:
            out["dp_error"] = str(err)
    return out


def draft_vocab(mesh=None) -> dict:
    """Tokens of model "a" (untied head, vocabulary split over tp) whose drafter drafts from 5 of the 8 tokens,
    the target over ``mesh`` (``None``: unsharded)."""
    target, drafter = tiny_models("a")
    small = with_draft_vocab(drafter, target, [0, 2, 3, 5, 6])
    res = engine.generate(target, small, PROMPTS, **SAMPLING, **GENERATE, key=jax.random.key(KEY_SEED), mesh=mesh)
    return {"tokens": res.tokens.tolist(), "tau": res.tau}


def main(path: str, cases: list[str]) -> None:
    if jax.device_count() != 8:
        raise SystemExit(f"sharded_check needs 8 devices (XLA_FLAGS), got {jax.device_count()}")
    results = {}
    for case in cases:
        if case == "attention":
            results[case] = attention_errors()
            continue
        if case == "batch_policy":
            results[case] = batch_policy(sharding.make_mesh(4, 1))
            continue
        if case == "draft_vocab":
            results[case] = draft_vocab(sharding.make_mesh(4, 2))
            continue
        model, tp, dp, *impl = case.split(":")
        results[case] = run_case(model, sharding.make_mesh(int(tp), int(dp)), *impl)
    try:
        engine.generate(*tiny_models("a"), PROMPTS[:3], mesh=sharding.make_mesh(2, 2))
    except ValueError as err:
        results["odd_batch_error"] = str(err)
    with open(path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
