"""Target and drafter forwards at Qwen3-8B shapes (random bf16 weights) against the HBM roofline.

Per matmul implementation (``--matmul-impls``), attention implementation (``--attention-impls``: on
a GPU ``auto`` is the tree-attention kernel, ``pallas`` that and the q/k norm + RoPE kernel, ``xla``
both references), batch and context: the target forward of one token
(the decode step's forward) and of N tree nodes (``--nodes``), and the drafter forward (context
append + block + LM head); ``--variants`` compiles each forward under several named sets of XLA GPU
options (`VARIANTS`: command buffers, which run the step as CUDA graphs; an exhaustive GEMM tiling
search; fusion passes that put more ops into Triton fusions), one variant failing to compile leaving
the others; with ``--profile`` each forward's device ops are summed by kind (and the optimized HLO of
the first forward of each kind is written next to the JSON with ``--hlo``); ``--draft-vocab`` W gives the
drafter a head over W tokens, as ``ddtree bench --draft-vocab`` does. One process, warm jit,
``block_until_ready``, medians of ``--repeats`` calls. The roofline is the bytes a forward must
stream (all layer weights + the LM head) over ``--hbm-tbps``.

    PYTHONPATH=. python experiments/bench_models.py --matmul-impls xla,pallas --contexts 1024 --nodes 16,64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import kernels  # noqa: E402
from ddtree_jax.experiments import profiling  # noqa: E402
from ddtree_jax.experiments.bench import SHAPES, make_models, median_ms, streamed_bytes  # noqa: E402
from ddtree_jax.experiments.flags import int_list, int_list_or_empty, name_list  # noqa: E402
from ddtree_jax.experiments.provenance import command_line  # noqa: E402
from ddtree_jax.models import KVCache, drafter_forward, init_cache, target_forward  # noqa: E402

# name: XLA GPU options every forward is compiled with (``--variants``)
VARIANTS = {
    "default": {},
    "command-buffers": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION",
        "xla_gpu_graph_min_graph_size": 1},
    "exhaustive-tiling": {"xla_gpu_exhaustive_tiling_search": True},
    "heroless-fusion": {"xla_gpu_experimental_enable_triton_heroless_priority_fusion": True},
    "block-level-fusion": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
}


def filled_cache(cfg, layers, batch, context, slots, dtype):
    cache = init_cache(layers, batch, cfg.num_key_value_heads, slots, cfg.head_dim, dtype)
    return KVCache(cache.k, cache.v, jnp.full((batch,), context, jnp.int32))


def target_runner(target, batch, context, nodes, impl, options, attention="auto"):
    cfg = target.config
    cache = filled_cache(cfg, cfg.num_hidden_layers, batch, context, context + nodes + 1, target.dtype)
    tokens = jnp.zeros((batch, nodes), jnp.int32)
    positions = context + jnp.broadcast_to(jnp.arange(nodes, dtype=jnp.int32), (batch, nodes))
    # A chain-shaped ancestor mask has the same cost as any tree mask of n nodes.
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((nodes, nodes), bool)), (batch, nodes, nodes))
    fn = jax.jit(functools.partial(target_forward, attention_impl=attention, matmul_impl=impl),
                 compiler_options=options)
    return fn, (target, tokens, positions, mask, cache)


def drafter_runner(target, drafter, batch, context, impl, options, attention="auto"):
    dc = drafter.config
    cache = filled_cache(dc, dc.num_hidden_layers, batch, context, context + 2 * dc.block_size + 1, drafter.dtype)
    feats = jnp.zeros((batch, dc.block_size, dc.num_features), drafter.dtype)
    positions = context + jnp.broadcast_to(jnp.arange(dc.block_size, dtype=jnp.int32), (batch, dc.block_size))
    count = jnp.full((batch,), 4, jnp.int32)
    fn = jax.jit(functools.partial(drafter_forward, attention_impl=attention, matmul_impl=impl),
                 compiler_options=options)
    return fn, (drafter, target, cache, feats, positions, count, jnp.zeros((batch,), jnp.int32),
                jnp.full((batch,), context + 4, jnp.int32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--matmul-impls", type=name_list(kernels.IMPLS), default=["xla", "pallas"])
    ap.add_argument("--attention-impls", type=name_list(kernels.IMPLS), default=["auto"],
                    help=f"comma-separated, from: {', '.join(kernels.IMPLS)}")
    ap.add_argument("--batches", type=int_list, default=[1])
    ap.add_argument("--contexts", type=int_list, default=[1024])
    ap.add_argument("--nodes", type=int_list_or_empty, default=[16, 64],
                    help="query rows of the verify forwards besides the decode step (\"\": none)")
    ap.add_argument("--variants", type=name_list(VARIANTS), default=["default"],
                    help=f"comma-separated names of XLA option sets, from: {', '.join(VARIANTS)}")
    ap.add_argument("--profile", action="store_true", help="sum the device ops of each forward by kind")
    ap.add_argument("--profile-ops", type=int, default=15, help="ops listed per profile, the longest first")
    ap.add_argument("--hlo", action="store_true", help="write the optimized HLO of the first forward of each kind")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the drafter's head over this many tokens (0: the whole vocabulary)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/bench_models.json"))
    args = ap.parse_args(argv)
    if args.draft_vocab < 0:
        ap.error(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    target, drafter = make_models(args.shapes, args.draft_vocab)
    roofline_ms = 1e3 * streamed_bytes(target) / (args.hbm_tbps * 1e12)
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}; weights streamed "
          f"{streamed_bytes(target) / 1e9:.2f} GB, roofline {roofline_ms:.2f} ms", flush=True)
    variants = [(VARIANTS[v] or None, v) for v in args.variants]
    jobs = []
    for batch in args.batches:
        for context in args.contexts:
            for impl, attention in itertools.product(args.matmul_impls, args.attention_impls):
                for options, variant in variants:
                    key = dict(batch=batch, context=context, matmul_impl=impl, attention_impl=attention,
                               variant=variant)
                    jobs += [(dict(key, forward=f"verify N={n}" if n > 1 else "decode", nodes=n),
                              target_runner(target, batch, context, n, impl, options, attention))
                             for n in [1] + args.nodes]
                    jobs.append((dict(key, forward="drafter", nodes=0),
                                 drafter_runner(target, drafter, batch, context, impl, options, attention)))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # XLA and Triton compile outside the GIL
        compiled = list(pool.map(compile_or_error, jobs))
    print(f"compiled {len(jobs)} forwards in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for (row, (_, fargs)), fn in zip(jobs, compiled):
        if isinstance(fn, str):
            rows.append(dict(row, error=fn))
            print(f"{row['variant']} {row['forward']}: did not compile: {fn}", flush=True)
            continue
        ms = median_ms(lambda fn=fn, fargs=fargs: fn(*fargs)[0], args.repeats)
        row.update(ms=ms, vs_roofline=ms / roofline_ms)
        if args.hlo and not any(r["forward"] == row["forward"] for r in rows):
            name = row["forward"].replace("verify N=", "verify")
            (args.out.parent / f"{args.out.stem}_{name}_{row['matmul_impl']}.hlo.txt").write_text(fn.as_text())
        if args.profile:
            row["profile"] = profiling.device_op_times(lambda fn=fn, fargs=fargs: fn(*fargs)[0],
                                                       top=args.profile_ops)
            print(profiling.format_summary(row["profile"], ops=12), flush=True)
        rows.append(row)
        print(f"batch {row['batch']} ctx {row['context']} {row['matmul_impl']:6s} {row['attention_impl']:6s} "
              f"{row['variant']:15s} "
              f"{row['forward']:>12}: {ms:8.2f} ms  {ms / roofline_ms:5.2f}x roofline", flush=True)
        args.out.write_text(json.dumps(dict(meta=meta(args, roofline_ms), rows=rows), indent=1))
    print(f"wrote {args.out}")


def compile_or_error(job):
    """The compiled forward of a job, or the first line of the compiler's error."""
    fn, fargs = job[1]
    try:
        return fn.lower(*fargs).compile()
    except Exception as e:  # noqa: BLE001 (an experimental XLA option may be refused: keep the other variants)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def meta(args, roofline_ms):
    return dict(device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                command=command_line(), roofline_ms=roofline_ms, hbm_tbps=args.hbm_tbps)


if __name__ == "__main__":
    main()
