"""End-to-end benchmark: where a DDTree round's time goes, against plain decoding and the HBM roofline.

Part 1 (``--shapes qwen3-8b``): a Qwen3-8B-shaped target and a 5-layer DFlash-shaped drafter with
random bf16 weights, per batch and context: one AR decode step (the engine's AR round), one whole
DDTree round per budget, and each part of the round run alone under jit on the same inputs (drafter
forward, tree build + encoding, verify forward, verification/sampling, commit). Caches are
zero-filled to the given context length: a round's cost does not depend on the cached values.
``--mesh-check`` also times the round under a one-device ``("dp", "tp")`` mesh next to the same
round without one (both on the XLA attention path, which XLA partitions itself). ``--build-check``
also times each round back to back with the XLA tree build, next to the one ``--build-impl`` chose.
``--profile``
traces the decode step and each budget's round and sums their device ops by kind (matmuls,
the Pallas kernels, data movement, the rest; `ddtree_jax.experiments.profiling`) and by the round's
step (drafter, tree build, encodings, verify forward, sampling, commit, statistics: `engine.ROUND_PARTS`).
Part 2 (``--embedded``): tokens/s and tau of AR, chain and DDTree (each of ``--embedded-budgets``) on
the embedded pair, with the speedup over AR measured in the same process. Part 3 (``--generate``):
``generate()`` end to end at part 1's shapes next to the jitted round, so the host's share of a round is a
number. Part 4 (``--prefill``): the prefill of each batch and context against its matmul-FLOP roofline.

Every timing is the median of ``--repeats`` warm calls ending in ``block_until_ready``; the first
call of the decode step and of each round (compilation included) is recorded apart. The JSON is
rewritten after every row, so an interrupted run keeps what it measured.

Each part is timed as a program of its own, so the parts need not add up to the round: inside the
round XLA fuses across part boundaries and updates the donated caches in place, while a part alone
returns fresh arrays (the verify forward and the commit a whole new cache). On a CPU, where large
programs are scheduled differently and the machine's other load shifts single timings, a part can
even take longer than the whole round; read the parts as each step's cost in isolation.

Every call from Python also pays a dispatch (0.3 ms on the H200 host), which a round inside
`generate`'s device loop does not. So the decode step and the round are also timed ``back to back``:
`LOOP_STEPS` calls queued without waiting (the state threaded through), one synchronize at the end,
per call; the same executable as the one-call timing, so nothing compiles twice. (On the H200 this
came within 1-6% below 10 rounds in one jitted ``lax.fori_loop``, the loop never faster.) The tree
build and the sampler last less than a dispatch, so queued calls would time the host: they are timed
``in a loop``, `LOOP_STEPS` of them in one jitted ``lax.fori_loop`` over two alternating inputs (so
that nothing is hoisted), per step. So is the drafter (``drafter_in_loop``, its cache threaded through the
loop with its lengths reset each step), the measure of its own device time. The share of build +
sampling in a round (``core_share``) is taken from these and the round back to back.

The HBM roofline of each (batch, context) (the weights and the committed KV cache each step must
read once, at ``--hbm-tbps``) is reported on accelerators only; on a CPU it is n/a.

Part 1's rounds also become a cost table for the device (`ddtree_jax.costs`, the model of the
adaptive budget policy): ``<out stem>_costs.json`` next to the JSON (`write_cost_table`).

``--shapes`` also sets the unset knobs: the model shapes run the full grid (``FULL``), ``--shapes
tiny`` a small one (``TINY``: batch 1, one short context, one small budget, a few repeats) that
ends in seconds on a CPU.

    ddtree bench --out bench_e2e.json    # the full benchmark (GPU)
    ddtree bench --shapes tiny           # a quick check anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import checks, costs, engine, kernels, sharding
from ddtree_jax.draft_vocab import with_frequent_tokens
from ddtree_jax.experiments import profiling
from ddtree_jax.experiments.flags import int_list
from ddtree_jax.experiments.provenance import command_line
from ddtree_jax.models import (
    DFlashConfig, KVCache, Qwen3Config, Qwen3MoeConfig, commit, drafter_forward, init_cache, init_drafter, init_target,
    target_forward, with_draft_vocab,
)
from ddtree_jax.sampling import coins_from_keys, request_keys
from ddtree_jax.tree import tree_attention_mask, tree_positions

SHAPES = {
    "qwen3-8b": dict(
        target=dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072),
        drafter=dict(num_hidden_layers=5, block_size=16, target_layer_ids=(1, 9, 17, 25, 33))),
    "qwen3-32b": dict(
        target=dict(vocab_size=151_936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072),
        drafter=dict(num_hidden_layers=5, block_size=16, target_layer_ids=(1, 16, 31, 46, 61))),
    "tiny": dict(  # 8 query heads so that tensor parallelism up to 8 applies
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=8192),
        drafter=dict(num_hidden_layers=1, block_size=8, target_layer_ids=(0, 3))),
    # Qwen3-MoE shapes (a target with "num_experts" is a Qwen3MoeConfig; experiments/bench_moe.py studies them)
    "qwen3-30b-a3b": dict(
        target=dict(vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=131072,
                    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        drafter=dict(num_hidden_layers=5, block_size=16, target_layer_ids=(1, 12, 23, 34, 45))),
    "tiny-moe": dict(  # layer 0 dense, 16 experts: expert parallelism up to 8 applies
        target=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=8192,
                    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                    mlp_only_layers=(0,)),
        drafter=dict(num_hidden_layers=1, block_size=8, target_layer_ids=(0, 3))),
}


# The round's own steps besides the forwards (`engine.ROUND_PARTS`): the tree build, its encodings, the
# sampling. Their share of the round is `core_share` (timed in loops) and `profiled_core_share` (traced).
CORE_PARTS = ("build", "encode", "sample")

# The knobs ``--shapes`` sets unless they are given (part 1's batches, contexts, budgets and repeats;
# part 2's batches, budgets and new tokens).
FULL = dict(batches=[1, 8], contexts=[1024, 8192], budgets=[16, 64, 256, 512], repeats=20, embedded_batches=[1, 8],
            embedded_budgets=[16, 64], new_tokens=128)
TINY = dict(batches=[1], contexts=[64], budgets=[8], repeats=3, embedded_batches=[1], embedded_budgets=[8],
            new_tokens=16)


def median_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` warm calls (``block_until_ready``)."""
    return float(np.median(interleaved_ms({"fn": fn}, repeats)["fn"]))


def interleaved_ms(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times in ms of each ``fns[name]()`` (``block_until_ready``), ``repeats`` rounds that call
    every function once in turn after one warm call each, so that a drift of the machine (clocks,
    other load) falls on all of them alike: ``{name: [ms of round 0, ...]}``."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1e3 * (time.perf_counter() - start))
    return times


def first_call_s(fn) -> float:
    """Seconds of the first call of ``fn()`` (compilation included), to ``block_until_ready``."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


LOOP_STEPS = 10  # calls per timing in the back-to-back and in-loop timings


def nudge(x: jax.Array) -> jax.Array:
    """``x`` with its first element increased by one. Threaded through a loop's carry, it is a new input
    at every step for the cost of one element written in place, so nothing computed from it is hoisted out
    of the loop (only the carry's first value is copied, once a loop); a slice of stacked inputs would
    copy a whole input a step, 40 MB for the float32 logits of a 65-row round at V = 151,936."""
    return x.at[(0,) * x.ndim].add(jnp.ones((), x.dtype))


def checksum(tree) -> jax.Array:
    """A float32 sum over every leaf of ``tree``: keeps all of a computation's outputs alive in a loop."""
    return sum(leaf.sum(dtype=jnp.float32) for leaf in jax.tree.leaves(tree))


def loop_ms(body, operands, init, repeats: int, steps: int = LOOP_STEPS) -> float:
    """Median ms per step of ``carry = body(operands, i, carry)`` run ``steps`` times in one jitted
    ``lax.fori_loop`` (no dispatch between steps, as inside a round or `generate`'s device loop).
    ``operands`` (models, stacked inputs) are arguments of the call, never baked-in constants."""
    run = jax.jit(lambda ops, carry: jax.lax.fori_loop(0, steps, functools.partial(body, ops), carry))
    return median_ms(lambda: run(operands, init), repeats) / steps


def nudged_loop_ms(fn, operands, x, repeats: int, steps: int = LOOP_STEPS) -> float:
    """`loop_ms` of ``fn(operands, x)``, with ``x`` threaded through the loop's carry and `nudge`d a step."""
    def body(ops, i, carry):
        acc, x = carry
        x = nudge(x)
        return acc + checksum(fn(ops, x)), x
    return loop_ms(body, operands, (jnp.float32(0), x), repeats, steps)


def back_to_back_ms(fn, repeats: int, steps: int = LOOP_STEPS) -> float:
    """Median ms per call of ``steps`` calls of ``fn()`` queued without waiting, then one
    ``block_until_ready`` (a warm call first): for calls longer than their dispatch, the device's
    time per call with no gap between calls."""
    def run():
        for _ in range(steps - 1):
            fn()
        return fn()

    return median_ms(run, repeats) / steps


def weight_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))


def drafter_config(target_config, **fields) -> DFlashConfig:
    """A DFlash config that fits ``target_config``: its layer fields (vocabulary, widths, heads, RoPE
    theta), the last token id as the mask token, and ``fields`` for the rest (``num_hidden_layers``,
    ``block_size``, ``target_layer_ids``)."""
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "rope_theta")
    return DFlashConfig(**{name: getattr(target_config, name) for name in shared},
                        mask_token_id=target_config.vocab_size - 1,
                        num_target_layers=target_config.num_hidden_layers, **fields)


def make_models(shapes: str, draft_vocab: int = 0):
    """Target and drafter of the named shapes with random weights (bf16 off the CPU); with ``draft_vocab``
    W > 0, the drafter drafts from the W lowest token ids (`dflash.with_draft_vocab`; with random weights
    which W ids does not change a time)."""
    s = SHAPES[shapes]
    t = s["target"]
    config = (Qwen3MoeConfig if "num_experts" in t else Qwen3Config)(**t)
    dc = drafter_config(config, **s["drafter"])
    target, drafter = init_target(config, jax.random.key(0)), init_drafter(dc, jax.random.key(1))
    return target, with_draft_vocab(drafter, target, np.arange(draft_vocab) if draft_vocab else None)


def make_state(target, drafter, spec, batch, context, max_new=4096) -> engine.DecodeState:
    """A decode state whose caches hold ``context`` committed (zero) slots per request."""
    tc, dc = target.config, drafter.config
    max_len = context + max_new + spec.num_nodes + spec.depth + 1
    dtype = target.dtype

    def cache(cfg, layers):
        c = init_cache(layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype)
        return KVCache(c.k, c.v, jnp.full((batch,), context, jnp.int32))

    feats = len(dc.target_layer_ids) * tc.hidden_size if spec.method != "ar" else 0
    return engine.DecodeState(
        target_cache=cache(tc, tc.num_hidden_layers),
        drafter_cache=cache(dc, dc.num_hidden_layers) if spec.method != "ar" else None,
        root=jnp.zeros((batch,), jnp.int32),
        ctx_feats=jnp.zeros((batch, spec.depth + 1, feats), dtype),
        ctx_count=jnp.full((batch,), min(4, spec.depth + 1), jnp.int32),
        tokens=jnp.full((batch, max_new + spec.depth + 1), -1, jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        round=jnp.zeros((), jnp.int32),
    )


def constant_sampling(batch: int, temperature: float, top_k: int, top_p: float) -> engine.SamplingParams:
    """The same temperature, top-k and top-p for every request of the batch."""
    return engine.SamplingParams(jnp.full((batch,), temperature, jnp.float32), jnp.full((batch,), top_k, jnp.int32),
                                 jnp.full((batch,), top_p, jnp.float32))


def shard_models(target, drafter, mesh):
    """The target and drafter placed on ``mesh`` (`sharding.shard_target`, `sharding.shard_drafter`),
    once per mesh: `time_round` takes them as they are."""
    return sharding.shard_target(target, mesh), sharding.shard_drafter(drafter, mesh)


def time_round(target, drafter, spec, state, sampling, repeats, mesh=None) -> float:
    """Median ms of the engine's whole round, the state threaded through as ``generate`` does.

    With a ``mesh``, ``target`` and ``drafter`` must already be placed on it (`shard_models`); the
    state is placed here.
    """
    return median_ms(round_runner(target, drafter, spec, state, sampling, mesh), repeats)


def round_args(batch: int, sampling) -> tuple:
    """The arguments of `engine.decode_round` after the state, as the benchmarks pass them: ``sampling``,
    key 0, request ids ``0..batch-1``, draft temperature 1 and no stop token."""
    return (sampling, jax.random.key(0), jnp.arange(batch, dtype=jnp.int32), jnp.float32(1.0),
            jnp.array([-2], jnp.int32))


def round_runner(target, drafter, spec, state, sampling, mesh=None, with_expected=False):
    """A function that runs the engine's round once per call, threading the state through (see
    `time_round`); ``with_expected``: the round also computes the exact expected acceptance, as
    ``generate`` does by default. Its ``hlo()`` is the round's optimized HLO text (for reading a profile's
    op names)."""
    if mesh is not None:
        state = jax.device_put(state, sharding.state_shardings(state, mesh))
    args = round_args(state.root.shape[0], sampling)
    step = functools.partial(engine.decode_round, spec=spec, max_new_tokens=10**6, with_expected=with_expected,
                             mesh=mesh)
    box = [state]
    drafter = drafter if spec.method != "ar" else None

    def run():
        box[0], out = step(target, drafter, box[0], *args)
        return out

    run.hlo = lambda: step.func.lower(target, drafter, box[0], *args, **step.keywords).compile().as_text()
    return run


def time_parts(target, drafter, spec, state, sampling, repeats) -> dict[str, float]:
    """Each step of a DDTree round alone, under jit, on the same inputs as the round."""
    batch = state.root.shape[0]
    lengths = state.target_cache.lengths
    ctx_pos = (lengths - state.ctx_count)[:, None] + jnp.arange(state.ctx_feats.shape[1])[None, :]
    impls = dict(attention_impl=spec.attention_impl, matmul_impl=spec.matmul_impl)
    draft = jax.jit(functools.partial(drafter_forward, **impls))
    draft_args = (drafter, target, state.drafter_cache, state.ctx_feats, ctx_pos, state.ctx_count, state.root,
                  lengths)
    draft_logits = draft(*draft_args)[0]

    @jax.jit
    def build(draft_logits, root):
        tree = kernels.tree_build_fn(spec.build_impl)(draft_logits, root, jnp.float32(1.0), budget=spec.budget,
                                                      topk_cap=spec.topk_cap)
        return tree, tree_attention_mask(tree), tree_positions(tree, lengths)

    tree, mask, positions = build(draft_logits, state.root)
    fwd = jax.jit(functools.partial(target_forward, tap_layers=spec.tap_layers, **impls))
    logits, taps, cache = fwd(target, tree.tokens, positions, mask, state.target_cache)

    @jax.jit
    def sample(tree, logits):
        coins, final = coins_from_keys(request_keys(jax.random.key(0), jnp.arange(batch), 0), logits.shape[1])
        return kernels.sampler_fn(spec.sampler_impl)(tree, logits, coins, final, sampling.temperature,
                                                  sampling.top_k, sampling.top_p)

    res = sample(tree, logits)

    @jax.jit
    def keep(cache, taps, accept_index, num_accepted):
        rows = jnp.arange(taps.shape[0])[:, None]
        return commit(cache, accept_index, num_accepted + 1), taps[rows, jnp.maximum(accept_index, 0)]

    # The drafter, the build and the sampler in a loop, each input threaded through the carry and nudged a step
    def draft_step(ops, i, carry):  # the cache threaded through (written in place), its lengths reset
        acc, cache, feats = carry
        feats = nudge(feats)
        out, cache = draft(ops[0], ops[1], cache, feats, *ops[2:])
        return acc + checksum(out), dataclasses.replace(cache, lengths=state.drafter_cache.lengths), feats

    return dict(
        drafter_ms=median_ms(lambda: draft(*draft_args)[0], repeats),
        drafter_in_loop_ms=loop_ms(draft_step, (drafter, target, *draft_args[4:]),
                                   (jnp.float32(0), state.drafter_cache, state.ctx_feats), repeats),
        tree_ms=median_ms(lambda: build(draft_logits, state.root), repeats),
        verify_forward_ms=median_ms(lambda: fwd(target, tree.tokens, positions, mask, state.target_cache)[0],
                                    repeats),
        sampling_ms=median_ms(lambda: sample(tree, logits), repeats),
        commit_ms=median_ms(lambda: keep(cache, taps, res.accept_index, res.num_accepted), repeats),
        tree_in_loop_ms=nudged_loop_ms(lambda root, drafts: build(drafts, root), state.root, draft_logits, repeats),
        sampling_in_loop_ms=nudged_loop_ms(sample, tree, logits, repeats),
    )


def streamed_bytes(target) -> int:
    """Bytes of the target weights a forward reads in full: every layer, the final norm and the
    LM head (the embedding when tied); the embedding table itself is only gathered."""
    p = target.params
    return weight_bytes((p.layers, p.final_norm, p.embed if p.lm_head is None else p.lm_head))


def cache_bytes(model, batch: int, context: int) -> int:
    """Bytes of the keys and values of ``context`` committed tokens of ``batch`` requests in ``model``'s
    KV cache (every layer), which a step's attention reads once."""
    cfg = model.config
    return (2 * batch * context * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
            * jnp.dtype(model.dtype).itemsize)


def rooflines(target, drafter, hbm_bytes_per_s: float, batch: int, context: int) -> tuple[float, float]:
    """(decode step, DDTree round) HBM floors in ms at ``batch`` requests of ``context`` committed
    tokens: the weights and KV caches each must read once (the round adds the drafter's weights and
    context cache and a second pass over the LM head, or the drafter's own head over a draft vocabulary,
    which its weights hold)."""
    p = target.params
    head_bytes = 0 if drafter.params.draft_head is not None else weight_bytes(p.embed if p.lm_head is None
                                                                              else p.lm_head)
    decode = 1e3 * (streamed_bytes(target) + cache_bytes(target, batch, context)) / hbm_bytes_per_s
    drafter_bytes = weight_bytes(drafter.params) + head_bytes + cache_bytes(drafter, batch, context)
    return decode, decode + 1e3 * drafter_bytes / hbm_bytes_per_s


def bench_shapes(args, emit) -> None:
    """Part 1: calls ``emit(row)`` per (batch, context, budget)."""
    target, drafter = make_models(args.shapes, args.draft_vocab)
    on_cpu = jax.default_backend() == "cpu"  # no HBM: a bandwidth floor means nothing there
    if on_cpu:
        print("roofline n/a on a CPU", flush=True)
    impls = kernel_impls(args)
    rows, total = 0, len(args.batches) * len(args.contexts) * len(args.budgets)
    for batch in args.batches:
        sampling = constant_sampling(batch, args.temperature, args.top_k, args.top_p)
        for context in args.contexts:
            ar = engine.make_spec(target, None, "ar", 1, None, **impls)
            decode = round_runner(target, drafter, ar, make_state(target, drafter, ar, batch, context), sampling,
                                  with_expected=args.with_expected)
            decode_first_s = first_call_s(decode)
            decode_ms = median_ms(decode, args.repeats)
            decode_b2b_ms = back_to_back_ms(decode, args.repeats)
            decode_floor, round_floor = (None, None) if on_cpu else rooflines(target, drafter, args.hbm_tbps * 1e12,
                                                                               batch, context)
            roofline = (f"{decode_b2b_ms / decode_floor:.2f}x its {decode_floor:.2f} ms roofline back to back, DDTree "
                        f"round floor {round_floor:.2f} ms; " if decode_floor else "")
            print(f"batch {batch} context {context}: decode step {decode_ms:.2f} ms a call, {decode_b2b_ms:.2f} ms "
                  f"back to back ({roofline}first call {decode_first_s:.1f} s)", flush=True)
            decode_device_ms = None  # the decode step's, traced with the first budget's round
            for budget in args.budgets:
                rows += 1
                print(f"  [{rows}/{total}] B={budget}: compiling and timing the parts and the round ...", flush=True)
                spec = engine.make_spec(target, drafter, "ddtree", budget, args.topk_cap or None, **impls)
                state = make_state(target, drafter, spec, batch, context)
                parts = time_parts(target, drafter, spec, state, sampling, args.repeats)
                run = round_runner(target, drafter, spec, state, sampling, with_expected=args.with_expected)
                round_first_s = first_call_s(run)
                round_ms = median_ms(run, args.repeats)
                round_b2b_ms = back_to_back_ms(run, args.repeats)
                row = dict(batch=batch, context=context, budget=budget, draft_vocab=args.draft_vocab,
                           attention_impl=spec.attention_impl,
                           sampler_impl=spec.sampler_impl, build_impl=spec.build_impl, decode_ms=decode_ms,
                           round_ms=round_ms,
                           decode_back_to_back_ms=decode_b2b_ms, round_back_to_back_ms=round_b2b_ms,
                           decode_roofline_ms=decode_floor, round_floor_ms=round_floor, **parts,
                           decode_first_call_s=decode_first_s, round_first_call_s=round_first_s)
                row["round_over_decode"] = round_ms / decode_ms  # = the break-even tau
                row["parts_sum_ms"] = sum(v for k, v in parts.items() if "in_loop" not in k)  # each alone
                row["core_share"] = (parts["tree_in_loop_ms"] + parts["sampling_in_loop_ms"]) / round_b2b_ms
                if args.profile:
                    programs = [("decode", decode)] if budget == args.budgets[0] else []
                    decode_device_ms = profile_programs(args, row, [*programs, ("round", run)],
                                                        f"b{batch}_c{context}_B{budget}", decode_device_ms)
                if args.build_check and spec.build_impl != "xla":
                    xla_build = dataclasses.replace(spec, build_impl="xla")
                    row["round_xla_build_back_to_back_ms"] = back_to_back_ms(
                        round_runner(target, drafter, xla_build, make_state(target, drafter, xla_build, batch, context),
                                     sampling, with_expected=args.with_expected), args.repeats)
                    print(f"  B={budget:4d}: round back to back {round_b2b_ms:.2f} ms, with the XLA tree build "
                          f"{row['round_xla_build_back_to_back_ms']:.2f} ms", flush=True)
                if args.draft_vocab:  # the same round with the whole vocabulary, in this process
                    full = with_draft_vocab(drafter, target, None)
                    row["round_full_vocab_back_to_back_ms"] = back_to_back_ms(
                        round_runner(target, full, spec, make_state(target, full, spec, batch, context), sampling,
                                     with_expected=args.with_expected), args.repeats)
                    print(f"  B={budget:4d}: round back to back {round_b2b_ms:.2f} ms drafting from "
                          f"{args.draft_vocab} tokens, {row['round_full_vocab_back_to_back_ms']:.2f} ms from all "
                          f"{target.config.vocab_size}", flush=True)
                if args.mesh_check and budget == args.budgets[0]:
                    xla = engine.make_spec(target, drafter, "ddtree", budget, args.topk_cap or None, "xla",
                                           args.sampler_impl)
                    row["round_xla_ms"] = time_round(target, drafter, xla, make_state(target, drafter, xla, batch,
                                                                                      context), sampling, args.repeats)
                    mesh = sharding.make_mesh(1, 1)
                    row["round_mesh1_ms"] = time_round(*shard_models(target, drafter, mesh), xla,
                                                       make_state(target, drafter, xla, batch, context), sampling,
                                                       args.repeats, mesh=mesh)
                print(f"  B={budget:4d}: round {round_ms:7.2f} ms = {row['round_over_decode']:.2f} decode steps | "
                      + " ".join(f"{k[:-3]} {v:.2f}" for k, v in parts.items() if "in_loop" not in k)
                      + f" (sum {row['parts_sum_ms']:.2f}, each alone) | back to back: round {round_b2b_ms:.2f}, "
                      + f"in a loop: drafter {parts['drafter_in_loop_ms']:.3f}, build "
                      + f"{parts['tree_in_loop_ms']:.3f}, sampling {parts['sampling_in_loop_ms']:.3f} = "
                      + f"{100 * row['core_share']:.1f}% of the round"
                      + f" | first call {round_first_s:.1f} s"
                      + (f" | mesh(1,1) {row['round_mesh1_ms']:.2f} vs {row['round_xla_ms']:.2f} ms"
                         if "round_mesh1_ms" in row else ""), flush=True)
                emit(row)


def profile_programs(args, row, programs, tag: str, decode_device_ms: float | None = None) -> float | None:
    """``--profile``: trace each ``(name, runner)`` of ``programs`` (`round_runner`s), summed by kind and by
    the round's step, into ``row["profile_<name>"]`` (the round's also into ``profiled_core_share`` and, with
    the decode step's device time, ``decode_device_ms``, from this call's ``"decode"`` program or the argument,
    into ``verify_device_ms`` and ``verify_over_decode_device``: the verify forward's device time over the
    decode step's); with ``--hlo`` write each one's optimized HLO next to the JSON, named after ``tag``.
    Returns the decode step's device time (``None`` where not traced)."""
    for name, runner in programs:
        try:  # a diagnostic: a trace that cannot be read must not cost the timed rows
            hlo = runner.hlo()
            row[f"profile_{name}"] = summary = profiling.device_op_times(
                runner, calls=3, top=args.profile_ops, parts=profiling.scope_parts(hlo, engine.ROUND_PARTS))
        except Exception as e:  # noqa: BLE001
            row[f"profile_{name}_error"] = repr(e)
            print(f"  profile of the {name} failed: {e!r}", flush=True)
            continue
        print(f"  profile of the {name} ({tag}):\n" + profiling.format_summary(summary), flush=True)
        if name == "decode":
            decode_device_ms = profiling.part_ms(summary)
        if name == "round":
            share, verify_ms = profiling.part_share(summary, CORE_PARTS), profiling.part_ms(summary, ("verify",))
            if share is not None:
                row["profiled_core_share"] = share
                print(f"  tree build + encoding + sampling: {100 * share:.1f}% of the round's device time", flush=True)
            if verify_ms and decode_device_ms:
                row.update(decode_device_ms=decode_device_ms, verify_device_ms=verify_ms,
                           verify_over_decode_device=verify_ms / decode_device_ms)
                print(f"  verify forward: {verify_ms:.3f} ms of device time = {verify_ms / decode_device_ms:.3f}x "
                      f"the decode step's {decode_device_ms:.3f} ms", flush=True)
        if args.hlo:
            path = args.out.with_name(f"{args.out.stem}_{name}_{tag}.hlo.txt")
            path.write_text(hlo)
            print(f"  wrote {path}", flush=True)
    return decode_device_ms


def prefill_flops(target, batch: int, length: int) -> float:
    """Matmul FLOPs of a causal prefill of ``length`` tokens: 2 per weight of every matrix a token goes
    through (of a MoE layer's stacked experts, the ``num_experts_per_tok`` it is routed to; the norms'
    vectors are no products) plus the causal half of the attention's scores and values. No LM head: the
    engine's prefill computes no logits (the last prompt token is the first round's root)."""
    cfg, p = target.config, target.params
    per_token = 0.0
    for leaf in jax.tree_util.tree_leaves(p.layers):
        if leaf.ndim == 2:
            per_token += leaf.size
        elif leaf.ndim == 3:  # experts stacked on the first axis
            per_token += leaf.size / leaf.shape[0] * cfg.num_experts_per_tok
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * length * length / 2
    return batch * (2 * per_token * length + attention)


def bench_generate(args, emit) -> None:
    """Part 3: ``generate()`` end to end, as a user calls it, next to the jitted round alone, at the
    shapes of part 1 (random weights: every round emits one token). Per batch, context (the prompt
    length) and method: the per-round wall time of ``generate`` (its rounds' time over the rounds),
    tokens/s, the time to the first streamed token (prefill and first round, warm), the jitted round
    alone and their ratio."""
    target, drafter = make_models(args.shapes, args.draft_vocab)
    impls = kernel_impls(args)
    methods = [("ar", 1), ("chain", 1)] + [("ddtree", b) for b in args.budgets]
    for batch in args.batches:
        sampling = constant_sampling(batch, args.temperature, args.top_k, args.top_p)
        for context in args.contexts:
            prompts = random_prompts(target, batch, context)
            for method, budget in methods:
                run = functools.partial(engine.generate, target, drafter, prompts, method=method, budget=budget,
                                        topk_cap=args.topk_cap or None, temperature=args.temperature,
                                        top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.new_tokens,
                                        with_expected=args.with_expected, **impls)
                run()  # compiles
                streamed = []
                start = time.perf_counter()
                res = run(on_round=lambda *_, seen=streamed: seen.append(time.perf_counter()))
                first_token_ms = 1e3 * (streamed[0] - start)
                generate_round_ms = 1e3 * res.seconds / len(res.rounds)
                spec = engine.make_spec(target, drafter, method, budget, args.topk_cap or None, **impls)
                state = make_state(target, drafter, spec, batch, context, max_new=args.new_tokens)
                round_ms = median_ms(round_runner(target, drafter, spec, state, sampling,
                                                  with_expected=args.with_expected), args.repeats)
                row = dict(batch=batch, context=context, method=method, budget=budget, rounds=len(res.rounds),
                           generate_round_ms=generate_round_ms, jitted_round_ms=round_ms,
                           overhead=generate_round_ms / round_ms, tokens_per_s=res.tokens_per_s,
                           first_token_ms=first_token_ms)
                emit(row)
                print(f"  {method:>6} B={budget:<4d} generate {generate_round_ms:6.2f} ms per round vs the jitted "
                      f"round {round_ms:6.2f} ms ({row['overhead']:.3f}x) | {res.tokens_per_s:7.1f} tokens/s | "
                      f"first token {first_token_ms:.1f} ms", flush=True)


def bench_prefill(args, emit) -> None:
    """Part 4: the engine's prefill of a prompt of each context's length (the target's KV cache and the
    drafter's context of every prompt token) at the shapes of part 1, per batch and context, against its
    matmul FLOPs (`prefill_flops`) at ``--peak-tflops`` (accelerators only) and at the rate XLA's product
    of the target's widest matrix reaches over the same rows in the same process (`gemm_tflops`); with
    ``--profile`` its device ops summed by kind."""
    target, drafter = make_models(args.shapes, args.draft_vocab)
    impls = kernel_impls(args)
    widest = max((x for x in jax.tree_util.tree_leaves(target.params.layers[0]) if x.ndim == 2), key=lambda x: x.size)
    for batch in args.batches:
        for context in args.contexts:
            run = prefill_runner(target, drafter, random_prompts(target, batch, context), impls)
            ms = median_ms(run, args.repeats)
            flops = prefill_flops(target, batch, context)
            gemm = gemm_tflops(batch * context, *widest.shape, target.dtype, args.repeats)
            tflops = flops / ms / 1e9
            roofline_ms = None if jax.default_backend() == "cpu" else 1e3 * flops / (args.peak_tflops * 1e12)
            over_roofline = None if roofline_ms is None else ms / roofline_ms
            row = dict(batch=batch, context=context, prefill_ms=ms, tflop=flops / 1e12, tflops=tflops,
                       roofline_ms=roofline_ms, over_roofline=over_roofline,
                       gemm_shape=[batch * context, *widest.shape], gemm_tflops=gemm, over_gemm=gemm / tflops)
            floor = ("roofline n/a on a CPU" if roofline_ms is None else
                     f"{over_roofline:.2f}x its {roofline_ms:.2f} ms at {args.peak_tflops:.0f} TFLOP/s")
            print(f"batch {batch} context {context}: prefill {ms:.2f} ms = {row['tflops']:.1f} TFLOP/s "
                  f"({row['tflop']:.2f} TFLOP; {floor}; {row['over_gemm']:.2f}x its time at the {gemm:.1f} TFLOP/s "
                  f"of a {' x '.join(map(str, row['gemm_shape']))} product)", flush=True)
            if args.profile:
                row["profile"] = summary = profiling.device_op_times(run, calls=2, top=args.profile_ops)
                print("  profile of the prefill:\n" + profiling.format_summary(summary), flush=True)
            emit(row)


def gemm_tflops(rows: int, k: int, n: int, dtype, repeats: int) -> float:
    """TFLOP/s of XLA's product of a random (rows, k) and (k, n) matrix in ``dtype``, median of ``repeats``."""
    a_MK = jax.random.normal(jax.random.key(0), (rows, k), dtype)
    b_KN = jax.random.normal(jax.random.key(1), (k, n), dtype)
    product = jax.jit(jnp.matmul)
    return 2 * rows * k * n / median_ms(lambda: product(a_MK, b_KN), repeats) / 1e9


def kernel_impls(args) -> dict:
    """The ``*_impl`` flags as `engine.generate` / `engine.make_spec` keyword arguments."""
    return dict(attention_impl=args.attention_impl, sampler_impl=args.sampler_impl, matmul_impl=args.matmul_impl,
                build_impl=args.build_impl)


def random_prompts(target, batch: int, context: int) -> list[list[int]]:
    """``batch`` prompts of ``context`` random token ids (seed 0)."""
    return np.random.default_rng(0).integers(0, target.config.vocab_size, (batch, context)).tolist()


def prefill_runner(target, drafter, prompts, impls):
    """A call of the engine's jitted prefill of ``prompts`` (target cache and drafter context) that
    returns the state's root to block on."""
    spec = engine.make_spec(target, drafter, "ddtree", 16, None, **impls)
    prompt_BT, lengths_B = jnp.asarray(prompts, jnp.int32), jnp.full((len(prompts),), len(prompts[0]), jnp.int32)
    fn = functools.partial(engine.prefill, target, drafter, prompt_BT, lengths_B, spec=spec,
                           max_len=prompt_BT.shape[1] + 64, max_new_tokens=32)
    return lambda: fn().root


def bench_embedded(args, emit) -> None:
    """Part 2: AR, chain and DDTree (each of ``--embedded-budgets``, with ``--topk-cap``) on the embedded
    pair, each run twice and the second timed; calls ``emit(row)`` per run."""
    from ddtree_jax.assets import DRAFTER_DIR, TARGET_DIR
    from ddtree_jax.checkpoint import load_drafter, load_target
    from ddtree_jax.experiments import corpus
    from ddtree_jax.tokenizer import Tokenizer

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    target, drafter = load_target(TARGET_DIR, dtype), load_drafter(DRAFTER_DIR, dtype)
    drafter = with_frequent_tokens(drafter, target, TARGET_DIR, args.draft_vocab)
    tokenizer = Tokenizer.from_file(TARGET_DIR / "tokenizer.json")
    prompts = corpus.heldout_prompts(tokenizer, max(args.embedded_batches), 64, seed=0)
    for batch in args.embedded_batches:
        for temperature in (0.0, 1.0):
            base = None
            for method, budget in (("ar", 1), ("chain", 1), *(("ddtree", b) for b in args.embedded_budgets)):
                generate = functools.partial(
                    engine.generate, target, drafter, prompts[:batch], method=method, budget=budget,
                    topk_cap=args.topk_cap or None if method == "ddtree" else None,
                    temperature=temperature, draft_temperature=args.draft_temperature, with_expected=False,
                    attention_impl=args.attention_impl, sampler_impl=args.sampler_impl, build_impl=args.build_impl)
                # generate times its rounds, not the compilation, but a first run can still be slow (on an
                # H200 the first AR run of a process, batch 8: 10.7k tokens/s, 16.7k in another), so the second
                generate(max_new_tokens=args.new_tokens)
                res = generate(max_new_tokens=args.new_tokens)
                base = base or res.tokens_per_s
                emit(dict(batch=batch, temperature=temperature, draft_temperature=args.draft_temperature,
                          draft_vocab=args.draft_vocab, method=method, budget=budget, tau=res.tau,
                          acceptance_length=res.acceptance_length, tokens_per_s=res.tokens_per_s,
                          speedup_over_ar=res.tokens_per_s / base))
                print(f"embedded batch {batch} T={temperature:g} {method:>6} B={budget}: tau {res.tau:.2f}, "
                      f"{res.tokens_per_s:,.0f} tokens/s, {res.tokens_per_s / base:.2f}x AR", flush=True)


def cost_table(result: dict) -> costs.CostTable:
    """The cost table of part 1's rows in ``result``: per (batch, context), the round ms per budget
    (the last row of a budget measured twice) and the decode step."""
    groups: dict = {}
    for row in result["shapes"]:
        groups.setdefault((row["batch"], row["context"]), {})[row["budget"]] = row
    meta = result["meta"]
    cap = meta["settings"].get("topk_cap") or "none"
    curves = tuple(costs.CostCurve(batch, context, tuple(sorted(by_budget)),
                                   tuple(by_budget[b]["round_ms"] for b in sorted(by_budget)),
                                   decode_ms=next(iter(by_budget.values()))["decode_ms"])
                   for (batch, context), by_budget in sorted(groups.items()))
    source = (f"ddtree bench, {meta['date']}, shapes {meta['settings'].get('shapes')}, cap {cap}, T = "
              f"{meta['settings'].get('temperature')}: {meta['command']}")
    return costs.CostTable(meta["device"], curves, source)


def write_cost_table(result: dict, out: Path) -> Path | None:
    """`cost_table` of ``result`` as ``<out stem>_costs.json`` next to ``out`` (None: no part 1 rows)."""
    if not result["shapes"]:
        return None
    path = out.with_name(f"{out.stem}_costs.json")
    path.write_text(json.dumps(cost_table(result).to_json(), indent=1) + "\n")
    print(f"wrote {path} (the device's round-time model, ddtree_jax.costs)")
    return path


def _budgets(text: str) -> list[int]:
    return int_list(text, engine.max_budget())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags (``ddtree bench``; ``experiments/bench_e2e.py`` runs the same command)."""
    def preset(name: str) -> str:
        full, tiny = (",".join(map(str, v)) if isinstance(v, list) else v for v in (FULL[name], TINY[name]))
        return f"(default: {full}; with --shapes tiny {tiny})"

    p.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b",
                   help="model shapes of parts 1, 3 and 4; tiny also makes the knobs below tiny")
    p.add_argument("--skip-shapes", action="store_true", help="skip part 1")
    p.add_argument("--batches", type=int_list, help="batch sizes of parts 1, 3 and 4 " + preset("batches"))
    p.add_argument("--contexts", type=int_list,
                   help="committed context lengths of part 1, prompt lengths of parts 3 and 4 " + preset("contexts"))
    p.add_argument("--budgets", type=_budgets, help="DDTree node budgets of parts 1 and 3 " + preset("budgets"))
    p.add_argument("--topk-cap", type=int, default=0, help="per-depth top-k cap of the tree (0 = none)")
    p.add_argument("--temperature", type=float, default=1.0, help="target temperature of part 1 (0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="target top-k of part 1 (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="target top-p of part 1")
    p.add_argument("--attention-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree-verify attention: the Pallas kernel on a supported GPU (auto) or XLA")
    p.add_argument("--sampler-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="tree sampling: the fused Pallas kernel on a supported GPU (auto) or the jnp path")
    p.add_argument("--build-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="the tree build's beam and global order: the Pallas kernel where measured faster (auto) or XLA")
    p.add_argument("--matmul-impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="the projections: XLA (auto) or the Pallas skinny matmul")
    p.add_argument("--generate", action="store_true",
                   help="also run part 3: generate() end to end next to the jitted round")
    p.add_argument("--prefill", action="store_true",
                   help="also run part 4: the prefill of each batch and context against its matmul-FLOP roofline")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 matmul rate of the prefill roofline")
    p.add_argument("--mesh-check", action="store_true",
                   help="also time the first budget's round under a one-device mesh vs without (XLA attention)")
    p.add_argument("--build-check", action="store_true",
                   help="also time each round back to back with the XLA tree build (--build-impl xla), for comparison")
    p.add_argument("--profile", action="store_true",
                   help="also trace the decode step and each budget's round and sum their device ops, by "
                        "kind and by the round's step (and the prefill, by kind, with --prefill)")
    p.add_argument("--hlo", action="store_true",
                   help="with --profile, also write each profiled program's optimized HLO next to the JSON")
    p.add_argument("--profile-ops", type=int, default=15, help="ops kept per profile in the JSON, the longest first")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth of the roofline (accelerators), TB/s")
    p.add_argument("--repeats", type=int, help="warm calls per timing, their median reported " + preset("repeats"))
    p.add_argument("--embedded", action="store_true", help="also run part 2 on the embedded pair")
    p.add_argument("--embedded-batches", type=int_list, help="part 2 batch sizes " + preset("embedded_batches"))
    p.add_argument("--embedded-budgets", type=_budgets, help="part 2 DDTree node budgets " + preset("embedded_budgets"))
    p.add_argument("--new-tokens", type=int, help="tokens per request in part 2 " + preset("new_tokens"))
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the drafter drafts from this many tokens (parts 1 and 3: the lowest ids, part 1 also "
                        "timing the round with all of them; part 2: the most frequent, by the embedded target's "
                        "token counts); 0 = the whole vocabulary")
    p.add_argument("--with-expected", action="store_true",
                   help="rounds (parts 1 and 3) also compute the exact expected acceptance each round, as generate() "
                        "does by default and ddtree generate reports; off: the round alone")
    p.add_argument("--draft-temperature", type=float, default=1.0,
                   help="temperature of the draft marginals the chain and DDTree draft from in part 2")
    p.add_argument("--out", type=Path, default=Path("bench_e2e.json"), help="JSON output")


def run_from_args(args) -> int:
    """Fill the unset knobs from ``--shapes`` (`FULL` or `TINY`), check every flag, then run the parts
    asked for; the JSON at ``args.out`` is rewritten after every row."""
    for name, value in (TINY if args.shapes == "tiny" else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    checks.flags(args, [("temperature", lambda v: v >= 0, ">= 0"), ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                        ("top_k", lambda v: v >= 0, ">= 0"), ("topk_cap", lambda v: v >= 0, ">= 0"),
                        ("repeats", lambda v: v >= 1, ">= 1"), ("new_tokens", lambda v: v >= 1, ">= 1"),
                        ("hbm_tbps", lambda v: v > 0, "> 0"), ("peak_tflops", lambda v: v > 0, "> 0"),
                        ("profile_ops", lambda v: v >= 1, ">= 1"),
                        ("draft_vocab", lambda v: v >= 0, ">= 0 (0 = the whole vocabulary)"),
                        ("draft_temperature", lambda v: math.isfinite(v) and v > 0, "finite and > 0")])
    device = jax.devices()[0].device_kind
    print(f"device {device}, jax {jax.__version__}", flush=True)
    result = dict(meta=dict(device=device, backend=jax.default_backend(), jax=jax.__version__,
                            date=time.strftime("%Y-%m-%d"), command=command_line(),
                            settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                      if k != "func"}),
                  shapes=[], generate=[], prefill=[], embedded=[])
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def emitter(part):
        def emit(row):
            result[part].append(row)
            args.out.write_text(json.dumps(result, indent=1))
        return emit

    if not args.skip_shapes:
        bench_shapes(args, emitter("shapes"))
        write_cost_table(result, args.out)
    if args.generate:
        bench_generate(args, emitter("generate"))
    if args.prefill:
        bench_prefill(args, emitter("prefill"))
    if args.embedded:
        bench_embedded(args, emitter("embedded"))
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0
