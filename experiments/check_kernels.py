"""Equality of the compiled Pallas kernels with the jnp references on a GPU, over a grid of shapes.

The CPU tests run the same kernels in interpret mode; this script runs the compiled kernels on the
device, over shapes too large for the CPU.

- ``attention``: the Triton kernel (and with ``--backends triton,mosaic`` the Mosaic GPU kernel,
  Hopper only; ``triton_by_length``: the Triton kernel with the prefix split by each request's length)
  against the reference: contexts up to 64k, up to 512 tree nodes, GQA groups 1/4/8,
  head_dim 64/128, bf16 and fp32, batch up to 32, ragged lengths and padding nodes. The Mosaic GPU
  kernel skips the fp32 cases (it takes bf16/fp16 only). The reference runs with float32 matmuls
  at full precision. Stacked cases put a case's cache in the last layer of an all-layers cache.
- ``sampling``: the fused tree sampler against the jnp path (``verify_from_coins``) at V = 151,936:
  greedy and sampled requests mixed in a batch, float32 and bf16 logits, kept sets searched among
  candidates and, with top-k beyond the candidate capacity, by passes over the row; accepted paths
  and tokens must be identical.
- ``matmul``: the skinny-matmul kernel (the device's policy configs) against its reference on
  Qwen3-8B's projections with their prologue and epilogues at M = 1, 16, 65, 520 and on ragged
  shapes; within bf16 rounding of the float32-accumulated reference. ``matmul_auto``: the same
  cases through ``kernels.matmul_fn("auto")`` (the models' default: XLA, with few rows padded).
  ``matmul_mosaic``: the Mosaic GPU matmul (``matmul_mgpu``, Hopper) against the plain product at the
  projections' shapes and 1, 16 and 64 rows, and the LM head at 16, within the same tolerance.
- ``forward_auto``: whole target forwards (Qwen3-8B layers, four of them, random bf16 weights) with
  ``matmul_impl="auto"`` and ``attention_impl="auto"`` (on sm_90 every product of fewer than 16 rows
  zero-padded to 16, the output and down products of 17 rows or more finished by the ``residual_norm``
  kernel; the attention and K/V-write kernels) against ``"xla"`` for both: decode steps at batch 1 and 3
  and 16- and 64-node verifies; logits, taps and the new cache entries within 5% of their scale (bf16
  roundings compound over the layers).
- ``residual_norm``: the split-K sum + residual + RMSNorm kernel (``pallas_kernels.residual_norm``)
  against its reference at the hidden sizes of Qwen3-8B and smaller models, 1 to 520 rows, 2 to 8
  partials, bf16 and fp32: both outputs within 1% of their scale (a rounding).
- ``drafter_auto``: drafter passes (Qwen3-8B-shaped layers, two of them, a 16-slot block, random bf16
  weights) with ``"auto"`` against ``"xla"``: each layer's one product over the context rows and the
  block, the K/V of both written by the norm + RoPE + write kernel, the block's queries attending with a
  mask over the kept context rows; batch 1 and 3 with 1 to 16 rows kept; draft logits and the committed
  context K/V within 5% of their scale, the lengths equal.
- ``rope``: the q/k norm + RoPE kernel (``kernels.qk_norm_rope_fn("pallas")``) against its reference
  at Qwen3-8B and Qwen3-30B-A3B heads, decode, verify and prefill rows, positions to 128k, bf16 and
  fp32; ``v`` must be identical, ``q`` and ``k`` within 0.04 in bf16 (a rounding of values up to
  about 8) and 8e-5 in fp32.
- ``rope_write``: the q/k norm + RoPE + K/V-write kernel (``kernels.qk_norm_rope_write_fn("pallas")``)
  against its reference: ``q`` and the key cache within the ``rope`` tolerances, the value cache
  identical, with slots past the end dropped; also with the projection given as the float32 partials of
  a split-K (4 and 8 chunks, rows padded to 16), which the kernel sums.
- ``kv_write``: the K/V cache-write kernel (``kernels.kv_write_fn("pallas")``) against its reference,
  bit for bit: decode, verify and prefill rows, slots past the cache's end (dropped), and a stacked
  cache of more than 2**31 elements written in its last layer.
- ``tree_build``: the tree-build kernel (``pallas_kernels.tree_build``) against its reference and the
  library's XLA path, from the top-K of random draft logits at V = 151,936 (with duplicated values,
  and depths whose top token has probability 1, so that entries of different depths tie), at budgets
  16 to 64 with the launch the library uses and with other chunks and warps, and the wide build
  (``pallas_kernels.tree_build_wide``) at budgets 128 to 512: identical nodes required.
- ``top_k``: the radix-selection top-k (``pallas_kernels.top_k``) against ``lax.top_k``
  (`top_k_reference`) over rows of 151,936 and 32,768 draft log-probabilities, ``k`` from 4 to 1,024,
  one draft (15 rows) and eight (120), with duplicated values, ``-inf`` and ``-0.0``: identical values
  and indices required.

    PYTHONPATH=. python experiments/check_kernels.py --out experiments/results --backends triton,mosaic
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import kernels, tree
from ddtree_jax.experiments.bench import SHAPES, drafter_config
from ddtree_jax.experiments.flags import name_list
from ddtree_jax.models import (
    KVCache,
    Qwen3Config,
    drafter_forward,
    init_drafter,
    init_target,
    target_forward,
)
from ddtree_jax.verify import verify_from_coins
from experiments.bench_kernels import compare_results, fused_sampler, sampling_inputs
from pallas_kernels.configs import tree_attention_config
from pallas_kernels.kv_write_reference import kv_write_reference
from pallas_kernels.matmul_mgpu import matmul_mgpu
from pallas_kernels.matmul_reference import matmul_reference
from pallas_kernels.qk_norm_rope_reference import (
    qk_norm_rope_reference,
    qk_norm_rope_write_reference,
    rope_tables,
    summed_partials,
)
from pallas_kernels.residual_norm import residual_norm
from pallas_kernels.residual_norm_reference import residual_norm_reference
from pallas_kernels.top_k import TopKConfig, top_k
from pallas_kernels.top_k_reference import top_k_reference
from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tree_attention_mgpu import DTYPES as MOSAIC_DTYPES
from pallas_kernels.tree_attention_mgpu import tree_attention_mgpu
from pallas_kernels.tree_attention_reference import tree_attention_reference
from pallas_kernels.tree_build import TreeBuildConfig, tree_build_config, tree_nodes
from pallas_kernels.tree_build_reference import tree_nodes_reference
from pallas_kernels.tree_build_wide import WideBuildConfig, tree_nodes_wide, wide_build_config
from pallas_kernels.tree_sampling import SamplerConfig

# (batch, nodes, heads, kv_heads, head_dim, contexts (cycled over the batch), padding nodes, dtype)
ATTENTION_CASES = [
    (1, 1, 8, 8, 128, [0], 0, "float32"),
    (4, 16, 32, 8, 128, [65536, 1, 40000, 777], 0, "bfloat16"),
    (32, 64, 16, 2, 64, [4096, 0, 3000, 1234], 9, "bfloat16"),
    (2, 512, 8, 2, 128, [8192, 5000], 100, "float32"),
    (3, 40, 4, 4, 64, [0, 30000, 12345], 7, "float32"),
    (4, 256, 32, 4, 128, [16384, 2048, 9999, 1], 30, "bfloat16"),
    (1, 7, 32, 8, 128, [65536], 0, "bfloat16"),
    (16, 64, 32, 8, 128, [1024], 0, "bfloat16"),
    (1, 65, 32, 8, 128, [1000], 0, "bfloat16"),  # a B = 64 round's verify: 5 splits in whole waves on 132 SMs
]
# (layers, index into ATTENTION_CASES): that case's K/V as the last layer of stacked
# [L, B, K, S, D] caches (the models' layout), read in place with layer = L - 1; 9 x case 1 is
# 4.8 GB per cache, past 2**32 bytes, where the kernel's offsets switch to 64 bits.
STACKED_CASES = [(9, 1)]


# (temperature, top_k, top_p) per request, cycled over the batch: greedy, plain, top-k, top-p,
# both, top-k 1, and a top-k past the default 2,048 candidates (searched by passes over the row)
MIXED_PARAMS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.6, 20, 0.95),
                (1.0, 1, 1.0), (1.2, 5000, 1.0), (0.8, 0, 0.5)]
# (batch, budget, vocab, logits dtype, candidate capacity)
SAMPLING_CASES = [
    (8, 64, 151_936, "float32", 2048),
    (8, 256, 151_936, "bfloat16", 2048),
    (16, 16, 151_936, "float32", 64),
]


def check_sampling(interpret=False, cases=SAMPLING_CASES):
    """The fused sampler (Triton, or ``interpret``) against the jnp path on each case."""
    records = []
    for seed, (batch, budget, vocab, dtype, capacity) in enumerate(cases):
        args = sampling_inputs(batch, budget, MIXED_PARAMS, vocab, seed=seed, dtype=jnp.dtype(dtype))
        record = dict(part="sampling", backend="interpret" if interpret else "triton", batch=batch, budget=budget,
                      vocab=vocab, dtype=dtype, capacity=capacity)

        def check(args=args, capacity=capacity):
            out = fused_sampler(SamplerConfig(capacity=capacity), interpret)(*args)
            same = compare_results(out, verify_from_coins(*args))
            return dict(same, ok=same["identical"], mean_accepted=float(np.mean(np.asarray(out.num_accepted))))

        records.append(_run_case(record, check))
    return records


# (M, K, N, gated, RMSNorm prologue, residual epilogue, columns)
MATMUL_CASES = [(m, k, n, gated, norm, residual, None) for m in (1, 16, 65, 520)
                for k, n, gated, norm, residual in ((4096, 6144, False, True, False), (4096, 4096, False, False, True),
                                                    (4096, 24576, True, True, False),
                                                    (12288, 4096, False, False, True))]
MATMUL_CASES += [(3, 1000, 77, False, True, True, None), (33, 300, 130, True, True, False, None),
                 (7, 4096, 6144, False, False, False, (4096, 6144))]


def product_record(out, ref) -> dict:
    """A product against its reference: the largest error, the reference's scale, and whether the
    product is finite and within bf16 rounding (2% of the scale, at least of 1)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
    return dict(max_abs_err=err, ref_scale=scale, ok=bool(np.isfinite(out).all() and err <= 2e-2 * max(scale, 1)))


def check_matmul(interpret=False, cases=MATMUL_CASES, impl=None):
    """The skinny matmul (``kernels.matmul_fn("pallas")``, or interpreted) against its reference; with
    ``impl="auto"``, the projections the models run by default (XLA, few rows padded on some GPUs)."""
    impl = impl or ("interpret" if interpret else "pallas")
    product = kernels.matmul_fn(impl)
    records = []
    for seed, (m, k, n, gated, norm, residual, columns) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 4)
        n_out = (n if columns is None else columns[1] - columns[0]) // (2 if gated else 1)
        kwargs = dict(gated=gated, columns=columns,
                      norm_K=(1 + 0.1 * jax.random.normal(keys[2], (k,))).astype(jnp.bfloat16) if norm else None,
                      residual_MN=jax.random.normal(keys[3], (m, n_out), jnp.bfloat16) if residual else None)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (k, n)) * k ** -0.5).astype(jnp.bfloat16)
        record = dict(part="matmul", impl=impl, m=m, k=k, n=n, gated=gated, norm=norm, residual=residual,
                      columns=columns)

        def check(x=x, w=w, kwargs=kwargs):
            return product_record(product(x, w, **kwargs), matmul_reference(x, w, **kwargs))

        records.append(_run_case(record, check))
    return records


# (M, K, N) of the Mosaic GPU matmul: the Qwen3-8B projections at 1, 16 and 64 rows, and the LM head at 16
MOSAIC_MATMUL_CASES = [(m, k, n) for m in (1, 16, 64) for k, n in ((4096, 6144), (4096, 4096), (4096, 24576),
                                                                    (12288, 4096))] + [(16, 4096, 151_936)]


def check_matmul_mosaic(interpret=False, cases=MOSAIC_MATMUL_CASES):
    """The Mosaic GPU matmul (``pallas_kernels.matmul_mgpu``, default tiling, or interpreted) against the
    plain product of its reference, within the matmul part's tolerance."""
    records = []
    for seed, (m, k, n) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed))
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (k, n)) * k ** -0.5).astype(jnp.bfloat16)

        def check(x=x, w=w):
            return product_record(matmul_mgpu(x, w, interpret=interpret), matmul_reference(x, w))

        records.append(_run_case(dict(part="matmul_mosaic", m=m, k=k, n=n), check))
    return records


def within_scale(got: dict, want: dict, tolerance: float = 0.05) -> dict:
    """Per named output: the largest error, the reference's scale, and whether the output is finite and
    within ``tolerance`` of that scale (bf16 roundings compound over layers); ``ok`` for all of them."""
    result = {}
    for name in want:
        out, ref = np.asarray(got[name], np.float32), np.asarray(want[name], np.float32)
        err, scale = float(np.abs(out - ref).max()), float(np.abs(ref).max())
        result.update({f"max_abs_err_{name}": err, f"scale_{name}": scale,
                       f"ok_{name}": bool(np.isfinite(out).all() and err <= tolerance * max(scale, 1e-3))})
    return dict(result, ok=all(result[f"ok_{name}"] for name in want))


# (batch, rows per request, committed context); at 1k the attention splits its prefix (5 splits at 65 rows, the
# tree's two key blocks a split of their own)
FORWARD_CASES = [(1, 1, 40), (3, 1, 40), (1, 16, 40), (1, 64, 40), (1, 65, 1000)]


def check_forward(shapes=None, cases=FORWARD_CASES, layers=4):
    """Target forwards with ``"auto"`` matmuls and attention against ``"xla"`` (see the module docstring);
    ``shapes``: the target's config fields (default Qwen3-8B's, ``layers`` of them)."""
    fields = dict(SHAPES["qwen3-8b"]["target"] if shapes is None else shapes, num_hidden_layers=layers)
    target = init_target(Qwen3Config(**fields), jax.random.key(0), jnp.bfloat16)
    cfg = target.config
    records = []
    for seed, (batch, num, context) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 3)
        slots = (layers, batch, cfg.num_key_value_heads, context + num, cfg.head_dim)
        k, v = (jax.random.normal(key, slots, jnp.bfloat16) for key in keys[:2])
        cache = KVCache(k=k, v=v, lengths=jnp.full((batch,), context, jnp.int32))
        tokens = jax.random.randint(keys[2], (batch, num), 0, cfg.vocab_size)
        positions = context + jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((num, num), bool)), (batch, num, num))
        record = dict(part="forward", impl="auto", batch=batch, rows=num, context=context, layers=layers)

        def check(args=(tokens, positions, mask, cache), context=context):
            def outputs(impl):
                logits, taps, new = target_forward(target, *args, tap_layers=(0, layers - 1), matmul_impl=impl,
                                                   attention_impl=impl)
                return dict(logits=logits, taps=taps, cache_k=new.k[..., context:, :], cache_v=new.v[..., context:, :])

            return within_scale(outputs("auto"), outputs("xla"))

        records.append(_run_case(record, check))
    return records


# (partials S, rows P, width N, dtype) of the residual_norm kernel
RESIDUAL_NORM_CASES = [(4, 17, 4096, "bfloat16"), (4, 64, 4096, "bfloat16"), (8, 65, 4096, "bfloat16"),
                       (2, 520, 4096, "bfloat16"), (4, 3, 2048, "float32"), (8, 1, 1024, "bfloat16")]


def check_residual_norm(interpret=False, cases=RESIDUAL_NORM_CASES):
    """The split-K sum + residual + RMSNorm kernel (compiled, or ``interpret``) against its reference."""
    records = []
    for seed, (splits, rows, cols, dtype) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 3)
        partials = jax.random.normal(keys[0], (splits, rows, cols), jnp.float32)
        residual = (3 * jax.random.normal(keys[1], (rows, cols))).astype(dtype)
        norm = (1 + 0.1 * jax.random.normal(keys[2], (cols,))).astype(dtype)

        def check(args=(partials, residual, norm)):
            got = residual_norm(*args, eps=1e-6, interpret=interpret)
            want = residual_norm_reference(*args, eps=1e-6)
            return within_scale(dict(x=got[0], normed=got[1]), dict(x=want[0], normed=want[1]), tolerance=0.01)

        records.append(_run_case(dict(part="residual_norm", splits=splits, rows=rows, cols=cols, dtype=dtype), check))
    return records


# (batch, context rows each request keeps of the 16 a drafter pass takes)
DRAFTER_CASES = [(1, (4,)), (3, (16, 1, 7))]


def check_drafter(shapes=None, cases=DRAFTER_CASES, layers=2, context=40, block_size=16, impl="auto"):
    """Drafter passes (``dflash.drafter_forward``: each layer's q/k/v product over the context rows and
    the block, the K/V of both written by one kernel, the block's queries attending) with ``impl``
    matmuls and attention against ``"xla"`` for both (see the module docstring); ``shapes``: the
    target's config fields (default Qwen3-8B's, ``layers`` of them, as many drafter layers)."""
    fields = dict(SHAPES["qwen3-8b"]["target"] if shapes is None else shapes, num_hidden_layers=layers)
    target = init_target(Qwen3Config(**fields), jax.random.key(0), jnp.bfloat16)
    cfg = target.config
    dc = drafter_config(cfg, num_hidden_layers=layers, block_size=block_size, target_layer_ids=(0, layers - 1))
    drafter = init_drafter(dc, jax.random.key(1), jnp.bfloat16)
    records = []
    for seed, (batch, counts) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 4)
        slots = (layers, batch, dc.num_key_value_heads, context + 2 * block_size, dc.head_dim)
        k, v = (jax.random.normal(key, slots, jnp.bfloat16) for key in keys[:2])
        cache = KVCache(k=k, v=v, lengths=jnp.full((batch,), context, jnp.int32))
        feats = jax.random.normal(keys[2], (batch, block_size, dc.num_features), jnp.bfloat16)
        positions = context + jnp.broadcast_to(jnp.arange(block_size, dtype=jnp.int32), (batch, block_size))
        count_B = jnp.asarray(counts, jnp.int32)
        roots = jax.random.randint(keys[3], (batch,), 0, cfg.vocab_size)
        record = dict(part="drafter", impl=impl, batch=batch, context_rows=list(counts), layers=layers)

        def check(args=(cache, feats, positions, count_B, roots, context + count_B), counts=counts):
            def outputs(which):
                logits, new = drafter_forward(drafter, target, *args, attention_impl=which, matmul_impl=which)
                kept = [(new.k[:, b, :, context:context + c], new.v[:, b, :, context:context + c])
                        for b, c in enumerate(counts)]
                return dict(logits=logits, cache_k=jnp.concatenate([kv[0] for kv in kept], axis=2),
                            cache_v=jnp.concatenate([kv[1] for kv in kept], axis=2), lengths=new.lengths)

            got, want = outputs(impl), outputs("xla")
            lengths_equal = bool(np.array_equal(got.pop("lengths"), want.pop("lengths")))
            result = within_scale(got, want)
            return dict(result, lengths_equal=lengths_equal, ok=lengths_equal and result["ok"])

        records.append(_run_case(record, check))
    return records


# (batch, rows per request, heads, kv_heads, dtype)
ROPE_CASES = [(1, 1, 32, 8, "bfloat16"), (1, 65, 32, 8, "bfloat16"), (8, 17, 32, 4, "bfloat16"),
              (2, 1024, 32, 8, "bfloat16"), (3, 33, 32, 8, "float32")]


def rope_operands(keys, batch, num, heads, kv_heads, head_dim, dtype):
    """From four random ``keys``, a fused projection (values up to about 8), its two norm weights and
    RoPE tables at positions up to 128k: ``(qkv, q_norm, k_norm, cos, sin)``."""
    qkv = (3 * jax.random.normal(keys[0], (batch, num, (heads + 2 * kv_heads) * head_dim))).astype(dtype)
    norms = [(1 + 0.2 * jax.random.normal(key, (head_dim,))).astype(dtype) for key in keys[1:3]]
    return (qkv, *norms, *rope_tables(jax.random.randint(keys[3], (batch, num), 0, 131072), head_dim, 1e6))


def check_rope(interpret=False, cases=ROPE_CASES, head_dim=128):
    """The q/k norm + RoPE kernel (``kernels.qk_norm_rope_fn("pallas")``, or interpreted) against its
    reference."""
    split_norm_rotate = kernels.qk_norm_rope_fn("interpret" if interpret else "pallas")
    records = []
    for seed, (batch, num, heads, kv_heads, dtype) in enumerate(cases):
        args = rope_operands(jax.random.split(jax.random.key(seed), 4), batch, num, heads, kv_heads, head_dim, dtype)
        kwargs = dict(heads=heads, kv_heads=kv_heads, eps=1e-6)
        record = dict(part="rope", batch=batch, rows=num, heads=heads, kv_heads=kv_heads, dtype=dtype)

        def check(args=args, kwargs=kwargs, tol=8e-5 if dtype == "float32" else 4e-2):
            outs = [np.asarray(x, np.float32) for x in split_norm_rotate(*args, **kwargs)]
            refs = [np.asarray(x, np.float32) for x in qk_norm_rope_reference(*args, **kwargs)]
            errs = [float(np.abs(o - r).max()) for o, r in zip(outs, refs, strict=True)]
            ok = all(np.isfinite(o).all() for o in outs) and max(errs[:2]) <= tol and errs[2] == 0
            return dict(max_abs_err_q=errs[0], max_abs_err_k=errs[1], max_abs_err_v=errs[2], ok=bool(ok))

        records.append(_run_case(record, check))
    return records


# (layers, batch, new rows, kv_heads, head_dim, slots, lengths (cycled over the batch), dtype); the last
# case's caches hold 36 x 8 x 8 x 8400 x 128 > 2**31 elements each, where offsets need 64 bits.
KV_WRITE_CASES = [(4, 1, 1, 8, 128, 1100, [1024], "bfloat16"), (4, 1, 65, 8, 128, 1100, [1024], "bfloat16"),
                  (3, 8, 17, 4, 128, 300, [0, 290, 17, 283], "bfloat16"), (2, 2, 512, 8, 64, 600, [0, 300], "float32"),
                  (36, 8, 16, 8, 128, 8400, [8192, 8390, 8384, 5], "bfloat16")]


# (layers, batch, rows per request, heads, kv_heads, slots, lengths (cycled over the batch), dtype, queries: the
# last rows that get query heads, None = all; the drafter's context rows have none; chunks: the projection as
# the float32 partials of a split-K of this many chunks, its rows padded to 16, 0 = as activations)
ROPE_WRITE_CASES = [(4, 1, 1, 32, 8, 1100, [1024], "bfloat16", None, 0),
                    (4, 1, 65, 32, 8, 1100, [1024], "bfloat16", None, 0),
                    (3, 8, 17, 32, 4, 300, [0, 290, 17, 283], "bfloat16", None, 0),
                    (2, 3, 33, 32, 8, 100, [0, 80, 5], "float32", None, 0),
                    (2, 3, 20, 32, 8, 300, [0, 270, 5], "bfloat16", 16, 0),
                    (4, 1, 1, 32, 8, 1100, [1024], "bfloat16", None, 4),
                    (4, 1, 64, 32, 8, 1100, [1024], "bfloat16", None, 4),
                    (2, 2, 20, 32, 8, 300, [0, 270], "bfloat16", 16, 4),
                    (2, 3, 5, 32, 8, 100, [0, 80, 5], "float32", None, 8)]


def check_rope_write(interpret=False, cases=ROPE_WRITE_CASES, head_dim=128):
    """The q/k norm + RoPE + K/V-write kernel (``kernels.qk_norm_rope_write_fn("pallas")``, or interpreted)
    against its reference, written into the last layer."""
    fused = jax.jit(kernels.qk_norm_rope_write_fn("interpret" if interpret else "pallas"),
                    static_argnames=("layer", "heads", "kv_heads", "eps", "queries"))
    records = []
    for seed, (layers, batch, num, heads, kv_heads, slots, lengths, dtype, queries, chunks) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 6)
        caches = [jax.random.normal(key, (layers, batch, kv_heads, slots, head_dim), dtype) for key in keys[4:]]
        lengths_B = jnp.asarray(np.resize(np.asarray(lengths), batch), jnp.int32)
        qkv, *rest = rope_operands(keys[:4], batch, num, heads, kv_heads, head_dim, dtype)
        partials = None
        if chunks:  # partials whose sum is about the size of qkv's values; the reference reads their sum
            partials = (3 / chunks ** 0.5) * jax.random.normal(
                keys[0], (chunks, max(batch * num, 16), qkv.shape[-1]), jnp.float32)
            qkv = summed_partials(partials, qkv.shape, qkv.dtype)
        args = (qkv, *rest, *caches, lengths_B)
        kwargs = dict(layer=layers - 1, heads=heads, kv_heads=kv_heads, eps=1e-6, queries=queries)
        record = dict(part="rope_write", layers=layers, batch=batch, rows=num, heads=heads, kv_heads=kv_heads,
                      slots=slots, dtype=dtype, queries=queries, partial_chunks=chunks)

        def check(args=args, kwargs=kwargs, partials=partials, tol=8e-5 if dtype == "float32" else 4e-2):
            outs = [np.asarray(x, np.float32) for x in fused(*args, partials_SRC=partials, **kwargs)]
            refs = [np.asarray(x, np.float32) for x in qk_norm_rope_write_reference(*args, **kwargs)]
            errs = [float(np.abs(o - r).max()) for o, r in zip(outs, refs, strict=True)]
            ok = all(np.isfinite(o).all() for o in outs) and max(errs[:2]) <= tol and errs[2] == 0
            return dict(max_abs_err_q=errs[0], max_abs_err_k_cache=errs[1], max_abs_err_v_cache=errs[2], ok=bool(ok))

        records.append(_run_case(record, check))
    return records


def check_kv_write(interpret=False, cases=KV_WRITE_CASES):
    """The K/V cache-write kernel (``kernels.kv_write_fn("pallas")``, or interpreted) against its
    reference, written into the last layer; identical caches required."""
    write = jax.jit(kernels.kv_write_fn("interpret" if interpret else "pallas"), static_argnames="layer")
    records = []
    for seed, (layers, batch, num, kv_heads, head_dim, slots, lengths, dtype) in enumerate(cases):
        keys = jax.random.split(jax.random.key(seed), 4)
        caches = [jax.random.normal(key, (layers, batch, kv_heads, slots, head_dim), dtype) for key in keys[:2]]
        new = [jax.random.normal(key, (batch, num, kv_heads, head_dim), dtype) for key in keys[2:]]
        lengths_B = jnp.asarray(np.resize(np.asarray(lengths), batch), jnp.int32)
        record = dict(part="kv_write", layers=layers, batch=batch, rows=num, kv_heads=kv_heads, slots=slots,
                      dtype=dtype)

        def check(args=(*caches, *new, lengths_B), layer=layers - 1):
            refs = kv_write_reference(*args, layer=layer)
            outs = write(*args, layer=layer)
            same = [bool(jnp.array_equal(o, r)) for o, r in zip(outs, refs, strict=True)]
            return dict(identical_k=same[0], identical_v=same[1], ok=all(same))

        records.append(_run_case(record, check))
    return records


# (batch, depth, vocab, budget, k, ties, launch: None for `tree_build.tree_build_config`'s) of the tree-build
# kernel: the CLI's default tree (16, cap 4), budgets 16 to 64 uncapped and capped, a chain, at batch 1 to 8;
# besides the default launches, one count tile, chunks of 16 and 64, and 4 warps; then the wide build
# (a `WideBuildConfig` launch) at budgets 128 to 512, uncapped and capped
TREE_BUILD_CASES = [(1, 15, 151_936, 16, 4, False, None), (8, 15, 151_936, 16, 16, True, None),
                    (1, 15, 151_936, 32, 32, True, None), (8, 15, 151_936, 32, 8, False, None),
                    (2, 15, 151_936, 16, 1, True, None), (1, 15, 151_936, 64, 64, True, None),
                    (8, 15, 151_936, 64, 8, False, None), (1, 15, 151_936, 64, 4, True, None),
                    (8, 15, 151_936, 16, 16, True, TreeBuildConfig(chunk=0)),
                    (1, 15, 151_936, 32, 32, True, TreeBuildConfig(num_warps=4, chunk=16)),
                    (8, 15, 151_936, 64, 64, True, TreeBuildConfig(num_warps=16, chunk=64)),
                    (1, 15, 151_936, 512, 512, True, wide_build_config(512, 512)), (8, 15, 151_936, 512, 512, False,
                                                                           WideBuildConfig(rows=64, num_warps=8)),
                    (2, 15, 151_936, 256, 4, True, WideBuildConfig(rows=16, cols=256)),
                    (1, 16, 151_936, 128, 128, False, WideBuildConfig()),
                    (1, 15, 151_936, 128, 4, False, wide_build_config(128, 4))]


def check_tree_build(interpret=False, cases=TREE_BUILD_CASES):
    """The tree-build kernel, or the wide build where a case's launch is a `WideBuildConfig` (either
    interpreted), against `tree_nodes_reference` and the library's ``tree_from_top_k``: identical tokens,
    parents, depths and log-weights."""
    records = []
    for seed, (batch, depth, vocab, budget, k, ties, config) in enumerate(cases):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=(batch, depth, vocab)).astype(np.float32) * 3
        if ties:  # duplicated values, and rows whose top token has probability 1 (exp(-200) underflows)
            logits = np.round(logits)
            logits[:, 1::2] = -200.0
            logits[:, 1::2, 0] = 0.0
        lp, ids = jax.lax.top_k(tree.draft_log_probs(jnp.asarray(logits), 1.0), k)
        ids = ids.astype(jnp.int32)
        config = tree_build_config(budget, k) if config is None else config
        record = dict(part="tree_build", batch=batch, depth=depth, vocab=vocab, budget=budget, k=k, ties=ties,
                      config=dataclasses.asdict(config))

        def check(lp=lp, ids=ids, budget=budget, config=config):
            build = tree_nodes_wide if isinstance(config, WideBuildConfig) else tree_nodes
            got = build(lp, ids, budget=budget, config=config, interpret=interpret)
            # both jitted: run op by op they take seconds a case (dispatches)
            ref = jax.jit(functools.partial(tree_nodes_reference, budget=budget))(lp, ids)
            library = jax.jit(jax.vmap(functools.partial(tree.tree_from_top_k, budget=budget)))(
                lp, ids, jnp.zeros(lp.shape[0], jnp.int32))[:4]
            same_ref = all(bool(jnp.array_equal(g, r)) for g, r in zip(got, ref, strict=True))
            same_library = all(bool(jnp.array_equal(g, w[:, 1:])) for g, w in zip(got, library, strict=True))
            return dict(identical_to_reference=same_ref, identical_to_library=same_library,
                        ok=same_ref and same_library)

        records.append(_run_case(record, check))
    return records


# (rows, vocab, k, ties, launch)
TOP_K_CASES = [(15, 151_936, 512, False, TopKConfig()), (15, 151_936, 4, False, TopKConfig()),
               (15, 151_936, 64, True, TopKConfig()), (120, 151_936, 512, True, TopKConfig()),
               (15, 151_936, 16, True, TopKConfig(block=2048, num_warps=16, segments=3)),
               (1, 32_768, 1024, True, TopKConfig(block=256, num_warps=4))]


def check_top_k(interpret=False, cases=TOP_K_CASES):
    """The top-k kernel (interpreted or not) against `top_k_reference` on draft log-probabilities:
    identical values (signs of zeros included) and indices."""
    records = []
    for seed, (rows, vocab, k, ties, config) in enumerate(cases):
        rng = np.random.default_rng(seed)
        logits = rng.normal(size=(1, rows, vocab)).astype(np.float32) * 3
        if ties:  # duplicated values, -inf and -0.0 entries
            logits = np.round(logits)
            logits[0, :, ::7] = -np.inf
        x = tree.draft_log_probs(jnp.asarray(logits), 1.0)[0]
        if ties:
            x = x.at[:, 3::11].set(-0.0).at[:, 5::11].set(0.0)
        record = dict(part="top_k", rows=rows, vocab=vocab, k=k, ties=ties, config=dataclasses.asdict(config))

        def check(x=x, k=k, config=config):
            got = top_k(x, k, config=config, interpret=interpret)
            want = jax.jit(top_k_reference, static_argnums=1)(x, k)
            same = (bool(jnp.array_equal(got[1], want[1])) and bool(jnp.array_equal(got[0], want[0]))
                    and bool(jnp.array_equal(jnp.signbit(got[0]), jnp.signbit(want[0]))))
            return dict(identical_to_reference=same, ok=same)

        records.append(_run_case(record, check))
    return records


def _run_case(record, check):
    """``record`` updated with ``check()`` (a dict with ``ok``) or with the error it raised; timed and
    printed."""
    start = time.perf_counter()
    try:
        record.update(check())
    except Exception as err:  # noqa: BLE001 (recorded as a failed case)
        record.update(ok=False, error=f"{type(err).__name__}: {str(err)[:2000]}")
    record["seconds"] = time.perf_counter() - start
    print(record, flush=True)
    return record


def random_tree_mask(rng, nodes, real):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, real)]
    mask = np.eye(nodes, dtype=bool)
    for i in range(1, real):
        mask[i] |= mask[parents[i]]
    return mask


def attention_case(seed, batch, nodes, heads, kv_heads, head_dim, contexts, padding, dtype):
    rng = np.random.default_rng(seed)
    lengths = np.resize(np.asarray(contexts), batch).astype(np.int32)
    slots = int(lengths.max()) + nodes + 5
    key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(key_q, (batch, nodes, heads, head_dim), dtype)
    k = jax.random.normal(key_k, (batch, kv_heads, slots, head_dim), dtype)
    v = jax.random.normal(key_v, (batch, kv_heads, slots, head_dim), dtype)
    mask = np.stack([random_tree_mask(rng, nodes, nodes - padding) for _ in range(batch)])
    return q, k, v, jnp.asarray(lengths), jnp.asarray(mask)


def check_attention(backends=("triton",), cases=ATTENTION_CASES, stacked=STACKED_CASES):
    records = []
    for seed, (batch, nodes, heads, kv_heads, head_dim, contexts, padding, dtype) in enumerate(cases):
        args = attention_case(seed, batch, nodes, heads, kv_heads, head_dim, contexts, padding,
                              jnp.dtype(dtype))
        scale = head_dim ** -0.5
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(tree_attention_reference(*args, scale=scale), np.float32)
        runs = [(layers, backend) for layers in [None] + [n for n, s in stacked if s == seed] for backend in backends]
        for layers, backend in runs:
            record = dict(backend=backend, batch=batch, nodes=nodes, heads=heads,
                          kv_heads=kv_heads, head_dim=head_dim, contexts=contexts,
                          padding=padding, dtype=dtype, layers=layers)
            if backend.startswith("mosaic") and not any(jnp.dtype(dtype) == d for d in MOSAIC_DTYPES):
                record.update(ok=True, skipped=f"{dtype} not supported by the mosaic kernel")
                print(record, flush=True)
                records.append(record)
                continue
            records.append(_check_attention_backend(record, args, scale, ref, backend))
    return records


def attention_kernel(backend: str):
    """The attention kernel a ``--backends`` name stands for: ``triton`` (the local GPU's config),
    ``triton_by_length`` (that config with ``split_by_length``), ``mosaic`` (Hopper), or either run by its
    interpreter (``interpret``, ``mosaic_interpret``)."""
    by_length = lambda: dataclasses.replace(tree_attention_config(), split_by_length=True)  # noqa: E731
    return {"triton": lambda: functools.partial(tree_attention, config=tree_attention_config()),
            "triton_by_length": lambda: functools.partial(tree_attention, config=by_length()),
            "mosaic": lambda: tree_attention_mgpu,
            "interpret": lambda: functools.partial(tree_attention, interpret=True),
            "mosaic_interpret": lambda: functools.partial(tree_attention_mgpu, interpret=True)}[backend]()


def _check_attention_backend(record, args, scale, ref, backend):
    def check():
        q, k, v, lengths, mask = args
        layer = None
        if record["layers"]:
            layer = record["layers"] - 1
            k, v = (jnp.zeros((layer + 1, *x.shape), x.dtype).at[layer].set(x) for x in (k, v))
        out = np.asarray(attention_kernel(backend)(q, k, v, lengths, mask, scale=scale, layer=layer), np.float32)
        err = float(np.abs(out - ref).max())
        tol = 1e-4 if record["dtype"] == "float32" else 3e-2
        return dict(max_abs_err=err, tol=tol, ok=bool(err <= tol and np.isfinite(out).all()))

    return _run_case(record, check)


BACKENDS = ("triton", "triton_by_length", "mosaic")
PARTS = ("attention", "sampling", "matmul", "matmul_auto", "matmul_mosaic", "forward_auto", "drafter_auto", "rope",
         "rope_write", "kv_write", "residual_norm", "tree_build", "top_k")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results")
    parser.add_argument("--backends", type=name_list(BACKENDS), default=["triton"],
                        help=f"comma-separated tree-attention backends to check, of {', '.join(BACKENDS)}")
    parser.add_argument("--parts", type=name_list(PARTS), default=list(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    backends, parts = tuple(args.backends), args.parts
    print(jax.__version__, jax.devices()[0].device_kind, flush=True)
    checks = dict(attention=lambda: check_attention(backends), sampling=check_sampling, matmul=check_matmul,
                  matmul_auto=functools.partial(check_matmul, impl="auto"), matmul_mosaic=check_matmul_mosaic,
                  forward_auto=check_forward,
                  drafter_auto=check_drafter, rope=check_rope, rope_write=check_rope_write, kv_write=check_kv_write,
                  residual_norm=check_residual_norm, tree_build=check_tree_build, top_k=check_top_k)
    results = {part: checks[part]() for part in parts}
    path = Path(args.out) / "check_kernels.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    failed = [r for rs in results.values() for r in rs if not r["ok"]]
    print(f"{len(failed)} failed" if failed else "all ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
